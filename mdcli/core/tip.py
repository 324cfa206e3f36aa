"""A tip: a branch's growing end, the record a step-loop policy decides for every step.

A tip holds its prompt (`path_ids`), the tokens it generated (`tokens`), its ancestor row (`row`),
the next-token logits after its last fed token (`logits`, [V] fp32), its cumulative logprob
(`logprob`), its sampler (one generator per branch, seeded from (seed, `seed_key`)) and streaming
detokenizer, and a free slot for the policy (`data`). The step loop (mdcli/core/steps.py) and its
verify walk (mdcli/core/verify.py) advance it; strategies read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mdcli.core.constraint import ConstraintState
from mdcli.core.detok import StreamingDetokenizer
from mdcli.core.sampling import Sampler
from mdcli.events import BranchInfo


@dataclass(eq=False)
class Tip:
    """A live branch end. Identity, not value, tells tips apart."""

    id: int
    label: str
    path_ids: list[int]  # everything the branch attends to before its first generated token
    tokens: list[int]  # generated so far (the detokenizer's list when there is one)
    max_new_tokens: int
    sampler: Sampler | None = None
    detok: StreamingDetokenizer | None = None
    asked_new_tokens: int = 0  # before fitting to the context (for the "capped" note)
    parent: int | None = None
    row: torch.Tensor | None = None  # [n] bool: ancestor row of the last token fed
    logits: torch.Tensor | None = None  # [V] fp32 next-token logits after it
    logprob: float = 0.0  # cumulative over `tokens`
    cached: int = 0  # tokens of path_ids + tokens held in the cache on `row`
    depth: int | None = None  # explicit position of the next fed token (None: follows the row)
    ignore_eos: bool = False  # never choose EOS (like generate's min_new_tokens)
    exact: bool = True
    constraint: ConstraintState | None = None  # the output constraint's state (mdcli/core/constraint.py)
    constraint_label: str | None = None  # its description, for BranchInfo
    data: object = None  # the policy's own (e.g. the BranchSpec with the children to fork)
    # speculative decoding (mdcli/core/verify.py): the token already chosen after the last accepted
    # guess (token, logprob); a chain still to feed (a child forked after a verify); the drafter
    pending: tuple[int, float] | None = None
    chain: list[int] | None = None
    drafts: object | None = None

    def info(self) -> BranchInfo:
        """The branch as announced; its sources are those of the spec in `data`, if it names any."""
        return BranchInfo(
            id=self.id, label=self.label, prompt_token_ids=list(self.path_ids), parent=self.parent, exact=self.exact,
            sources=tuple(getattr(self.data, "sources", ())),
            constraint=self.constraint_label,
        )
