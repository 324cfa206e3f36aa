"""JSON Lines: one event per line on stdout, for programs rather than people.

The line format is `event_to_dict`, documented in the README; nothing else is written to stdout,
so a consumer can parse every line. Lines are flushed one by one so a consumer sees each token
as it is generated. Progress events are for people: they go to the stderr display, if any (a
status line on a terminal, or --progress lines), never to stdout.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from mdcli.events import Done, Event, Progress, event_to_dict
from mdcli.render.base import BranchBook, interrupted_finishes
from mdcli.render.progress import ProgressDisplay, ProgressFeed


class JsonlRenderer:
    """Writes each event as a JSON object on its own line."""

    def __init__(self, stdout: TextIO, *, progress: ProgressDisplay | None = None) -> None:
        self._stdout = stdout
        self._book = BranchBook()
        self._ended = False
        self._progress = ProgressFeed(progress)

    def handle(self, event: Event) -> None:
        self._book.apply(event)
        self._progress.handle(event)
        if isinstance(event, Progress):
            return
        self._write(event_to_dict(event))
        if isinstance(event, Done):
            self._ended = True

    def interrupted(self) -> None:
        """End the stream as a run would have: a finish line for each branch cut short, then a
        done line (with no stats, which were never computed), so that a consumer waiting for
        ``done`` stops waiting."""
        for finish in interrupted_finishes(self._book):
            self.handle(finish)
        if not self._ended:
            self.handle(Done(stats=None, interrupted=True))

    def close(self) -> None:
        """Erase the progress line, if any: every line is already flushed."""
        self._progress.stop()

    def _write(self, record: dict[str, Any]) -> None:
        self._stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._stdout.flush()
