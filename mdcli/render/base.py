"""What every renderer shares: the protocol, per-branch bookkeeping, and the text formats.

The renderers import this module; it imports none of them (choosing one is render/choose.py).

Renderers differ only in presentation. The facts they present (what each branch has said so
far, whether it is done, what to print when the user presses Ctrl-C) are derived from the event
stream in exactly the same way everywhere, so that derivation lives here once and is tested on
its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mdcli import settings
from mdcli.events import Done, Event, Finish, Fork, Prune, Start, Stats, Token

BranchStatus = Literal["running", "finished", "pruned"]


class Renderer(Protocol):
    """Consumes one run's stream ``Start, (Token | Fork | Prune | Finish | Note | Progress)*, Done``."""

    def handle(self, event: Event) -> None:
        """Show one event."""

    def interrupted(self) -> None:
        """Ctrl-C: flush whatever was generated so far (partial branches), then return."""

    def close(self) -> None:
        """Stop live displays; safe to call more than once."""


@dataclass
class BranchState:
    """One branch as the events have described it so far.

    Token texts are kept as pieces and joined on demand, because a live display reads the text
    a dozen times a second while tokens arrive far more often.
    """

    id: int
    label: str
    parent: int | None
    group: str | None = None
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: BranchStatus = "running"
    finish_reason: str | None = None
    score: float | None = None
    json: bool = False  # decoded under a JSON schema: plain output prints its document alone
    parsed: Any = None  # Finish.parsed
    _pieces: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        """The branch's text: the streamed tokens, or the authoritative `Finish.text` once done."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @property
    def settled(self) -> bool:
        """Finished or pruned: nothing more will arrive for this branch."""
        return self.status != "running"

    def add_token(self, token: Token) -> None:
        self._pieces.append(token.text)
        self.token_ids.append(token.token_id)
        self.cumulative_logprob += token.logprob

    def finish(self, finish: Finish) -> None:
        """Adopt the Finish event's facts: its text has stop strings removed, which the
        streamed tokens do not."""
        self._pieces = [finish.text]
        self.token_ids = list(finish.token_ids)
        self.cumulative_logprob = finish.cumulative_logprob
        self.label = finish.label
        self.status = "finished"
        self.finish_reason = finish.finish_reason
        self.score = finish.score
        self.parsed = finish.parsed


class BranchBook:
    """Per-branch state folded from the event stream, in order of announcement
    (Start's branches, then Forks as they arrive)."""

    def __init__(self) -> None:
        self._branches: dict[int, BranchState] = {}
        self.start: Start | None = None
        self.done: Done | None = None

    def apply(self, event: Event) -> None:
        """Fold one event in. Events that carry no branch state (Note, Progress) are ignored."""
        if isinstance(event, Start):
            self.start = event
            for info in event.branches:
                self._announce(info.id, info.label, info.parent, info.group)
                self[info.id].json = _is_schema(info.constraint)
        elif isinstance(event, Fork):
            self._announce(event.branch.id, event.branch.label, event.branch.parent, event.branch.group)
            self[event.branch.id].json = _is_schema(event.branch.constraint)
        elif isinstance(event, Token):
            self[event.branch].add_token(event)
        elif isinstance(event, Finish):
            self[event.branch].finish(event)
        elif isinstance(event, Prune):
            self[event.branch].status = "pruned"
        elif isinstance(event, Done):
            self.done = event

    def _announce(self, branch_id: int, label: str, parent: int | None, group: str | None = None) -> None:
        if branch_id in self._branches:
            raise ValueError(f"branch {branch_id} ({label!r}) was announced twice")
        self._branches[branch_id] = BranchState(branch_id, label, parent, group)

    def __getitem__(self, branch_id: int) -> BranchState:
        try:
            return self._branches[branch_id]
        except KeyError:
            raise ValueError(
                f"event for branch {branch_id}, which was never announced"
            ) from None

    def __iter__(self) -> Iterator[BranchState]:
        return iter(self._branches.values())

    def __len__(self) -> int:
        return len(self._branches)

    def with_status(self, status: BranchStatus) -> list[BranchState]:
        return [branch for branch in self._branches.values() if branch.status == status]

    def in_tree_order(self) -> list[BranchState]:
        """Branches depth-first, each followed by the branches forked from it, so that a
        follow-up is shown right after the answer it follows."""
        children: dict[int | None, list[BranchState]] = {}
        for branch in self._branches.values():
            parent = branch.parent if branch.parent in self._branches else None
            children.setdefault(parent, []).append(branch)
        ordered: list[BranchState] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            branch = stack.pop()
            ordered.append(branch)
            stack.extend(reversed(children.get(branch.id, [])))
        return in_group_order(ordered)


def in_group_order(branches: list[BranchState]) -> list[BranchState]:
    """`branches` with each group's branches together, where its first one is (a margins run:
    a question's margins, classifications and answer); ungrouped branches keep their place."""
    first: dict[str, int] = {}
    for position, branch in enumerate(branches):
        if branch.group is not None:
            first.setdefault(branch.group, position)
    if not first:
        return branches
    keyed = [
        (first[b.group] if b.group is not None else position, position, b) for position, b in enumerate(branches)
    ]
    return [b for _, _, b in sorted(keyed, key=lambda item: item[:2])]


def interrupted_finishes(book: BranchBook) -> list[Finish]:
    """The Finish events a run would have ended with had Ctrl-C been a stop condition: one per
    branch still running, carrying what it generated so far."""
    return [
        Finish(
            branch=branch.id,
            label=branch.label,
            text=branch.text,
            token_ids=list(branch.token_ids),
            finish_reason="interrupted",
            cumulative_logprob=branch.cumulative_logprob,
        )
        for branch in book.with_status("running")
    ]


def describe_start(start: Start) -> str:
    """The default header: what runs, where, why in that precision, and (on CPU) on which kernels."""
    header = f"{start.model} · {start.device} · {start.dtype} ({start.dtype_reason}) · {start.strategy}"
    if start.device.startswith("cpu"):
        header += f" · kernels {start.kernels}"
    return header


def answer_block(label: str, text: str, *, headered: bool) -> str:
    """One branch's answer as printed to stdout: under a ``## label`` heading followed by a
    blank line when there are several answers, or the bare text when there is only one (so
    that ``mdcli ... | wc -w`` counts the answer's words and nothing else)."""
    body = text if text.endswith("\n") else text + "\n"
    return f"## {label}\n{body}\n" if headered else body


def summary_line(book: BranchBook, stats: Stats, *, interrupted: bool = False) -> str:
    """One line of run statistics, e.g.
    ``8 branches · 412 tokens in 37 steps · 5.2 s · 79.1 tok/s · cache peak 1,912 tokens``."""
    pruned = len(book.with_status("pruned"))
    branches = f"{len(book)} branch" + ("" if len(book) == 1 else "es")
    if pruned:
        branches += f" ({pruned} pruned)"
    parts = [
        branches,
        _tokens_part(stats),
        f"{stats.seconds:.1f} s",
        f"{stats.tokens_per_second:.1f} tok/s",
        f"cache peak {stats.peak_cache_tokens:,} tokens",
    ]
    if interrupted:
        parts.append("interrupted")
    return " · ".join(parts)


def _tokens_part(stats: Stats) -> str:
    """``N tokens in S steps``; with speculative drafts, ``N tokens in F forwards (A% of drafts
    accepted)``, F being the decode forwards (one per step)."""
    if not stats.draft_tokens:
        return f"{stats.generated_tokens:,} tokens in {stats.steps:,} steps"
    accepted = 100 * stats.accepted_tokens / stats.draft_tokens
    return f"{stats.generated_tokens:,} tokens in {stats.steps:,} forwards ({accepted:.0f}% of drafts accepted)"


def color_disabled(no_color: bool) -> bool:
    """The --no-color flag, or the NO_COLOR convention (https://no-color.org): set and
    non-empty."""
    return no_color or settings.current().colour_off


def _is_schema(constraint: str | None) -> bool:
    return constraint is not None and constraint.startswith("schema:")
