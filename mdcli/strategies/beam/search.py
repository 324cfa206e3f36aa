"""beam: Hugging Face's beam search, as one tree in one shared KV cache, as a step-loop policy.

Every live beam is a tip of the step loop (mdcli/core/steps.py). Each step ONE engine forward feeds
the newest token of every live beam of every beam set (one set per prompt); a beam that forks
costs one new token hanging off its parent's row (`loop.fork` + `loop.feed`), and a beam that
loses is pruned at once (`loop.prune`: its cache slots are reclaimed by compaction once enough
of the cache is dead). The selection rules and scores, HF's exactly, are in rules.py.

This module also holds beam's input checks (`beam_prompts`, `check_beam_fits`) and its run
(`run_beam`: Start, the search, Done over the run layer). It knows token ids only; texts come
from the `decode` callable it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mdcli.backends.host import available_memory_bytes
from mdcli.core.engine import Engine
from mdcli.core.run import Run
from mdcli.core.steps import Policy, StepLoop, Tip
from mdcli.errors import UsageError
from mdcli.events import BranchInfo, Event, Finish, Fork, Note, Progress, Stats, Token
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE
from mdcli.strategies.beam.job import BeamParams
from mdcli.strategies.beam.rules import (
    DEFAULT_COMPACT_RATIO,
    BeamSet,
    beam_memory_bytes,
)
from mdcli.strategies.job import FieldError, RunOptions, run_options
from mdcli.strategies.prompts import fill_template, prompt_token_ids

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

@dataclass(frozen=True)
class BeamPrompt:
    """One beam set: a prompt (token ids) searched on its own, sharing the cache with the others."""

    label: str
    prompt_ids: list[int]


# -- input checks -------------------------------------------------------------------------------


def beam_prompts(tokenizer, prompt: str, questions: list[str], system, template, chat_template: bool) -> list[BeamPrompt]:
    """Token ids per beam set: the prompt alone, or the document with each question."""
    if not prompt.strip():
        raise UsageError("the prompt is empty", fix="give some text, a file, or - for stdin")
    if not questions:
        return [BeamPrompt("beam", prompt_token_ids(tokenizer, prompt, system=system, chat_template=chat_template))]
    prompts = []
    for number, question in enumerate(questions, 1):
        if not question.strip():
            raise UsageError(f"question {number} is empty", fix="remove it or write the question")
        text = fill_template(template or DEFAULT_TEMPLATE, "question", document=prompt, question=question)
        ids = prompt_token_ids(tokenizer, text, system=system, chat_template=chat_template)
        prompts.append(BeamPrompt(question, ids))
    return prompts


def check_beam_fits(model: LoadedModel, prompt_lengths: list[int], params: BeamParams) -> None:
    """Refuse, before any forward, a width whose cache and scores cannot fit in free memory."""
    dtype_bytes = model.dtype.itemsize
    needed = beam_memory_bytes(
        kv_per_token=kv_bytes_per_token(model.model.config, dtype_bytes),
        prompt_lengths=prompt_lengths,
        width=params.width,
        max_new_tokens=params.max_new_tokens,
        vocab_size=model.model.get_output_embeddings().weight.shape[0],
        dtype_bytes=dtype_bytes,
    )
    free = available_memory_bytes(model.device)
    if free is not None and needed > free:
        raise FieldError(
            f"{{width}} {params.width} needs about {needed / 2**30:,.1f} GiB for the KV cache and scores "
            f"({len(prompt_lengths)} beam set(s), {params.max_new_tokens} new tokens), but only "
            f"{free / 2**30:,.1f} GiB is free on {model.device}",
            fix="lower {width} or {max_new_tokens}",
        )


_PROCESSOR_SETTINGS = (
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "exponential_decay_length_penalty",
    "renormalize_logits", "remove_invalid_values",
)
"""GenerationConfig fields that make `generate` add logits processors to beam search."""


def ignored_generation_settings(generation_config) -> Iterator[Note]:
    """Say so when the model's generation_config would make `generate` differ from this search:
    mdcli applies no logits processors (the default config has none for beam search)."""
    if generation_config is None:
        return
    changed = [name for name in _PROCESSOR_SETTINGS if not _neutral(name, getattr(generation_config, name, None))]
    if changed:
        yield Note(
            kind="ignored-settings",
            message="the model's generation_config sets " + ", ".join(changed) + "; beam search ignores them, "
            "so model.generate() with that config would differ",
            data={"settings": changed},
        )


def _neutral(name: str, value) -> bool:
    """A setting that adds no processor: unset, off, empty, 0, or a penalty of 1."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if name in ("repetition_penalty", "encoder_repetition_penalty"):
        return value == 1.0
    return value == 0 and not isinstance(value, bool)


# -- the search over one run ------------------------------------------------------------------


def _no_text(token_ids: list[int]) -> str:
    return ""


class BeamSearch(Policy):
    """Beam search for several prompts at once over one run: ONE forward per step.

    Usage: `announce()` for the Start event's branches, iterate `run()` for the rest, then
    `stats(seconds)` for Done. `engine` may be a Run (the CLI's) or a bare Engine (tests).
    As a step-loop policy it chooses across every beam of a set, forks, and prunes.
    """

    def __init__(
        self,
        engine: Engine | Run,
        prompts: Sequence[BeamPrompt],
        params: BeamParams,
        eos_token_ids: Sequence[int],
        *,
        decode: Callable[[list[int]], str] = _no_text,
        context_length: int | None = None,
        compact_ratio: float = DEFAULT_COMPACT_RATIO,
    ) -> None:
        params.validate()
        if not prompts:
            raise UsageError("beam search needs at least one prompt", fix="give a prompt")
        self.run_layer = engine if isinstance(engine, Run) else Run(
            engine, context_length=context_length, compact_ratio=compact_ratio
        )
        self.engine = self.run_layer.engine
        self.counters = self.run_layer.counters
        self.params = params
        self.decode = decode
        self.loop = StepLoop(self.run_layer, self)
        self.roots: list[Tip] = []
        self.sets: list[BeamSet] = []
        for p in prompts:
            max_new = self.run_layer.fit(p.label, len(p.prompt_ids), params.max_new_tokens)
            self.roots.append(self.loop.tip(p.label, list(p.prompt_ids), max_new_tokens=max_new, fit=False))
            self.roots[-1].asked_new_tokens = params.max_new_tokens
            self.roots[-1].data = ""  # a beam's data: the settled text of its tokens
            self.sets.append(BeamSet(p.label, p.prompt_ids, params, eos_token_ids, max_new, self.engine.device))
        self.active = list(self.sets)

    # -- public --------------------------------------------------------------------------------

    def announce(self) -> list[BranchInfo]:
        return [t.info() for t in self.roots]

    def run(self) -> Iterator[Event]:
        """Prefill every prompt (shared prefixes once), then step all sets until each is done."""
        yield from self.loop.capped_notes(self.roots)
        yield from self.loop.prefill(self.roots, "prefill")
        for beam_set, root in zip(self.sets, self.roots):
            beam_set.start(root)
        yield from self.loop.run_tips(self.roots)

    def stats(self, seconds: float) -> Stats:
        return self.run_layer.stats(seconds)

    # -- the policy ----------------------------------------------------------------------------

    def step(self, loop: StepLoop, tips: list[Tip]) -> Iterator[Event]:
        """Every live tip is a beam of an active set: each set chooses among its own."""
        for beam_set in self.active:
            yield from self._step(loop, beam_set)
        self.active = [s for s in self.active if not s.done]

    def progress(self, loop: StepLoop) -> Progress:
        return Progress("decode", len(self.sets) - len(self.active), len(self.sets), "beam sets")

    def _step(self, loop: StepLoop, beam_set: BeamSet) -> Iterator[Event]:
        """Run HF's selection for one set and describe it: tokens, forks, prunes, results.
        The beams' new tokens and texts are set once every candidate has been described: a
        fork's path is its parent's tokens before this step."""
        old = _unique(beam_set.beams)
        choice = beam_set.step()
        self.counters.generated_tokens += len(choice.running)
        if choice.done:
            for beam in old:
                yield loop.prune(beam, "search ended")
            yield from self._results(beam_set)
            beam_set.beams = []
            return
        continuing: set[int] = set()
        grown = []
        for candidate in choice.running:
            parent = candidate.parent
            if id(parent) not in continuing:
                continuing.add(id(parent))
                beam = parent
            else:
                beam, fork = loop.fork(parent, f"{beam_set.label}#{loop.run.next_id}", counted=False)
                beam.path_ids = parent.path_ids  # every beam counts its tokens from the set's prompt
                yield fork
            loop.feed(beam, [candidate.token])
            tokens = parent.tokens + [candidate.token]
            settled = self.decode(tokens).rstrip("\ufffd")  # held back while a UTF-8 character is incomplete
            shown: str = parent.data  # type: ignore[assignment]
            text = settled[len(shown) :] if settled.startswith(shown) else ""  # a fork's text starts at the fork
            yield Token(branch=beam.id, token_id=candidate.token, text=text, logprob=candidate.logprob)
            grown.append((beam, tokens, settled))
        for beam in old:
            if id(beam) not in continuing:
                yield loop.prune(beam, "outscored")
        for beam, tokens, settled in grown:
            beam.tokens, beam.data = tokens, settled
        beam_set.beams = [beam for beam, _, _ in grown]

    def _results(self, beam_set: BeamSet) -> Iterator[Event]:
        """One new branch per returned hypothesis, best first, each finished at once.

        New ids rather than the beams' own: a beam's branch may have been pruned, may have
        grown past the hypothesis, or may have produced two of them. Each result hangs off the
        prompt's branch, whose path (the prompt) is what it attends to before its tokens, so
        renderers (which print in announcement or tree order) show them in rank order. They are
        branches without cache: nothing is fed for them.
        """
        results = beam_set.results()
        root = beam_set.root
        for rank, (hypothesis, score) in enumerate(results, 1):
            branch = self.run_layer.new_id()
            label = beam_set.label if len(results) == 1 else f"{beam_set.label} [{rank}/{len(results)}]"
            info = BranchInfo(id=branch, label=label, prompt_token_ids=list(beam_set.prompt_ids), parent=root.id)
            yield Fork(branch=info)
            ended_by_eos = bool(hypothesis.tokens) and hypothesis.tokens[-1] in beam_set.eos_ids
            yield Finish(
                branch=branch,
                label=label,
                text=self.decode(hypothesis.tokens),
                token_ids=list(hypothesis.tokens),
                finish_reason="stop" if ended_by_eos else "length",
                cumulative_logprob=hypothesis.cumulative_logprob,
                score=score,
            )


def _unique(beams: list) -> list:
    """Distinct objects, in first-seen order (before the first step, W slots share one beam)."""
    seen: set[int] = set()
    out = []
    for beam in beams:
        if id(beam) not in seen:
            seen.add(id(beam))
            out.append(beam)
    return out


# What beam search cannot honour of RunOptions, and why (RunOptions.refuse).
REFUSES = {"speculate": "its candidates are ranked across beams at every step"}


def run_beam(
    model: LoadedModel, prompts: list[BeamPrompt], params: BeamParams, options: RunOptions | None = None, **engine
) -> Iterator[Event]:
    """The events of a beam run: Start, ignored-settings note, the search, Done. `options` (or
    RunOptions' fields as keywords): how the engine runs (compaction: DEFAULT_COMPACT_RATIO unless
    asked); speculation is refused (REFUSES), here, before the first event."""
    options = run_options(options, engine, every=True).refuse("beam search", **REFUSES)
    return _beam_events(model, prompts, params, options)


def _beam_events(model: LoadedModel, prompts: list[BeamPrompt], params: BeamParams,
                 options: RunOptions) -> Iterator[Event]:
    run = options.run(model, compact_ratio=DEFAULT_COMPACT_RATIO)
    tokenizer = model.tokenizer

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    search = BeamSearch(run, prompts, params, sorted(model.eos_token_ids), decode=decode)
    yield run.start("beam", None, search.announce())
    yield from ignored_generation_settings(getattr(model.model, "generation_config", None))
    yield from search.run()
    yield run.done()
