"""beam: Hugging Face's beam search, as one tree in one shared KV cache.

Every live beam is a leaf of the forest. Each step ONE engine forward feeds the newest token of
every live beam of every beam set (one set per prompt); a beam that forks costs one new token
hanging off its parent's row, and a beam that loses leaves the step at once (its cache slots are
reclaimed by compaction once enough of the cache is dead).

The selection rules are a line-by-line replica of `GenerationMixin._beam_search` in transformers
5.23 with `do_sample=False` and no logits processors, in fp32 and with the same torch ops in the
same order, so sequences and `sequences_scores` match `generate(num_beams=W)`:

* log_softmax of the fp32 logits plus each beam's running score, flattened to [W * V]; the top
  K = max(2, 1 + n_eos) * W candidates (enough that W of them do not end, whatever the EOS ids);
* a candidate *ends* when its token is an EOS id or it reaches max_new_tokens;
* the next running beams are the best W candidates that do not end (ending ones get -1e9);
* only ending candidates among the top W of the K (not all K) may become finished hypotheses,
  scored cumulative logprob / (generated length incl. EOS) ** length_penalty; the set keeps the
  best W hypotheses so far;
* the set stops when no running beam can beat the worst kept hypothesis (HF's heuristic, which
  depends on `early_stopping`), when early_stopping is True and W hypotheses are kept, or when
  every candidate ended (max length).

Before the first step HF holds W identical copies of the prompt with running scores
[0, -1e9, ...]; here the W slots all point at the one prompt row, which gives the same tensors
without W copies of the prompt in the cache.

This module knows token ids only; texts come from the `decode` callable it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

from mdcli.decoding import DecodeCounters, prefill_steps, progress_events
from mdcli.engine import Engine
from mdcli.errors import ContextTooLongError, UsageError
from mdcli.events import BranchInfo, Event, Finish, Fork, Note, Progress, Prune, Stats, Token
from mdcli.forest import pad_rows

if TYPE_CHECKING:
    import torch

EarlyStopping = Union[bool, Literal["never"]]

IMPOSSIBLE = -1.0e9
"""HF's score for "cannot be chosen": added, never assigned, so the order of additions matters."""

DEFAULT_COMPACT_RATIO = 0.1
"""Compact once this fraction of the cache is unreachable from any live beam. Measured (SmolLM2,
1,000-token prompt, W=8, 1 CPU thread; BENCHMARKS.md): the time did not depend on it within noise
(a compaction copies the cache once; dead slots cost a little attention), while the peak cache
fell from 3,040 tokens (never compacting) to 2,477 (0.25) and 2,042 (0.1) over 256 new tokens."""


@dataclass(frozen=True)
class BeamParams:
    """HF's beam-search knobs, with HF's defaults (GenerationConfig: early_stopping=False,
    length_penalty=1.0)."""

    width: int = 4
    num_return: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    max_new_tokens: int = 64

    def validate(self) -> None:
        if not isinstance(self.width, int) or self.width < 1:
            raise UsageError(f"--width must be at least 1 (got {self.width})", fix="use --width 1 or more")
        if not isinstance(self.num_return, int) or self.num_return < 1:
            raise UsageError(f"--num-return must be at least 1 (got {self.num_return})", fix="use --num-return 1 or more")
        if self.num_return > self.width:
            raise UsageError(
                f"--num-return {self.num_return} is more than --width {self.width}",
                fix="beam search keeps only `width` hypotheses: raise --width or lower --num-return",
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise UsageError(
                f"--early-stopping must be true, false or never (got {self.early_stopping!r})",
                fix="use --early-stopping true|false|never",
            )
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1", fix="use a positive number")


def parse_early_stopping(text: str) -> EarlyStopping:
    """The command line's spelling of HF's `early_stopping` (True, False or "never")."""
    value = {"true": True, "false": False, "never": "never"}.get(text.strip().lower())
    if value is None:
        raise UsageError(f"--early-stopping must be true, false or never (got '{text}')", fix="use true|false|never")
    return value


@dataclass(frozen=True)
class BeamPrompt:
    """One beam set: a prompt (token ids) searched on its own, sharing the cache with the others."""

    label: str
    prompt_ids: list[int]


# -- memory ---------------------------------------------------------------------------------


def beam_memory_bytes(
    *, kv_per_token: int, prompt_lengths: Sequence[int], width: int, max_new_tokens: int, vocab_size: int, dtype_bytes: int
) -> int:
    """An upper estimate of what a run holds at its peak, to refuse a hopeless width up front.

    KV: every prompt (sharing ignored) plus W beams of max_new tokens per set (nothing compacted).
    Per step: logits, log-probs and accumulated scores, W x V fp32 each per set, and the mask
    rows of the W x sets new tokens over the whole cache.
    """
    sets = len(prompt_lengths)
    tokens = sum(prompt_lengths) + sets * width * max_new_tokens
    kv = kv_per_token * tokens
    scores = 3 * sets * width * vocab_size * 4
    mask = sets * width * tokens * (dtype_bytes + 1)
    return kv + scores + mask


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


# -- one beam set: HF's rules ----------------------------------------------------------------


@dataclass
class _Beam:
    """A live hypothesis: a leaf of the forest."""

    branch: int
    label: str
    tokens: list[int]  # generated so far
    shown: str = ""  # settled text of `tokens` (all of them, also those before a fork)
    parent: _Beam | None = None  # until fed: the beam whose row its newest token hangs off
    row: torch.Tensor | None = None  # [n] bool ancestor row of its newest token, once fed
    logits: torch.Tensor | None = None  # [V] fp32 next-token logits, once fed


@dataclass
class _Hypothesis:
    """A sequence the set keeps (HF's `sequences` / `beam_scores` slots)."""

    tokens: list[int]
    cumulative_logprob: float


@dataclass
class _Candidate:
    parent: _Beam
    token: int
    logprob: float  # of this token alone


@dataclass
class _Step:
    """What one set decided this step."""

    running: list[_Candidate]  # the W beams to decode next, best first
    done: bool


class _BeamSet:
    """One prompt's beam search state, mirroring HF's per-batch-item tensors."""

    def __init__(
        self, prompt: BeamPrompt, branch: int, params: BeamParams, eos: Sequence[int], max_new: int, device
    ) -> None:
        import torch

        self.label = prompt.label
        self.prompt_ids = list(prompt.prompt_ids)
        self.branch = branch
        self.params = params
        self.max_new = max_new
        self.eos_ids = frozenset(int(t) for t in eos)
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)  # [n_eos]
        width = params.width
        self.candidates_kept = max(2, 1 + len(self.eos_ids)) * width  # HF's `beams_to_keep`
        self.top_width = torch.arange(self.candidates_kept, device=device) < width  # [K] HF's `top_num_beam_mask`
        self.beams: list[_Beam] = []  # [W] slots, best first (slot order is HF's beam order)
        self.running_scores = torch.zeros(width, device=device)  # [W]: only slot 0 is real before step 1
        self.running_scores[1:] = IMPOSSIBLE
        self.kept: list[_Hypothesis | None] = [None] * width  # [W] best first
        self.kept_scores = torch.full((width,), IMPOSSIBLE, device=device)  # [W] length-normalised
        self.kept_finished = torch.zeros(width, dtype=torch.bool, device=device)  # [W]
        self.improvable = True  # HF's `is_early_stop_heuristic_unsatisfied`
        self.generated = 0  # tokens generated by every running beam
        self.done = False

    def start(self, row: torch.Tensor, logits: torch.Tensor) -> None:
        """All W slots hold the prompt (HF copies it W times; here they share one row)."""
        root = _Beam(branch=self.branch, label=self.label, tokens=[], row=row, logits=logits)
        self.beams = [root] * self.params.width

    def step(self) -> _Step:
        """Choose the next running beams and update the kept hypotheses (HF steps b-g)."""
        import torch

        logits = torch.stack([beam.logits for beam in self.beams])  # [W, V] fp32
        vocab = logits.shape[-1]
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)  # [W, V]
        accumulated = (log_probs + self.running_scores[:, None]).reshape(-1)  # [W * V]
        top_scores, top_index = torch.topk(accumulated, k=self.candidates_kept)  # [K], [K]
        parents = top_index // vocab  # [K] slot of each candidate's beam
        tokens = top_index % vocab  # [K]
        length = self.generated + 1  # generated length after this token (EOS included)
        ends = torch.isin(tokens, self.eos) | (length >= self.max_new)  # [K] HF's stopping criteria

        candidates = [
            _Candidate(self.beams[p], t, lp)
            for p, t, lp in zip(parents.tolist(), tokens.tolist(), log_probs[parents, tokens].tolist())
        ]  # [K], best first

        running_index = self._next_running(top_scores, ends)  # [W] indices into the K candidates
        self._keep_finished(top_scores, ends, candidates, length)
        self.generated = length
        self.improvable = self.improvable and self._can_improve()
        self.done = not self.improvable or self._full_and_early() or bool(ends.all())
        return _Step(running=[candidates[i] for i in running_index.tolist()], done=self.done)

    def _next_running(self, top_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """HF `_get_running_beams_for_next_iteration`: best W candidates that do not end."""
        import torch

        running_scores = top_scores + ends.to(torch.float32) * IMPOSSIBLE  # [K]
        index = torch.topk(running_scores, k=self.params.width)[1]  # [W]
        self.running_scores = running_scores[index]
        return index

    def _keep_finished(self, top_scores, ends, candidates: list[_Candidate], length: int) -> None:
        """HF `_update_finished_beams`: merge the candidates that just ended among the top W
        into the W kept hypotheses, by length-normalised score (penalties added as HF adds them,
        so even its -1e9 placeholders sort the same)."""
        import torch

        width = self.params.width
        just_ended = ends & self.top_width  # [K]
        normalised = top_scores / (length**self.params.length_penalty)  # [K]
        normalised += float(self._full_and_early()) * IMPOSSIBLE
        normalised += float(not self.improvable) * IMPOSSIBLE
        normalised += (~just_ended) * IMPOSSIBLE
        merged = torch.cat((self.kept_scores, normalised))  # [W + K]
        chosen = torch.topk(merged, k=width)[1]  # [W]
        cumulative = top_scores.tolist()
        kept: list[_Hypothesis | None] = []
        for index in chosen.tolist():
            if index < width:
                kept.append(self.kept[index])
                continue
            c = candidates[index - width]
            kept.append(_Hypothesis(c.parent.tokens + [c.token], cumulative[index - width]))
        self.kept = kept
        self.kept_scores = merged[chosen]
        self.kept_finished = torch.cat((self.kept_finished, just_ended))[chosen]

    def _full_and_early(self) -> bool:
        """early_stopping=True: stop as soon as W hypotheses are kept (HF tests `is True`)."""
        return bool(self.kept_finished.all()) and self.params.early_stopping is True

    def _can_improve(self) -> bool:
        """HF `_check_early_stop_heuristic`: could the best running beam still beat the worst
        kept hypothesis? Its best possible length is the current one, except with
        early_stopping="never" and a positive length penalty, where it is max_new_tokens."""
        import torch

        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = self.max_new
        else:
            best_length = self.generated
        best_possible = self.running_scores[:1] / (best_length**params.length_penalty)  # [1]
        worst_kept = torch.where(self.kept_finished, torch.min(self.kept_scores), IMPOSSIBLE)  # [W]
        return bool(torch.any(best_possible > worst_kept))

    def results(self) -> list[tuple[_Hypothesis, float]]:
        """The best `num_return` hypotheses with their scores (HF's sequences_scores)."""
        scores = self.kept_scores.tolist()
        return [(h, s) for h, s in zip(self.kept[: self.params.num_return], scores) if h is not None]


# -- the search over one engine ----------------------------------------------------------------


def _no_text(token_ids: list[int]) -> str:
    return ""


class BeamSearch:
    """Beam search for several prompts at once over one engine: ONE forward per step.

    Usage: `announce()` for the Start event's branches, iterate `run()` for the rest, then
    `stats(seconds)` for Done.
    """

    def __init__(
        self,
        engine: Engine,
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
        self.engine = engine
        self.params = params
        self.decode = decode
        self.compact_ratio = compact_ratio
        self.context_length = context_length
        self.counters = DecodeCounters()
        self.sets = [
            _BeamSet(p, i, params, eos_token_ids, self._fit_to_context(p), engine.device) for i, p in enumerate(prompts)
        ]
        self._next_branch = len(self.sets)

    # -- public --------------------------------------------------------------------------------

    def announce(self) -> list[BranchInfo]:
        return [BranchInfo(id=s.branch, label=s.label, prompt_token_ids=list(s.prompt_ids)) for s in self.sets]

    def run(self) -> Iterator[Event]:
        """Prefill every prompt (shared prefixes once), then step all sets until each is done."""
        yield from self._cap_notes()
        started = time.perf_counter()
        yield from self._prefill()
        self.counters.prefill_seconds += time.perf_counter() - started
        started = time.perf_counter()
        active = list(self.sets)
        while active:
            for beam_set in active:
                yield from self._step(beam_set)
            active = [s for s in active if not s.done]
            yield Progress("decode", len(self.sets) - len(active), len(self.sets), "beam sets")
            if active:
                self._feed(active)
        self.counters.decode_seconds += time.perf_counter() - started

    def stats(self, seconds: float) -> Stats:
        return self.counters.stats(self.engine, seconds)

    # -- setup ---------------------------------------------------------------------------------

    def _fit_to_context(self, prompt: BeamPrompt) -> int:
        length, limit = len(prompt.prompt_ids), self.context_length
        if length == 0:
            raise ContextTooLongError(f"the prompt of '{prompt.label}' is empty", fix="give it some text")
        if limit is None:
            return self.params.max_new_tokens
        if length >= limit:
            raise ContextTooLongError(
                f"the prompt of '{prompt.label}' is {length} tokens, {length - limit + 1} more than the "
                f"model's context of {limit} allows",
                fix="shorten the document or the question, or use a model with a longer context",
            )
        return min(self.params.max_new_tokens, limit - length)

    def _cap_notes(self) -> Iterator[Event]:
        for s in self.sets:
            if s.max_new < self.params.max_new_tokens:
                yield Note(
                    kind="capped",
                    message=f"'{s.label}': max new tokens capped at {s.max_new} by the model's context",
                    data={"branch": s.branch, "max_new_tokens": s.max_new},
                )

    def _prefill(self) -> Iterator[Event]:
        before = len(self.engine)
        steps = prefill_steps(self.engine, [s.prompt_ids for s in self.sets])
        results = yield from progress_events("prefill", steps)
        for beam_set, result in zip(self.sets, results):
            beam_set.start(result.row, result.logits)
            self.counters.prompt_tokens += len(beam_set.prompt_ids)
        self.counters.prefill_tokens += len(self.engine) - before

    # -- one step ------------------------------------------------------------------------------

    def _step(self, beam_set: _BeamSet) -> Iterator[Event]:
        """Run HF's selection for one set and describe it: tokens, forks, prunes, results."""
        old = _unique(beam_set.beams)
        choice = beam_set.step()
        self.counters.generated_tokens += len(choice.running)
        if choice.done:
            for beam in old:
                yield Prune(branch=beam.branch, label=beam.label, reason="search ended")
            yield from self._results(beam_set)
            beam_set.beams = []
            return
        continuing: set[int] = set()
        new_beams = []
        for candidate in choice.running:
            parent = candidate.parent
            if id(parent) not in continuing:
                continuing.add(id(parent))
                beam = _Beam(branch=parent.branch, label=parent.label, tokens=parent.tokens + [candidate.token])
            else:
                beam = self._fork(beam_set, parent, candidate.token)
                yield Fork(
                    branch=BranchInfo(
                        id=beam.branch,
                        label=beam.label,
                        prompt_token_ids=beam_set.prompt_ids + parent.tokens,
                        parent=parent.branch,
                    )
                )
            beam.parent = parent
            text = self._new_text(beam, parent)
            yield Token(branch=beam.branch, token_id=candidate.token, text=text, logprob=candidate.logprob)
            new_beams.append(beam)
        for beam in old:
            if id(beam) not in continuing:
                yield Prune(branch=beam.branch, label=beam.label, reason="outscored")
        beam_set.beams = new_beams

    def _fork(self, beam_set: _BeamSet, parent: _Beam, token: int) -> _Beam:
        branch = self._next_branch
        self._next_branch += 1
        return _Beam(branch=branch, label=f"{beam_set.label}#{branch}", tokens=parent.tokens + [token])

    def _new_text(self, beam: _Beam, parent: _Beam) -> str:
        """The newly settled text of `beam`'s newest token (held back while a UTF-8 character
        is incomplete). A fork's text starts at the fork point: it measures from its parent's."""
        settled = self.decode(beam.tokens).rstrip("\ufffd")
        beam.shown = settled
        return settled[len(parent.shown) :] if settled.startswith(parent.shown) else ""

    def _results(self, beam_set: _BeamSet) -> Iterator[Event]:
        """One new branch per returned hypothesis, best first, each finished at once.

        New ids rather than the beams' own: a beam's branch may have been pruned, may have
        grown past the hypothesis, or may have produced two of them. Each result hangs off the
        prompt's branch, whose path (the prompt) is what it attends to before its tokens, so
        renderers (which print in announcement or tree order) show them in rank order.
        """
        results = beam_set.results()
        for rank, (hypothesis, score) in enumerate(results, 1):
            branch = self._next_branch
            self._next_branch += 1
            label = beam_set.label if len(results) == 1 else f"{beam_set.label} [{rank}/{len(results)}]"
            info = BranchInfo(id=branch, label=label, prompt_token_ids=list(beam_set.prompt_ids), parent=beam_set.branch)
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

    # -- the forward ---------------------------------------------------------------------------

    def _feed(self, active: list[_BeamSet]) -> None:
        """Every live beam's newest token, one chain of one token each, in ONE forward."""
        import torch

        beams = [beam for s in active for beam in s.beams]
        self._maybe_compact(_unique([beam.parent for beam in beams]))
        n = len(self.engine)
        rows = torch.stack([pad_rows(beam.parent.row[None], n)[0] for beam in beams])  # [L, N]
        results = self.engine.forward(rows, [[beam.tokens[-1]] for beam in beams])
        self.counters.steps += 1
        for beam, result in zip(beams, results):
            beam.row, beam.logits, beam.parent = result.row, result.logits, None

    def _maybe_compact(self, parents: list[_Beam]) -> None:
        """Drop the slots no live beam reaches once they are `compact_ratio` of the cache.

        `parents` are the beams the next tokens hang off: their rows are everything still live.
        """
        import torch

        n = len(self.engine)
        rows = torch.stack([pad_rows(p.row[None], n)[0] for p in parents])  # [P, N]
        dead = n - int(rows.any(0).sum())
        if dead == 0 or dead < self.compact_ratio * n:
            return
        for parent, row in zip(parents, self.engine.compact(rows)):
            parent.row = row


def _unique(beams: list) -> list:
    """Distinct objects, in first-seen order (before the first step, W slots share one beam)."""
    seen: set[int] = set()
    out = []
    for beam in beams:
        if id(beam) not in seen:
            seen.add(id(beam))
            out.append(beam)
    return out
