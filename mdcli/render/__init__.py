"""Renderers: turn a run's event stream into live panels, plain text or JSON Lines."""

from mdcli.render.base import BranchBook, BranchState, Renderer, choose_renderer
from mdcli.render.jsonl import JsonlRenderer
from mdcli.render.live import LiveRenderer
from mdcli.render.plain import PlainRenderer

__all__ = [
    "BranchBook",
    "BranchState",
    "JsonlRenderer",
    "LiveRenderer",
    "PlainRenderer",
    "Renderer",
    "choose_renderer",
]
