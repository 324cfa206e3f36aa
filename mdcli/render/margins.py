"""Plain text for a margins run: one block per question, in question order.

    ## Which projects went over budget, and why?      (a heading when there are several
    Falcon and Osprey went over budget ...              questions, or with --show-margins)

    ### margins (answer read 2 of 8)                  (only with --show-margins)
    [segment 1/8] kept: Falcon went over by 40,000 dollars ...
    [segment 2/8] left out (NO#only Heron, on budget): ...

A question's block is printed as soon as its answer and every earlier question's answer have
finished. The facts come from the events alone: Start's margin branches (grouped by question),
the "classification" notes (verdicts) and the "answer-sources" notes (which branch answers which
question, and the margins it read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from mdcli.events import Event, Finish, Fork, Note, Start
from mdcli.render.base import CUT_MARK, BranchBook, BranchState, sources_line, was_cut


@dataclass
class _Question:
    title: str
    group: str | None
    margins: list[int] = field(default_factory=list)  # margin branch ids, in segment order
    answer: int | None = None
    kept: list[int] = field(default_factory=list)
    printed: bool = False


class MarginsPlain:
    """The margins part of PlainRenderer: it reads every event and prints whole question blocks."""

    def __init__(self, stdout: TextIO, book: BranchBook, *, show_margins: bool,
                 before_write: Callable[[], None] = lambda: None,
                 on_cut: Callable[[BranchState], None] = lambda branch: None) -> None:
        self._stdout = stdout
        self._on_cut = on_cut  # an answer that stopped at its token limit (the caller says so on stderr)
        self._before_write = before_write  # erases a progress line when stdout and stderr share a terminal
        self._book = book
        self._show_margins = show_margins
        self._questions: list[_Question] = []
        self._verdicts: dict[int, str] = {}  # margin branch -> "NO#reason" style text, when left out

    def handle(self, event: Event) -> None:
        if isinstance(event, Start):
            self._on_start(event)
        elif isinstance(event, Fork) and event.branch.label in (event.branch.group, "answer"):
            # an answer (labelled by its question, or "answer"): known before its sources note,
            # so an interrupted run can still print what it has
            for question in self._questions:
                if question.group == event.branch.group:
                    question.answer = event.branch.id
        elif isinstance(event, Note) and event.kind == "classification":
            if not event.data.get("relevant", True):
                reason = event.data.get("reason") or ""
                self._verdicts[event.data["margin_branch"]] = reason
        elif isinstance(event, Note) and event.kind == "answer-sources":
            question = self._questions[event.data.get("question", 1) - 1]
            question.answer = event.data["branch"]
            question.kept = list(event.data.get("margin_branches", []))
        elif isinstance(event, Finish):
            self._print_finished_prefix()

    def end(self) -> None:
        """Print every block not yet printed (an interrupted run: whatever the answer has)."""
        for question in self._questions:
            self._print(question)

    def _on_start(self, start: Start) -> None:
        by_group: dict[str | None, _Question] = {}
        for info in start.branches:
            if info.group not in by_group:
                by_group[info.group] = _Question(title=info.group or "answer", group=info.group)
                self._questions.append(by_group[info.group])
            by_group[info.group].margins.append(info.id)

    def _headered(self) -> bool:
        return len(self._questions) > 1 or self._show_margins

    def _print_finished_prefix(self) -> None:
        for question in self._questions:
            if question.printed:
                continue
            if question.answer is None or not self._book[question.answer].settled:
                return
            self._print(question)

    def _print(self, question: _Question) -> None:
        if question.printed:
            return
        question.printed = True
        branch = self._book[question.answer] if question.answer is not None else None
        lines = [f"## {question.title}"] if self._headered() else []
        if branch is None:
            lines.append("(interrupted before the answer)")
        elif was_cut(branch):
            self._on_cut(branch)
            lines.append(branch.text.rstrip("\n") + CUT_MARK)
        else:
            lines.append(branch.text.rstrip("\n"))
        if branch is not None and branch.sources:
            lines.append(sources_line(branch.sources))
        if self._show_margins:
            lines += ["", f"### margins (answer read {len(question.kept)} of {len(question.margins)})"]
            lines += [self._margin_line(question, branch) for branch in question.margins]
        self._before_write()
        self._stdout.write("\n".join(lines) + "\n" + ("\n" if self._headered() else ""))
        self._stdout.flush()

    def _margin_line(self, question: _Question, branch: int) -> str:
        state = self._book[branch]
        segment = state.label.split(" ", 1)[1] if state.label.startswith("q") else state.label
        if question.answer is None:
            status = "not classified yet"
        elif branch in question.kept:
            status = "kept"
        else:
            reason = self._verdicts.get(branch)
            status = f"left out ({reason})" if reason else "left out"
        text = " ".join(state.text.split())
        return f"[{segment}] {status}: {text}"
