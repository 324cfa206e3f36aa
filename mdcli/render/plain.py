"""Plain text for pipelines: answers on stdout, everything else on stderr, no escape codes.

Answers are printed in branch order (Start's branches, then Forks) so the output is the same
whatever order the branches happen to finish in, yet each answer is printed as soon as it and
every answer before it are done, so a downstream program can start early. A margins run prints
one block per question instead (mdcli/render/margins.py).
"""

from __future__ import annotations

import json
from typing import TextIO

from mdcli.events import Done, Event, Finish, Note, Prune, Start
from mdcli.render.base import (
    BranchBook,
    BranchState,
    answer_block,
    cut_note,
    describe_start,
    in_group_order,
    interrupted_finishes,
    scored_facts,
    summary_line,
    visible_trailing_whitespace,
    was_cut,
)
from mdcli.render.margins import MarginsPlain
from mdcli.render.progress import ProgressDisplay, ProgressFeed


class PlainRenderer:
    """Prints each finished branch as ``## label`` + text, or the bare text for a single branch.

    `quiet` drops the header and summary lines and the note naming the answers cut by -n (each
    still ends in " …" on stdout); the strategy's notes and interruption marks still go to stderr
    because they change what the answers mean. `cut_note` overrides `quiet` for that note (the
    live display's answers are printed by a quiet PlainRenderer). `progress` (see progress.py) shows how
    far the run has got; it is cleared before anything else is written. `notes=False` leaves
    the strategy's notes out of stderr (the live display shows them its own way).

    What stdout holds beyond the answers: a think vote's result (a ``## vote`` block at the end:
    the answer, how many paths gave it, and each path's answer), and for beam search each
    hypothesis's score and finish reason in its heading, with trailing whitespace drawn (⏎, ·)
    so hypotheses that differ only there do not print alike. An answer that stopped at -n ends
    in " …", and one stderr note names those answers.
    """

    def __init__(
        self,
        stdout: TextIO,
        stderr: TextIO,
        *,
        quiet: bool = False,
        header: str | None = None,
        progress: ProgressDisplay | None = None,
        show_margins: bool = False,
        notes: bool = True,
        cut_note: bool | None = None,
    ) -> None:
        self._stdout = stdout
        self._notes = notes
        self._cut_note = not quiet if cut_note is None else cut_note
        self._vote: Note | None = None
        self._cut: list[BranchState] = []
        self._show_margins = show_margins
        self._margins = None  # a MarginsPlain once a margins run starts
        self._stderr = stderr
        self._quiet = quiet
        self._header = header
        self._book = BranchBook()
        self._printed = 0
        self._headered: bool | None = None
        self._ended = False
        self._progress = ProgressFeed(progress)

    def handle(self, event: Event) -> None:
        self._book.apply(event)
        if not self._ended:
            self._progress.handle(event)
        if isinstance(event, Start) and event.strategy == "margins":
            self._margins = MarginsPlain(self._stdout, self._book, show_margins=self._show_margins,
                                         before_write=self._progress.clear, on_cut=self._cut.append)
        if self._margins is not None and not isinstance(event, Done):
            self._margins.handle(event)
        if isinstance(event, Start):
            self._on_start(event)
        elif self._margins is not None and isinstance(event, (Finish, Prune)):
            pass
        elif isinstance(event, (Finish, Prune)):
            self._decide_headers_early()
            self._print_settled_prefix()
        elif isinstance(event, Note) and event.kind == "vote":
            self._vote = event  # printed on stdout after the answers
        elif isinstance(event, Note) and self._notes:
            self._chrome(f"{event.kind}: {event.message}")
        elif isinstance(event, Done):
            self._end_run()
            if not self._quiet:
                self._chrome(
                    summary_line(self._book, event.stats, interrupted=event.interrupted)
                )

    def interrupted(self) -> None:
        """Print every branch not yet printed, the unfinished ones with their partial text."""
        self._end_run()

    def close(self) -> None:
        """Erase the progress line; every answer is already flushed."""
        self._progress.stop()

    def _on_start(self, start: Start) -> None:
        if not self._quiet:
            self._chrome(self._header or describe_start(start))
        if len(start.branches) >= 2:
            self._headered = True

    def _decide_headers_early(self) -> None:
        """Headings are needed once a second answer exists. Until then the first answer waits,
        because a later Fork may still turn a single-answer run into a multi-answer one."""
        if self._headered is None and len(self._book.with_status("finished")) >= 2:
            self._headered = True

    def _end_run(self) -> None:
        """Settle every running branch as interrupted and print all that is left (a no-op the
        second time, so Done followed by Ctrl-C prints nothing twice)."""
        if self._ended:
            return
        self._ended = True
        self._progress.stop()
        for finish in interrupted_finishes(self._book):
            self._book.apply(finish)
        if self._margins is not None:
            self._margins.end()
            self._say_cut()
            return
        if self._headered is None:
            self._headered = (
                len(self._book) - len(self._book.with_status("pruned")) >= 2 or self._vote is not None
            )
        self._print_settled_prefix()
        self._print_vote()
        self._say_cut()

    def _print_vote(self) -> None:
        """think --vote's result, on stdout with the answers: a script (or `> out.txt`) keeps it."""
        if self._vote is None:
            return
        self._progress.clear()
        self._stdout.write(answer_block("vote", self._vote.message, headered=True))
        self._stdout.flush()

    def _say_cut(self) -> None:
        line = cut_note(self._cut) if self._cut_note else None
        if line is not None:
            self._chrome(line)

    def _print_settled_prefix(self) -> None:
        """Print, in branch order, the settled branches up to the first one still running."""
        if self._headered is None:
            return
        branches = in_group_order(list(self._book))
        while self._printed < len(branches) and branches[self._printed].settled:
            self._print_answer(branches[self._printed])
            self._printed += 1

    def _print_answer(self, branch: BranchState) -> None:
        if branch.status == "pruned":
            return
        self._progress.clear()  # stdout and stderr may be the same terminal
        headered = bool(self._headered)
        facts = scored_facts(branch)
        if branch.json:  # --schema: the JSON document alone, one per line, for jq
            if branch.parsed is not None:
                self._stdout.write(json.dumps(branch.parsed, ensure_ascii=False) + "\n")
        else:
            text = visible_trailing_whitespace(branch.text) if facts is not None and headered else branch.text
            cut = was_cut(branch)  # a beam hypothesis too, though its heading says "length" as well
            if cut:
                self._cut.append(branch)
            self._stdout.write(
                answer_block(branch.label, text, headered=headered, cut=cut, facts=facts, sources=branch.sources)
            )
        self._stdout.flush()
        if facts is not None and not headered and not self._quiet:
            self._chrome(f"{branch.label}: {facts}")
        if branch.finish_reason == "interrupted":
            self._chrome(
                f"interrupted: {branch.label} after {branch.token_count} tokens"
            )

    def _chrome(self, line: str) -> None:
        self._progress.clear()
        self._stderr.write(line + "\n")
        self._stderr.flush()
