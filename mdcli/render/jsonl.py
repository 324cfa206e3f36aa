"""JSON for programs rather than people: JSON Lines (--jsonl) or one JSON document (--json).

JSONL: one event per line, in the format `event_to_dict` gives (docs/cli.md documents it);
nothing else is written to stdout, so a consumer can parse every line. Lines are flushed one by
one so a consumer sees each token as it is generated. Just before the `done` line comes one
`answers` line: every answer in question order (`answers_record`), so a script need not pair
`finish` lines (which arrive in finishing order) with questions. Progress events are for people:
they go to the stderr display, if any (a status line on a terminal, or --progress lines), never
to stdout.

--json: nothing until the run ends, then one document: the run (model, strategy, seed), every
answer in question order, the strategy's notes (a think vote also as `vote`) and the stats.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from mdcli.events import Done, Event, Note, Progress, event_to_dict
from mdcli.render.base import BranchBook, answers_record, interrupted_finishes
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
        if isinstance(event, Done):
            self._write(answers_record(self._book))
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


class JsonRenderer:
    """Collects the run and writes it as one JSON document when it ends (or is interrupted)."""

    def __init__(self, stdout: TextIO, *, progress: ProgressDisplay | None = None) -> None:
        self._stdout = stdout
        self._book = BranchBook()
        self._notes: list[Note] = []
        self._written = False
        self._progress = ProgressFeed(progress)

    def handle(self, event: Event) -> None:
        self._book.apply(event)
        self._progress.handle(event)
        if isinstance(event, Note):
            self._notes.append(event)
        if isinstance(event, Done):
            self._write(event)

    def interrupted(self) -> None:
        """Write what there is: unfinished answers with their partial text, `interrupted` true."""
        for finish in interrupted_finishes(self._book):
            self._book.apply(finish)
        self._write(Done(stats=None, interrupted=True))

    def close(self) -> None:
        self._progress.stop()

    def _write(self, done: Done) -> None:
        if self._written:
            return
        self._written = True
        self._progress.stop()
        start = self._book.start
        document: dict[str, Any] = {
            "strategy": start.strategy if start else None,
            "model": start.model if start else None,
            "seed": start.seed if start else None,
            "answers": answers_record(self._book)["answers"],
        }
        vote = next((note for note in self._notes if note.kind == "vote"), None)
        if vote is not None:
            document["vote"] = vote.data
        document["notes"] = [{"kind": note.kind, "message": note.message, "data": note.data} for note in self._notes]
        document["interrupted"] = done.interrupted
        document["stats"] = event_to_dict(done)["stats"] if done.stats is not None else None
        self._stdout.write(json.dumps(document, ensure_ascii=False, indent=2) + "\n")
        self._stdout.flush()
