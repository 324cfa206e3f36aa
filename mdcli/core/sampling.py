"""Choosing the next token: greedy, or sampling with temperature / top-k / top-p / min-p.

Every branch owns its own random generator, seeded from (run seed, branch key): a branch's samples
never depend on which other branches exist or in which order they step.

`choose_next` is the one token choice (EOS suppressed where a branch ignores it, a constrained row
masked, each row's sampler, the chosen token's logprob), used by the step loop (core/steps.py) and
by speculative verification (core/verify.py), whose greedy rows take the same `suppress`,
`greedy_tokens` and `logprobs_of` batched over a whole verified step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mdcli.core.constraint import ConstraintState, mask_rows


class SamplingParams(BaseModel):
    """How a branch chooses its next token. The fields, their defaults and their bounds are
    written only here: a recipe's `sampling:` layer (recipes.Sampling) takes these fields as they
    are, each optional, and gives the sampler this type (Sampling.params())."""

    # strict: `temperature: "0.5"` in a recipe is a mistake to report, not to guess at
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    temperature: float = Field(0.0, ge=0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)  # 1 = off
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float = Field(0.0, ge=0, lt=1)  # 0 = off
    seed: int | None = None

    def __init__(self, **values: Any) -> None:
        # Built in Python (flags, the API): one plain ValueError in words, as the flags' errors
        # show it. A recipe's layer keeps pydantic's error and its field path (recipes.errors).
        try:
            super().__init__(**values)
        except ValidationError as error:
            first = error.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            out_of_range = first["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
            words = _RANGE_WORDS.get(field) if out_of_range else None
            raise ValueError(words or f"{field}: {first['msg']}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_RANGE_WORDS = {
    "temperature": "temperature must be >= 0 (0 means greedy)",
    "top_k": "top-k must be >= 0 (0 turns it off)",
    "top_p": "top-p must be in (0, 1]",
    "min_p": "min-p must be in [0, 1)",
}


def branch_seed(seed: int | None, key: int) -> int:
    """A stable per-branch seed: the same (seed, key) always gives the same stream."""
    base = 0 if seed is None else seed
    return (base * 1_000_003 + key * 7_919 + 17) % (2**63 - 1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> [V] with temperature applied and excluded tokens at -inf.

    Order as in Hugging Face's warpers: temperature, top-k, top-p, min-p.
    """
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
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(branch_seed(params.seed, key))

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 -> a token id."""
        if self.params.greedy:
            return greedy_tokens(logits[None])[0]
        probs = filtered_logits(logits, self.params).softmax(-1)
        return draw(probs, self.generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one token drawn from them: the draw `torch.multinomial(probs, 1,
    generator=generator)` makes, from the same numbers of the generator.

    torch draws one sample as argmax(probs / q), q ~ Exp(1) (one exponential per token, from the
    branch's own generator); on the CPU this does the same, but takes the argmax with numpy, whose
    argmax vectorizes where torch's does not (notebook/step-loop.md, "Less per-branch glue")."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 1:
        return int(torch.multinomial(probs, 1, generator=generator))
    q = torch.empty_like(probs).exponential_(generator=generator)  # [V]
    ratio = np.asarray(torch.div(probs, q, out=q))
    token = int(ratio.argmax())
    if np.isnan(ratio[token]):  # probabilities torch refuses (NaN): it says so, as it did
        return int(torch.multinomial(probs, 1, generator=generator))
    return token


def choose_next(logits: torch.Tensor, samplers: Sequence[Sampler], *, ignore_eos: Sequence[bool],
                eos: Collection[int], constraints: Sequence[ConstraintState | None] = ()) -> tuple[list[int], list[float]]:
    """The next token of each row, and its logprob: logits [k, V] (changed in place: pass a copy).
    EOS goes to -inf in the rows that ignore it (as generate's min_new_tokens does), a row with a
    constraint keeps only the tokens it allows, each row's sampler chooses (greedy rows in one
    argmax), and the logprob is the chosen token's under the logits it was chosen from."""
    suppress(logits, [row for row, ignore in enumerate(ignore_eos) if ignore], eos)
    if any(state is not None for state in constraints):
        mask_rows(logits, list(constraints))
    tokens = choose_tokens(logits, samplers)
    return tokens, logprobs_of(logits, tokens)


def suppress(logits: torch.Tensor, rows: Sequence[int], tokens: Collection[int]) -> torch.Tensor:
    """logits [k, V], in place: `tokens` at -inf in `rows`."""
    if rows and tokens:
        row_index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
        token_index = torch.tensor(sorted(tokens), dtype=torch.long, device=logits.device)
        logits[row_index[:, None], token_index] = float("-inf")
    return logits


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int]) -> list[float]:
    """logits [k, V] and a token per row -> each token's log-probability under its row."""
    index = torch.tensor(list(tokens), device=logits.device)[:, None]  # [k, 1]
    return torch.log_softmax(logits, -1).gather(-1, index)[:, 0].tolist()


def choose_tokens(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """logits: [k, V] -> one token per branch; greedy branches are decided in one argmax, and
    only sampled branches go through their own sampler (their generators stay their own)."""
    greedy = greedy_tokens(logits)
    for i, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            greedy[i] = sampler(logits[i])
    return greedy


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits: [k, V] -> each row's argmax (the first of equal maxima, as torch.argmax gives it).

    On the CPU numpy's argmax decides: torch's CPU argmax does not vectorize, a cost every branch
    would pay every step and every verified draft node again (notebook/step-loop.md, "Less
    per-branch glue")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return np.asarray(logits).argmax(-1).tolist()
    return logits.argmax(-1).tolist()
