"""margins, what fits: every prompt within the model's context, every phase's cache within memory.

Checked before any forward pass. A run has (questions x segments) margin branches, as many
classifications, and one answer per question; the phase with the largest cache decides. A refusal
is one line that says what would fit: at most N questions per run, or a segment_tokens that
gives fewer, larger segments (fewer branches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdcli.backends.host import available_memory_bytes
from mdcli.core.decoding import BranchSpec
from mdcli.prefixes import common_prefix_length, trie_size
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.job import FieldError
from mdcli.strategies.margins.job import Margins
from mdcli.strategies.prompts import fill_template, prompt_token_ids
from mdcli.strategies.segmenting import Segment

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

MEMORY_SHARE = 0.8
"""The KV cache may take at most this share of the free memory: activations and masks need room."""
NOTE_OVERHEAD_TOKENS = 12
"""A note's label and separators in the answer prompt, beyond the margin's own tokens (generous)."""
LARGER_SEGMENTS = (2, 4, 8, 16)
"""The segment_tokens multiples tried when suggesting fewer, larger segments."""


def cache_tokens(job: Margins, tokenizer, segments: list[Segment], specs: list[BranchSpec], questions: int) -> int:
    """The largest cache any phase holds, in tokens, for the first `questions` questions: the
    margins' prefill plus every margin, or the classifications, or the answers (estimated from the
    templates, since margins are not written yet; sharing within a question is counted)."""
    count = len(segments)
    margin_specs = specs[: questions * count]
    margins = trie_size([s.prompt_ids for s in margin_specs]) + len(margin_specs) * job.margin_tokens
    classifications = 0
    if job.classify:
        head, tail = _classification_head_tail(job, tokenizer)
        per_branch = tail + job.margin_tokens + job.classify_tokens
        classifications = questions * (head + count * per_branch)
    note = job.margin_tokens + NOTE_OVERHEAD_TOKENS
    segment_text = sum(s.tokens for s in segments) if job.with_segments else 0
    answer_prompt = len(_ids(job, tokenizer, fill_template(job.prompts.answer, "answer", notes="", query="q")))
    answers = questions * (answer_prompt + count * note + segment_text + job.answer_tokens)
    return max(margins, classifications, answers)


def _classification_head_tail(job: Margins, tokenizer) -> tuple[int, int]:
    """A classification prompt's tokens before the margin (shared by a question's branches) and after."""
    def ids(margin: str) -> list[int]:
        text = fill_template(job.prompts.classification, "classification", query="q", margin=margin)
        return _ids(job, tokenizer, text)

    a, b = ids("a"), ids("b")
    head = common_prefix_length(a, b)
    return head, len(a) - head


def _ids(job: Margins, tokenizer, text: str) -> list[int]:
    return prompt_token_ids(tokenizer, text, system=job.prompts.system, chat_template=job.chat_template)


def check_fits(model: LoadedModel, job: Margins, segments: list[Segment], specs: list[BranchSpec]) -> int:
    """Refuse, before any forward, a run whose prompts exceed the context or whose largest cache
    would not fit in memory; return the margin phase's prefill tokens (for the layout note)."""
    _check_context(model, job, specs)
    tokenizer = model.tokenizer
    questions = len(job.all_questions())
    bytes_per_token = kv_bytes_per_token(model.model.config, model.dtype.itemsize)
    budget = memory_budget(model, job)
    tokens = cache_tokens(job, tokenizer, segments, specs, questions)
    if budget is not None and tokens * bytes_per_token > budget:
        raise FieldError(
            f"{len(specs)} margins need about {_size(tokens * bytes_per_token)} of KV cache ({tokens:,} tokens)"
            + (f" for {questions} questions x {len(segments)} segments" if questions > 1 else "")
            + f", more than the {_size(budget)} available",
            fix=_what_fits(job, tokenizer, segments, specs, budget // bytes_per_token, model.context_length),
        )
    return trie_size([s.prompt_ids for s in specs])


def memory_budget(model: LoadedModel, job: Margins) -> int | None:
    if job.memory_budget_bytes is not None:
        return job.memory_budget_bytes
    free = available_memory_bytes(model.device)
    return None if free is None else int(free * MEMORY_SHARE)


def _check_context(model: LoadedModel, job: Margins, specs: list[BranchSpec]) -> None:
    layout = job.resolved_layout()
    limit = model.context_length
    for spec in specs:
        if limit is not None and len(spec.prompt_ids) >= limit:
            what = "the document up to here" if layout == "chain" else "its segment"
            fix = (
                "use {layout} independent, or a model with a longer context"
                if layout == "chain"
                else "lower {segment_tokens}"
            )
            raise FieldError(
                f"the margin prompt of {spec.label} ({what}) is {len(spec.prompt_ids):,} tokens; "
                f"the model's context is {limit:,}",
                fix=fix,
            )


def _what_fits(
    job: Margins, tokenizer, segments: list[Segment], specs: list[BranchSpec], room: int, limit: int | None
) -> str:
    """The fix: the most questions that fit, and/or the smallest larger segment_tokens that fits
    every question (tried at 2x, 4x, 8x and 16x the current size)."""
    questions = len(job.all_questions())
    fitting = 0
    for n in range(questions - 1, 0, -1):
        if cache_tokens(job, tokenizer, segments, specs, n) <= room:
            fitting = n
            break
    options = []
    if fitting:
        options.append(f"ask at most {fitting} question{'s' if fitting > 1 else ''} per run")
    larger = _segment_tokens_that_fit(job, tokenizer, room, len(segments), limit)
    if larger is not None:
        options.append(f"use {{segment_tokens}} {larger} (fewer, larger segments)")
    if not options:
        return "use fewer or shorter documents per run, or a smaller {margin_tokens}"
    return " or ".join(options)


def _segment_tokens_that_fit(job: Margins, tokenizer, room: int, segment_count: int, limit: int | None) -> int | None:
    for factor in LARGER_SEGMENTS:
        candidate = job.model_copy(update={"segment_tokens": job.segment_tokens * factor})
        segments = candidate.segments(tokenizer)
        if len(segments) >= segment_count:
            continue
        specs = candidate.margin_specs(tokenizer, segments)
        if all(limit is None or len(s.prompt_ids) < limit for s in specs) and (
            cache_tokens(candidate, tokenizer, segments, specs, len(job.all_questions())) <= room
        ):
            return candidate.segment_tokens
        if len(segments) == 1:
            break
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
