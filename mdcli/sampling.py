"""Choosing the next token: greedy, or sampling with temperature / top-k / top-p / min-p.

Every branch owns its own random generator, seeded from (run seed, branch key): a branch's samples
never depend on which other branches exist or in which order they step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise ValueError("top-k must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ValueError("min-p must be in [0, 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def branch_seed(seed: int | None, key: int) -> int:
    """A stable per-branch seed: the same (seed, key) always gives the same stream."""
    base = 0 if seed is None else seed
    return (base * 1_000_003 + key * 7_919 + 17) % (2**63 - 1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> [V] with temperature applied and excluded tokens at -inf.

    Order as in Hugging Face's warpers: temperature, top-k, top-p, min-p.
    """
    import torch

    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(outside_nucleus(scores, params.top_p), float("-inf"))
    if params.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


def outside_nucleus(scores: torch.Tensor, top_p: float, *, candidates: int = 256) -> torch.Tensor:
    """[V] bool: tokens outside the smallest set of most likely tokens whose mass reaches top_p.

    A token is dropped when the tokens ranked before it already reach top_p (the first always
    stays), as in Hugging Face's TopPLogitsWarper. Sorting the whole vocabulary per branch per step
    is the slow part, so the nucleus is first looked for among the `candidates` most likely tokens:
    if their mass reaches top_p the nucleus lies inside them and the answer is the same as with a
    full sort; otherwise the full sort decides.
    """
    import torch

    probs = scores.softmax(-1)
    top = min(candidates, probs.shape[-1])
    top_probs, top_ids = probs.topk(top)
    cumulative = top_probs.cumsum(-1)
    if top < probs.shape[-1] and float(cumulative[-1]) < top_p:
        top_probs, top_ids = probs.sort(descending=True)
        cumulative = top_probs.cumsum(-1)
    kept = int(((cumulative - top_probs) < top_p).sum())
    drop = torch.ones_like(probs, dtype=torch.bool)
    drop[top_ids[:kept]] = False
    return drop


class Sampler:
    """Next-token choice for one branch."""

    def __init__(self, params: SamplingParams, key: int, device: torch.device | str = "cpu") -> None:
        import torch

        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(branch_seed(params.seed, key))

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 -> a token id."""
        import torch

        if self.params.greedy:
            return int(logits.argmax())
        probs = filtered_logits(logits, self.params).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def choose_tokens(logits: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """logits: [k, V] -> one token per branch; greedy branches are decided in one argmax."""
    greedy = logits.argmax(-1).tolist()
    return [g if s.params.greedy else s(row) for g, s, row in zip(greedy, samplers, logits)]
