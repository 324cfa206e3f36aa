"""margins: Writing in the Margins (Russak et al. 2024) with every margin written at once.

The paper reads a long context segment by segment; after each segment the model writes a
*margin*, an extractive note of what is relevant to the query, then rolls its cache back and
reads on. Margins are classified relevant or not by the same model, and the relevant ones are put
before the query for the final answer. Here each of the three stages is ONE decoding phase of one
`Decoder` over one shared cache:

1. margins, all at once. Each margin is a branch whose prompt is built and tokenized WHOLE:
   the chat-templated user turn `MARGIN_TEMPLATE` with `$context` and `$query`. What `$context`
   holds is the layout:

   * `chain` (default for one document, as in the paper): segments 1..i of the documents read so
     far; documents are separated by a blank line and each is stripped of surrounding whitespace.
     Prompt i+1 extends prompt i's context, so the radix prefill (decoding.prefill_prompts)
     stores the document about once, plus one instruction per margin.
   * `independent` (default for several documents, retrieved passages): segment i alone,
     stripped. Only the system prompt and the template's head are shared.

2. classification, all at once: for each margin `CLASSIFICATION_TEMPLATE` ($query, $margin),
   answered "YES#reason" or "NO#reason" (the paper's prompt). Always greedy: a verdict should not
   be sampled. Read by `parse_verdict`; a reply with no YES/NO counts as relevant, and the Note
   says it was not understood. Skipped with `classify=False` (every margin is kept).

3. the answer, one branch: `ANSWER_TEMPLATE` with `$notes` (the kept margins in segment order,
   each rendered with `NOTE_TEMPLATE`, or `NOTE_WITH_SEGMENT_TEMPLATE` when the source segments
   are included) and `$query`; `NO_NOTES` stands in when no margin is kept.

Every branch is exact: its tokens are what the model gives its `prompt_token_ids` alone. The cache
is emptied between phases (nothing later reuses the document).

Events: Start (the margin branches, labelled "segment 3/8", or "segment 3/8 (doc2.txt)" for several
documents); Note kind "margins-layout" (prompt tokens and how many of them the cache holds);
Note kind "segment-split" for each segment cut inside a sentence; the margins' Token/Finish; a
Fork per classification branch ("relevance 3/8") and their Token/Finish, each Finish followed by
Note kind "classification" with data {"branch", "margin_branch", "segment", "document",
"relevant", "parsed", "reason"}; a Fork for the answer ("answer"), its Tokens, then Note kind
"answer-sources" with data {"branch": answer id, "segments": [...], "margin_branches": [...]}
right before the answer's Finish; Done with the stats of all phases. Segment numbers are 1-based,
as in the labels.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mdcli.decoding import BranchSpec, Decoder, common_prefix_length
from mdcli.errors import UsageError
from mdcli.events import Done, Event, Finish, Fork, Note
from mdcli.memory import available_memory_bytes, kv_bytes_per_token
from mdcli.prompts import fill_template, prompt_token_ids
from mdcli.sampling import SamplingParams
from mdcli.segmenting import DEFAULT_SEGMENT_TOKENS, Segment, check_segment_tokens, split_documents, token_counter

if TYPE_CHECKING:
    from mdcli.loading import LoadedModel

Layout = Literal["chain", "independent"]
Keep = Literal["all", "relevant"]
LAYOUTS: tuple[str, ...] = ("chain", "independent")
KEEPS: tuple[str, ...] = ("all", "relevant")

MARGIN_TEMPLATE = (
    "```\n$context\n```\n"
    'Given the above context, extract all information relevant to the query: "$query". '
    'If the context is not relevant to the query, answer "I don\'t know."'
)
"""The paper's extractive-summary prompt. The context comes first so that, in the chain layout,
margin i+1's prompt begins with margin i's context (shared in the cache)."""

CLASSIFICATION_TEMPLATE = (
    'I asked an LLM assistant whether a piece of document is related to the query: "$query". '
    "This is its answer:\n```text\n$margin\n```\n"
    "Should I save it for later?\n"
    "Here are rules:\n"
    "- Answer YES if the answer contains information about the query.\n"
    "- Answer NO if the answer says the piece isn't related to the query.\n\n"
    "Provide the answer in the format: <YES/NO>#<Explanation>.\n"
    "Here are example answers:\n\n"
    "YES#Yes, the information contains an excerpt from a book that is related to the question.\n"
    "NO#No, the LLM assistant concluded the information isn't relevant.\n\n"
    'Don\'t add any other comments, all your remarks should be included in the "Explanation" section.'
)
"""The paper's classifier prompt: the margin is judged without the segment it came from."""

ANSWER_TEMPLATE = "Notes taken while reading the document:\n```\n$notes\n```\n$query"
"""The paper's final prompt (margins, then the query), with a line saying what the notes are."""

NOTE_TEMPLATE = "[$label] $margin"
NOTE_WITH_SEGMENT_TEMPLATE = "[$label]\n$segment\nNote: $margin"
NO_NOTES = "(no relevant notes)"
NOTE_SEPARATOR = "\n\n"
DOCUMENT_SEPARATOR = "\n\n"
"""Between documents in the chain layout's context."""

DEFAULT_MARGIN_TOKENS = 48
DEFAULT_CLASSIFY_TOKENS = 24
DEFAULT_ANSWER_TOKENS = 256
MEMORY_SHARE = 0.8
"""The KV cache may take at most this share of the free memory: activations and masks need room."""


@dataclass(frozen=True)
class MarginsPrompts:
    """Every text the strategy writes to the model; recipes and flags may replace any of them."""

    margin: str = MARGIN_TEMPLATE  # $context, $query
    classification: str = CLASSIFICATION_TEMPLATE  # $query, $margin
    answer: str = ANSWER_TEMPLATE  # $notes, $query
    note: str = NOTE_TEMPLATE  # $label, $margin
    note_with_segment: str = NOTE_WITH_SEGMENT_TEMPLATE  # $label, $segment, $margin
    no_notes: str = NO_NOTES
    system: str | None = None  # None: the chat template's default system prompt, if any

    def check(self) -> None:
        """Fill every template once with placeholders, so a bad one fails before the model loads."""
        fill_template(self.margin, "margin", context="c", query="q")
        fill_template(self.classification, "classification", query="q", margin="m")
        fill_template(self.answer, "answer", notes="n", query="q")
        fill_template(self.note, "note", label="l", margin="m")
        fill_template(self.note_with_segment, "note-with-segment", label="l", segment="s", margin="m")


@dataclass
class MarginResult:
    """A finished margin and what became of it."""

    number: int  # 1-based segment number
    segment: Segment
    label: str
    branch: int
    text: str
    relevant: bool = True
    parsed: bool = True
    reason: str = ""
    classification_branch: int | None = None


@dataclass(frozen=True)
class Verdict:
    relevant: bool
    parsed: bool  # False: no YES/NO found, kept as relevant by default
    reason: str


@dataclass
class Margins:
    """One run: documents, query and every choice; `validate()` needs no model."""

    documents: list[str]
    query: str
    names: list[str] | None = None
    layout: Layout | None = None  # None: chain for one document, independent for several
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS
    keep: Keep = "relevant"
    classify: bool = True
    with_segments: bool = False
    prompts: MarginsPrompts = field(default_factory=MarginsPrompts)
    chat_template: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    margin_tokens: int = DEFAULT_MARGIN_TOKENS
    classify_tokens: int = DEFAULT_CLASSIFY_TOKENS
    answer_tokens: int = DEFAULT_ANSWER_TOKENS
    memory_budget_bytes: int | None = None  # None: MEMORY_SHARE of the device's free memory

    # -- checks without a model --------------------------------------------------------------

    def validate(self) -> None:
        if not self.query or not self.query.strip():
            raise UsageError("the query is missing", fix='add -q "your question"')
        if not self.documents:
            raise UsageError("no documents given", fix="give one or more files, or - for stdin")
        for name, text in zip(self.document_names(), self.documents):
            if not text.strip():
                raise UsageError(f"{name} is empty", fix="give a document with some text")
        check_segment_tokens(self.segment_tokens)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise UsageError(f"unknown context layout '{self.layout}'", fix="use --context chain or independent")
        if self.keep not in KEEPS:
            raise UsageError(f"unknown --keep '{self.keep}'", fix="use --keep all or relevant")
        for flag, value in (
            ("--max-new-tokens", self.margin_tokens),
            ("--classify-tokens", self.classify_tokens),
            ("--answer-tokens", self.answer_tokens),
        ):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1", fix="use a positive number")
        self.prompts.check()

    def document_names(self) -> list[str]:
        if self.names is not None:
            if len(self.names) != len(self.documents):
                raise ValueError(f"{len(self.names)} names for {len(self.documents)} documents")
            return list(self.names)
        if len(self.documents) == 1:
            return ["the document"]
        return [f"document {i}" for i in range(1, len(self.documents) + 1)]

    def resolved_layout(self) -> Layout:
        if self.layout is not None:
            return self.layout
        return "chain" if len(self.documents) == 1 else "independent"

    # -- phase 1: margins ----------------------------------------------------------------------

    def segments(self, tokenizer) -> list[Segment]:
        return split_documents(self.documents, self.segment_tokens, token_counter(tokenizer), self.document_names())

    def labels(self, segments: list[Segment]) -> list[str]:
        total = len(segments)
        several = len(self.documents) > 1
        return [
            f"segment {i}/{total}" + (f" ({s.name})" if several else "") for i, s in enumerate(segments, 1)
        ]

    def margin_context(self, segments: list[Segment], index: int) -> str:
        """What margin `index` (0-based) reads: the documented `$context` of its layout."""
        if self.resolved_layout() == "independent":
            return segments[index].text.strip()
        read: dict[int, str] = {}
        for segment in segments[: index + 1]:
            read[segment.document] = read.get(segment.document, "") + segment.text
        return DOCUMENT_SEPARATOR.join(text.strip() for text in read.values())

    def margin_specs(self, tokenizer, segments: list[Segment]) -> list[BranchSpec]:
        return [
            self._spec(tokenizer, label, self.margin_prompt(segments, i), self.sampling, self.margin_tokens)
            for i, label in enumerate(self.labels(segments))
        ]

    def margin_prompt(self, segments: list[Segment], index: int) -> str:
        context = self.margin_context(segments, index)
        return fill_template(self.prompts.margin, "margin", context=context, query=self.query)

    # -- phase 2: classification ---------------------------------------------------------------

    def classification_specs(self, tokenizer, margins: list[MarginResult]) -> list[BranchSpec]:
        total = len(margins)
        return [
            self._spec(
                tokenizer,
                f"relevance {m.number}/{total}",
                fill_template(self.prompts.classification, "classification", query=self.query, margin=m.text.strip()),
                SamplingParams(),
                self.classify_tokens,
            )
            for m in margins
        ]

    # -- phase 3: the answer -------------------------------------------------------------------

    def kept(self, margins: list[MarginResult]) -> list[MarginResult]:
        return list(margins) if self.keep == "all" or not self.classify else [m for m in margins if m.relevant]

    def answer_prompt(self, kept: list[MarginResult]) -> str:
        return fill_template(self.prompts.answer, "answer", notes=self.notes(kept), query=self.query)

    def notes(self, kept: list[MarginResult]) -> str:
        if not kept:
            return self.prompts.no_notes
        if self.with_segments:
            blocks = [
                fill_template(
                    self.prompts.note_with_segment,
                    "note-with-segment",
                    label=m.label,
                    segment=m.segment.text.strip(),
                    margin=m.text.strip(),
                )
                for m in kept
            ]
        else:
            blocks = [fill_template(self.prompts.note, "note", label=m.label, margin=m.text.strip()) for m in kept]
        return NOTE_SEPARATOR.join(blocks)

    def answer_spec(self, tokenizer, kept: list[MarginResult]) -> BranchSpec:
        return self._spec(tokenizer, "answer", self.answer_prompt(kept), self.sampling, self.answer_tokens)

    def _spec(self, tokenizer, label: str, user_text: str, sampling: SamplingParams, max_new: int) -> BranchSpec:
        ids = prompt_token_ids(tokenizer, user_text, system=self.prompts.system, chat_template=self.chat_template)
        return BranchSpec(label=label, prompt_ids=ids, sampling=sampling, max_new_tokens=max_new)


# -- reading the classifier ---------------------------------------------------------------------

_LEADING_VERDICT = re.compile(r"^[\s`*_\"'>\[\](){}.:#-]*(?:answer\s*[:=]\s*)?(yes|no)(?![a-z])", re.IGNORECASE)
_TAGGED_VERDICT = re.compile(r"\b(yes|no)\s*#", re.IGNORECASE)


def parse_verdict(text: str) -> Verdict:
    """Read "YES#reason" / "NO#reason" as small models actually write it: any case, wrapped in
    code fences, quotes or bold, "Answer: yes", or the tag later in the text. Nothing readable
    (or both tags): relevant, `parsed=False`, so no information is dropped on a misread."""
    cleaned = text.replace("```text", "").replace("```", "").strip()
    match = _LEADING_VERDICT.match(cleaned)
    if match is None:
        tags = {m.group(1).lower() for m in _TAGGED_VERDICT.finditer(cleaned)}
        if len(tags) != 1:
            return Verdict(relevant=True, parsed=False, reason=cleaned)
        word = tags.pop()
        rest = cleaned.split("#", 1)[1]
    else:
        word = match.group(1).lower()
        rest = cleaned[match.end() :]
    return Verdict(relevant=word == "yes", parsed=True, reason=rest.lstrip(" *_`#:-,.").strip())


# -- sizes, checked before any forward pass -----------------------------------------------------


def radix_token_count(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens the radix prefill will store: the node count of the prompts' token trie."""
    ordered = sorted(tuple(p) for p in prompts)
    total, previous = 0, ()
    for prompt in ordered:
        total += len(prompt) - common_prefix_length(prompt, previous)
        previous = prompt
    return total


def check_fits(model: LoadedModel, job: Margins, specs: list[BranchSpec], prefill_tokens: int) -> None:
    """Refuse, before any forward, a run whose prompts exceed the context or whose cache would not
    fit in memory. The margin phase holds the largest cache: its prefill plus every margin."""
    layout = job.resolved_layout()
    limit = model.context_length
    for spec in specs:
        if limit is not None and len(spec.prompt_ids) >= limit:
            what = "the document up to here" if layout == "chain" else "its segment"
            fix = (
                "use --context independent, or a model with a longer context"
                if layout == "chain"
                else "lower --segment-tokens"
            )
            raise UsageError(
                f"the margin prompt of {spec.label} ({what}) is {len(spec.prompt_ids):,} tokens; "
                f"the model's context is {limit:,}",
                fix=fix,
            )
    tokens = prefill_tokens + len(specs) * job.margin_tokens
    needed = tokens * kv_bytes_per_token(model.model.config, model.dtype.itemsize)
    budget = job.memory_budget_bytes
    if budget is None:
        free = available_memory_bytes(model.device)
        budget = None if free is None else int(free * MEMORY_SHARE)
    if budget is not None and needed > budget:
        raise UsageError(
            f"{len(specs)} margins need about {_size(needed)} of KV cache ({tokens:,} tokens), "
            f"more than the {_size(budget)} available",
            fix="use fewer documents per run, larger --segment-tokens or a smaller --max-new-tokens",
        )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# -- the run ------------------------------------------------------------------------------------


def new_decoder(
    model: LoadedModel, *, max_forward_tokens: int = 1024, compact_ratio: float = 0.25, speculate: str = "auto"
) -> Decoder:
    from mdcli.engine import Engine

    engine = Engine(
        model.model,
        sliding_window=model.sliding_window,
        mixed_layer_types=model.mixed_layer_types,
        max_forward_tokens=max_forward_tokens,
    )
    return Decoder(
        engine, model.tokenizer, model.eos_token_ids, context_length=model.context_length, compact_ratio=compact_ratio,
        speculate=speculate,
    )


def run_margins(model: LoadedModel, job: Margins, **engine_options) -> Iterator[Event]:
    """The three phases over one decoder; see the module docstring for the event stream."""
    from mdcli.api import start_event

    job.validate()
    tokenizer = model.tokenizer
    segments = job.segments(tokenizer)
    specs = job.margin_specs(tokenizer, segments)
    prefill_tokens = radix_token_count([s.prompt_ids for s in specs])
    check_fits(model, job, specs, prefill_tokens)
    decoder = new_decoder(model, **engine_options)
    started = time.perf_counter()

    infos = decoder.announce(specs)
    yield start_event(model, "margins", job.sampling.seed, infos)
    yield layout_note(job, segments, specs, prefill_tokens)
    yield from split_notes(job, segments)
    finishes = yield from _collect_finishes(decoder.decode())
    margins = [
        MarginResult(number=i, segment=s, label=info.label, branch=info.id, text=finishes[info.id].text)
        for i, (s, info) in enumerate(zip(segments, infos), 1)
    ]
    _empty_cache(decoder)

    if job.classify:
        yield from classify_margins(decoder, job, margins)
        _empty_cache(decoder)

    yield from answer(decoder, job, job.kept(margins))
    yield Done(stats=decoder.stats(time.perf_counter() - started))


def classify_margins(decoder: Decoder, job: Margins, margins: list[MarginResult]) -> Iterator[Event]:
    """Phase 2: one greedy YES/NO branch per margin, all at once; a Note as each one finishes."""
    infos = decoder.announce(job.classification_specs(decoder.tokenizer, margins))
    by_branch = {}
    for margin, info in zip(margins, infos):
        margin.classification_branch = info.id
        by_branch[info.id] = margin
        yield Fork(branch=info)
    for event in decoder.decode():
        yield event
        if isinstance(event, Finish) and event.branch in by_branch:
            yield classification_note(by_branch[event.branch], event)


def classification_note(margin: MarginResult, finish: Finish) -> Note:
    verdict = parse_verdict(finish.text)
    margin.relevant, margin.parsed, margin.reason = verdict.relevant, verdict.parsed, verdict.reason
    if verdict.parsed:
        message = f"{margin.label}: {'relevant' if verdict.relevant else 'not relevant'}"
        message += f" ({verdict.reason})" if verdict.reason else ""
    else:
        message = f"{margin.label}: no YES or NO in the classifier's reply {finish.text.strip()!r}; kept as relevant"
    return Note(
        kind="classification",
        message=message,
        data={
            "branch": finish.branch,
            "margin_branch": margin.branch,
            "segment": margin.number,
            "document": margin.segment.name,
            "relevant": verdict.relevant,
            "parsed": verdict.parsed,
            "reason": verdict.reason,
        },
    )


def answer(decoder: Decoder, job: Margins, kept: list[MarginResult]) -> Iterator[Event]:
    """Phase 3: one branch reading the kept margins; its sources are announced before its Finish."""
    [info] = decoder.announce([job.answer_spec(decoder.tokenizer, kept)])
    yield Fork(branch=info)
    for event in decoder.decode():
        if isinstance(event, Finish) and event.branch == info.id:
            yield sources_note(info.id, kept)
        yield event


def sources_note(branch: int, kept: list[MarginResult]) -> Note:
    numbers = [m.number for m in kept]
    message = "answer from " + (", ".join(m.label for m in kept) if kept else "no margins (none was relevant)")
    return Note(
        kind="answer-sources",
        message=message,
        data={"branch": branch, "segments": numbers, "margin_branches": [m.branch for m in kept]},
    )


def layout_note(job: Margins, segments: list[Segment], specs: list[BranchSpec], prefill: int) -> Note:
    """How much of the margin prompts the cache actually holds (the point of the layout)."""
    prompt_tokens = sum(len(s.prompt_ids) for s in specs)
    document_tokens = sum(s.tokens for s in segments)
    layout = job.resolved_layout()
    return Note(
        kind="margins-layout",
        message=(
            f"{layout}: {len(specs)} margin prompts of {prompt_tokens:,} tokens in all share "
            f"{prefill:,} cache tokens (documents: {document_tokens:,} tokens)"
        ),
        data={
            "layout": layout,
            "segments": len(specs),
            "prompt_tokens": prompt_tokens,
            "prefill_tokens": prefill,
            "document_tokens": document_tokens,
        },
    )


def split_notes(job: Margins, segments: list[Segment]) -> Iterator[Note]:
    """Say where a sentence longer than --segment-tokens had to be cut (never dropped)."""
    labels = job.labels(segments)
    for number, (segment, label) in enumerate(zip(segments, labels), 1):
        if segment.ends_inside_sentence:
            yield Note(
                kind="segment-split",
                message=(
                    f"{label} ends inside a sentence longer than --segment-tokens {job.segment_tokens} "
                    f"(cut at a {segment.ends_at} boundary; the rest opens the next segment)"
                ),
                data={"segment": number, "document": segment.name, "ends_at": segment.ends_at},
            )


def _collect_finishes(events: Iterator[Event]):
    """Pass events through, remembering each Finish by branch (a generator's return value)."""
    finishes: dict[int, Finish] = {}
    for event in events:
        if isinstance(event, Finish):
            finishes[event.branch] = event
        yield event
    return finishes


def _empty_cache(decoder: Decoder) -> None:
    """Between phases every branch has finished and no later prompt reuses the cache: free it."""
    import torch

    engine = decoder.engine
    if len(engine):
        engine.compact(torch.zeros((0, len(engine)), dtype=torch.bool, device=engine.device))
