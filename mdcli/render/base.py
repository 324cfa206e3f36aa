"""What every renderer shares: the protocol, per-branch bookkeeping, and the text formats.

The renderers import this module; it imports none of them (choosing one is render/choose.py).

Renderers differ only in presentation. The facts they present (what each branch has said so
far, whether it is done, what to print when the user presses Ctrl-C) are derived from the event
stream in exactly the same way everywhere, so that derivation lives here once and is tested on
its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from mdcli import settings
from mdcli.events import Done, Event, Finish, Fork, Prune, Source, Start, Stats, Token

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
    sources: tuple[Source, ...] = ()  # the passages it was given (BranchInfo.sources)
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
                self._announce(info.id, info.label, info.parent, info.group, info.sources)
                self[info.id].json = _is_schema(info.constraint)
        elif isinstance(event, Fork):
            branch = event.branch
            self._announce(branch.id, branch.label, branch.parent, branch.group, branch.sources)
            self[branch.id].json = _is_schema(branch.constraint)
        elif isinstance(event, Token):
            self[event.branch].add_token(event)
        elif isinstance(event, Finish):
            self[event.branch].finish(event)
        elif isinstance(event, Prune):
            self[event.branch].status = "pruned"
        elif isinstance(event, Done):
            self.done = event

    def _announce(
        self, branch_id: int, label: str, parent: int | None, group: str | None = None, sources: tuple = ()
    ) -> None:
        if branch_id in self._branches:
            raise ValueError(f"branch {branch_id} ({label!r}) was announced twice")
        self._branches[branch_id] = BranchState(branch_id, label, parent, group, sources=tuple(sources))

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


CUT_MARK = " …"
"""Ends the printed text of an answer that stopped at its token limit (-n), not at its end."""


def answer_block(
    label: str, text: str, *, headered: bool, cut: bool = False, facts: str | None = None,
    sources: tuple[Source, ...] = (),
) -> str:
    """One branch's answer as printed to stdout: under a ``## label`` heading followed by a
    blank line when there are several answers, or the bare text when there is only one (so
    that ``mdcli ... | wc -w`` counts the answer's words and nothing else). A `cut` answer (it
    stopped at -n) ends in CUT_MARK; `facts` (a beam's score and finish reason) follow the label. A
    branch that was given passages lists them under its answer: ``Sources: [1] a.txt:3-9, [4] b.md:1-12``."""
    if cut:
        text = text.rstrip("\n") + CUT_MARK
    body = text if text.endswith("\n") else text + "\n"
    if sources:
        body += sources_line(sources) + "\n"
    heading = label if facts is None else f"{label} · {facts}"
    return f"## {heading}\n{body}\n" if headered else body


def was_cut(branch: BranchState) -> bool:
    """Whether the branch stopped at its token limit rather than at EOS or a stop string."""
    return branch.status == "finished" and branch.finish_reason == "length"


def cut_note(branches: list[BranchState]) -> str | None:
    """One stderr line naming the printed answers that stopped at their token limit (their text
    is left as generated; plain output marks each with CUT_MARK). None when none did."""
    if not branches:
        return None
    counts = {branch.token_count for branch in branches}
    if len(branches) == 1:
        return f"note: '{branches[0].label}' stopped at -n {branches[0].token_count} (cut short, marked …); raise -n for more"
    if len(counts) == 1:
        names = _some(f"'{branch.label}'" for branch in branches)
        return f"note: {len(branches):,} answers stopped at -n {counts.pop()} (cut short, marked …): {names}; raise -n for more"
    names = _some(f"'{branch.label}' at {branch.token_count}" for branch in branches)
    return f"note: {len(branches):,} answers stopped at their -n (cut short, marked …): {names}; raise -n for more"


NAMES_IN_A_NOTE = 6
"""A note names at most this many branches, then says how many more: a run of 2,000 paths must not
write a 25 KB line."""


def _some(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:NAMES_IN_A_NOTE])
    return shown if len(names) <= NAMES_IN_A_NOTE else f"{shown} and {len(names) - NAMES_IN_A_NOTE:,} more"


def scored_facts(branch: BranchState) -> str | None:
    """A beam hypothesis's heading facts: its score and how it ended (None for unscored branches)."""
    if branch.score is None:
        return None
    ending = {"stop": "stop (EOS)", "length": "length (-n)"}.get(branch.finish_reason or "", branch.finish_reason)
    return f"score {branch.score:.4f} · {ending}"


_VISIBLE_WHITESPACE = {"\n": "⏎", " ": "·", "\t": "→", "\r": "␍"}


def visible_trailing_whitespace(text: str) -> str:
    """`text` with its trailing whitespace drawn (⏎ newline, · space, → tab), so that two beam
    hypotheses that differ only there do not print alike."""
    body = text.rstrip()
    tail = text[len(body):]
    return body + "".join(_VISIBLE_WHITESPACE.get(ch, ch) for ch in tail)


def answer_record(branch: BranchState, strategy: str | None = None) -> dict:
    """One answer as --json and JSONL's `answers` record give it: the text exactly as generated.
    `question` is the question it answers where the run has questions (ask-many labels each
    answer with its question; margins groups by it), else None."""
    record = {
        "label": branch.label,
        "question": branch.group or (branch.label if strategy == "ask-many" else None),
        "text": branch.text,
        "finish_reason": branch.finish_reason,
        "tokens": branch.token_count,
        "cumulative_logprob": round(branch.cumulative_logprob, 6),
    }
    if branch.score is not None:
        record["score"] = branch.score
    if branch.sources:
        record["sources"] = [asdict(source) for source in branch.sources]
    if branch.json:
        record["parsed"] = branch.parsed  # None: the answer did not complete its schema
    return record


def answers_record(book: BranchBook) -> dict:
    """JSONL's `answers` line (also --json's `answers`): every answer in question order."""
    strategy = book.start.strategy if book.start is not None else None
    return {"type": "answers", "answers": [answer_record(branch, strategy) for branch in answer_branches(book)]}


def answer_branches(book: BranchBook) -> list[BranchState]:
    """The branches a run answers with, in question (announcement) order: what plain output prints.
    A margins run answers with one branch per question (labelled by it, or "answer"); its margins
    and classifications are working notes."""
    shown = [branch for branch in in_group_order(list(book)) if branch.status != "pruned"]
    if book.start is not None and book.start.strategy == "margins":
        return [branch for branch in shown if branch.label in (branch.group, "answer")]
    return shown


def sources_line(sources: tuple[Source, ...]) -> str:
    return "Sources: " + ", ".join(source.tag() for source in sources)


def summary_line(book: BranchBook, stats: Stats, *, interrupted: bool = False) -> str:
    """One line of run statistics, e.g. ``8 branches · 412 tokens in 37 steps · 5.2 s (prefill 0.0 s,
    decode 5.2 s at 79.1 tok/s) · cache peak 1,912 tokens · peak RSS 612 MiB``: the run's seconds,
    then how many of them prefill and decode took, the rate being generated tokens per decode
    second; the process's resident peak, load included, left out where the platform does not say.
    A run whose tokens all came off the prefill's logits (one-token answers) has no decode and
    shows no rate."""
    pruned = len(book.with_status("pruned"))
    branches = f"{len(book)} branch" + ("" if len(book) == 1 else "es")
    if pruned:
        branches += f" ({pruned} pruned)"
    parts = [
        branches,
        _tokens_part(stats),
        _seconds_part(stats),
        f"cache peak {stats.peak_cache_tokens:,} tokens",
    ]
    if stats.cached_tokens:
        parts.append(f"{stats.cached_tokens:,} prompt tokens from the prompt cache")
    if stats.peak_rss_bytes:
        parts.append(f"peak RSS {stats.peak_rss_bytes / 2**20:,.0f} MiB")
    if interrupted:
        parts.append("interrupted")
    return " · ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _seconds_part(stats: Stats) -> str:
    """``5.2 s (prefill 0.4 s, decode 4.8 s at 85.8 tok/s)``; without a decode step,
    ``0.3 s (prefill 0.3 s)``."""
    if not stats.steps:
        return f"{stats.seconds:.1f} s (prefill {stats.prefill_seconds:.1f} s)"
    return (f"{stats.seconds:.1f} s (prefill {stats.prefill_seconds:.1f} s, decode {stats.decode_seconds:.1f} s "
            f"at {stats.tokens_per_second:.1f} tok/s)")


def _tokens_part(stats: Stats) -> str:
    """``N tokens in S steps``; with speculative drafts, ``N tokens in S steps (A% of drafts
    accepted)``. A step is one decode forward over every live branch, drafts or not. Without a
    step, every token came off the prefill's logits: ``2 tokens from the prefill, no decode step``."""
    if not stats.steps:
        return _count(stats.generated_tokens, "token") + " from the prefill, no decode step"
    steps = f"{_count(stats.generated_tokens, 'token')} in {_count(stats.steps, 'step')}"
    if not stats.draft_tokens:
        return steps
    accepted = 100 * stats.accepted_tokens / stats.draft_tokens
    return f"{steps} ({accepted:.0f}% of drafts accepted)"


def color_disabled(no_color: bool) -> bool:
    """The --no-color flag, or the NO_COLOR convention (https://no-color.org): set and
    non-empty."""
    return no_color or settings.current().colour_off


def _is_schema(constraint: str | None) -> bool:
    return constraint is not None and constraint.startswith("schema:")
