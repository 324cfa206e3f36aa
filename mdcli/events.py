"""Typed events: the only thing that flows from strategies to renderers.

A run is a stream ``Start, (Token | Fork | Prune | Finish | Note | Progress)*, Done``. The JSONL
renderer writes each event's `to_dict()` as one line (all but Progress, which is for people and
goes to stderr); the README documents that contract, so field names here are part of the public
interface (they follow vLLM/OpenAI naming where one exists).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Union

FinishReason = Literal["stop", "length", "interrupted"]


@dataclass(frozen=True, slots=True)
class Source:
    """A passage a branch was given to read: lines `first_line`..`last_line` (1-based, inclusive)
    of the document at `path`. `chunk` is its number in the corpus (its `[n]` tag when retrieved;
    a margins answer: the segment's number); `score` its BM25 score for the branch's question
    (None when nothing ranked it)."""

    path: str
    first_line: int
    last_line: int
    chunk: int
    score: float | None = None

    def tag(self) -> str:
        return f"[{self.chunk}] {self.path}:{self.first_line}-{self.last_line}"


@dataclass(frozen=True, slots=True)
class BranchInfo:
    """A branch as announced to renderers.

    `prompt_token_ids` is everything the branch attends to, in order: running exactly this
    sequence alone through the plain model reproduces the branch's tokens. `group` names what
    the branch belongs to when a run answers several things at once (margins: the question), so
    renderers can show a group's branches together; None otherwise. `sources`: the passages the
    branch was given (retrieved chunks, a margins answer's kept segments), in the order it reads them.
    """

    id: int
    label: str
    prompt_token_ids: list[int]
    parent: int | None = None
    exact: bool = True
    group: str | None = None
    sources: tuple[Source, ...] = ()
    constraint: str | None = None  # the output constraint the branch decodes under, if any


@dataclass(frozen=True, slots=True)
class Start:
    model: str
    device: str
    dtype: str
    dtype_reason: str
    attn: str
    strategy: str
    seed: int | None
    branches: list[BranchInfo]
    kernels: str = "torch"  # what runs the forwards and why (mdcli.core.engine.ModelForward.describe)
    type: Literal["start"] = "start"


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token. `text` is the newly decodable text (may be empty while a UTF-8
    character is incomplete)."""

    branch: int
    token_id: int
    text: str
    logprob: float
    type: Literal["token"] = "token"


@dataclass(frozen=True, slots=True)
class Fork:
    """A branch created during the run (a follow-up, a beam, a margin)."""

    branch: BranchInfo
    type: Literal["fork"] = "fork"


@dataclass(frozen=True, slots=True)
class Prune:
    """A branch abandoned before finishing (beam search drops it)."""

    branch: int
    label: str
    reason: str
    type: Literal["prune"] = "prune"


@dataclass(frozen=True, slots=True)
class Finish:
    """A branch is complete. `token_ids` include a final EOS token if one was generated;
    `text` never contains it, nor a matched stop string. `parsed`: for a branch decoded under a
    constraint, the answer as the constraint reads it (the JSON value for a schema, the text for
    choices and regexes) when it is complete; None when it is not (or there is no constraint)."""

    branch: int
    label: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    cumulative_logprob: float
    score: float | None = None
    parsed: Any = None
    type: Literal["finish"] = "finish"


@dataclass(frozen=True, slots=True)
class Note:
    """A strategy-level fact worth showing (a classification, a vote, a fallback)."""

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    type: Literal["note"] = "note"


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a long phase has got. A prefill reports in tokens before its first forward and
    after each one (a forward feeds at most --max-forward-tokens), e.g. ``Progress("prefill",
    1024, 1819)``; a decode reports branches finished after each step, e.g.
    ``Progress("decode", 3, 8, "branches")``. Renderers show it on stderr; it changes no answer."""

    phase: str
    done: int
    total: int
    unit: str = "tokens"
    type: Literal["progress"] = "progress"


@dataclass(frozen=True, slots=True)
class Stats:
    prompt_tokens: int
    prefill_tokens: int
    generated_tokens: int
    steps: int
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    peak_cache_tokens: int
    final_cache_tokens: int
    compactions: int
    draft_tokens: int = 0  # speculative decoding: guessed tokens verified ...
    accepted_tokens: int = 0  # ... and how many of them were the branch's own tokens
    forwards: int = 0  # model forwards in all, prefill pieces included
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prompt cache, not a forward
    peak_rss_bytes: int = 0  # the process's resident peak so far, load included (mdcli.core.resident; 0: unknown)
    graph_captures: int = 0  # CUDA graphs captured during the run (mdcli.backends.graphs): first uses and regrown caches

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Done:
    stats: Stats | None  # None when the run was interrupted before it could finish
    interrupted: bool = False
    type: Literal["done"] = "done"


@dataclass(frozen=True, slots=True)
class DocumentRef:
    """A document of an --each run: its path as found and the sha256 of its text (None: unread)."""

    path: str
    sha256: str | None


@dataclass(frozen=True, slots=True)
class Answer:
    """One question's answer about one document (the Finish of its branch, by question)."""

    question: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    cumulative_logprob: float
    parsed: Any = None


@dataclass(frozen=True, slots=True)
class DocumentDone:
    """--each: a document answered whole, its answers in question order; or refused (`error`: why,
    in one line, and no answers). `index`: its place among the run's documents, in input order.
    `key`: what a rerun with the same output file matches it by (strategies.each.entry_key)."""

    document: DocumentRef
    index: int
    answers: list[Answer]
    key: str | None = None
    error: str | None = None
    type: Literal["document"] = "document"


Event = Union[Start, Token, Fork, Prune, Finish, Note, Progress, Done, DocumentDone]


def event_to_dict(event: Event) -> dict[str, Any]:
    """The JSONL form of an event: `type` first, then the fields."""
    body = asdict(event)
    if isinstance(event, Done) and event.stats is not None:
        body["stats"]["tokens_per_second"] = round(event.stats.tokens_per_second, 3)
    return {"type": body.pop("type"), **body}
