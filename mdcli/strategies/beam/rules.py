"""Hugging Face's beam-search rules for one beam set, as tensors mirroring generate's.

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
[0, -1e9, ...]; here the W slots all hold the one prompt tip, which gives the same tensors
without W copies of the prompt in the cache. A beam is a step-loop tip (mdcli/core/steps.py): only its
`tokens` and `logits` are read here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

from mdcli.errors import UsageError

if TYPE_CHECKING:
    import torch

    from mdcli.core.steps import Tip

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


@dataclass
class Hypothesis:
    """A sequence the set keeps (HF's `sequences` / `beam_scores` slots)."""

    tokens: list[int]
    cumulative_logprob: float


@dataclass
class Candidate:
    parent: Tip
    token: int
    logprob: float  # of this token alone


@dataclass
class BeamStep:
    """What one set decided this step."""

    running: list[Candidate]  # the W beams to decode next, best first
    done: bool


class BeamSet:
    """One prompt's beam search state, mirroring HF's per-batch-item tensors."""

    def __init__(
        self, label: str, prompt_ids: list[int], params: BeamParams, eos: Sequence[int], max_new: int, device
    ) -> None:
        import torch

        self.label = label
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_new = max_new
        self.eos_ids = frozenset(int(t) for t in eos)
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)  # [n_eos]
        width = params.width
        self.candidates_kept = max(2, 1 + len(self.eos_ids)) * width  # HF's `beams_to_keep`
        self.top_width = torch.arange(self.candidates_kept, device=device) < width  # [K] HF's `top_num_beam_mask`
        self.beams: list[Tip] = []  # [W] slots, best first (slot order is HF's beam order)
        self.running_scores = torch.zeros(width, device=device)  # [W]: only slot 0 is real before step 1
        self.running_scores[1:] = IMPOSSIBLE
        self.kept: list[Hypothesis | None] = [None] * width  # [W] best first
        self.kept_scores = torch.full((width,), IMPOSSIBLE, device=device)  # [W] length-normalised
        self.kept_finished = torch.zeros(width, dtype=torch.bool, device=device)  # [W]
        self.improvable = True  # HF's `is_early_stop_heuristic_unsatisfied`
        self.generated = 0  # tokens generated by every running beam
        self.done = False

    def start(self, root: Tip) -> None:
        """All W slots hold the prompt (HF copies it W times; here they share one tip)."""
        self.root = root
        self.beams = [root] * self.params.width

    def step(self) -> BeamStep:
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
            Candidate(self.beams[p], t, lp)
            for p, t, lp in zip(parents.tolist(), tokens.tolist(), log_probs[parents, tokens].tolist())
        ]  # [K], best first

        running_index = self._next_running(top_scores, ends)  # [W] indices into the K candidates
        self._keep_finished(top_scores, ends, candidates, length)
        self.generated = length
        self.improvable = self.improvable and self._can_improve()
        self.done = not self.improvable or self._full_and_early() or bool(ends.all())
        return BeamStep(running=[candidates[i] for i in running_index.tolist()], done=self.done)

    def _next_running(self, top_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """HF `_get_running_beams_for_next_iteration`: best W candidates that do not end."""
        import torch

        running_scores = top_scores + ends.to(torch.float32) * IMPOSSIBLE  # [K]
        index = torch.topk(running_scores, k=self.params.width)[1]  # [W]
        self.running_scores = running_scores[index]
        return index

    def _keep_finished(self, top_scores, ends, candidates: list[Candidate], length: int) -> None:
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
        kept: list[Hypothesis | None] = []
        for index in chosen.tolist():
            if index < width:
                kept.append(self.kept[index])
                continue
            c = candidates[index - width]
            kept.append(Hypothesis(c.parent.tokens + [c.token], cumulative[index - width]))
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

    def results(self) -> list[tuple[Hypothesis, float]]:
        """The best `num_return` hypotheses with their scores (HF's sequences_scores)."""
        scores = self.kept_scores.tolist()
        return [(h, s) for h, s in zip(self.kept[: self.params.num_return], scores) if h is not None]
