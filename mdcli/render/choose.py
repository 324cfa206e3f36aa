"""Choosing a renderer: the one place that knows every renderer, so none of them (nor the
helpers they share in base.py) needs to import another."""

from __future__ import annotations

from typing import Literal, TextIO

from mdcli.render.base import Renderer, color_disabled
from mdcli.render.jsonl import JsonlRenderer, JsonRenderer
from mdcli.render.live import LiveRenderer, make_console
from mdcli.render.plain import PlainRenderer
from mdcli.render.progress import choose_progress

RenderMode = Literal["auto", "live", "plain", "jsonl", "json"]


def choose_renderer(
    mode: RenderMode,
    *,
    stdout: TextIO,
    stderr: TextIO,
    quiet: bool,
    no_color: bool,
    header: str | None = None,
    progress: bool = False,
    show_margins: bool = False,
) -> Renderer:
    """The renderer for `mode`; ``auto`` is a live display on a terminal and plain text in a
    pipeline, where escape codes and redraws would only get in the way.

    Progress (render/progress.py) goes to stderr: a transient status line when stderr is a
    terminal, else one line every few seconds if `progress` (--progress) asks, never with
    `quiet`; the live display shows it in its frame (see `choose_progress`).
    """
    color = not color_disabled(no_color)
    if mode == "auto":
        mode = "live" if stdout.isatty() else "plain"
    status = choose_progress(
        mode, stdout, stderr, quiet=quiet, requested=progress, terminal=lambda: make_console(stderr, color=color)
    )
    if mode == "jsonl":
        return JsonlRenderer(stdout, progress=status)
    if mode == "json":
        return JsonRenderer(stdout, progress=status)
    if mode == "plain":
        return PlainRenderer(stdout, stderr, quiet=quiet, header=header, progress=status, show_margins=show_margins)
    return LiveRenderer(
        make_console(stdout, color=color),
        make_console(stderr, color=color),
        quiet=quiet,
        header=header,
        progress=status,
        # the same answers on stdout as plain output (notes: the live display shows its own)
        answers=lambda out, err: PlainRenderer(out, err, quiet=True, show_margins=show_margins, notes=False,
                                               cut_note=not quiet),
    )
