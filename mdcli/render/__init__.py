"""Renderers: turn a run's event stream into live panels, plain text or JSON Lines."""

from mdcli.render.base import BranchBook, BranchState, Renderer, color_disabled
from mdcli.render.choose import RenderMode, choose_renderer
from mdcli.render.jsonl import JsonlRenderer
from mdcli.render.live import LiveRenderer, make_console
from mdcli.render.plain import PlainRenderer

__all__ = [
    "BranchBook",
    "BranchState",
    "JsonlRenderer",
    "LiveRenderer",
    "PlainRenderer",
    "RenderMode",
    "Renderer",
    "choose_renderer",
    "color_disabled",
    "make_console",
]
