"""Several documents' trees in one forest: each document's queries read only the slots they see.

Rule: where a forest holds the trees of several documents (`ask-many --each`), each laid down on
its own, a query sees its own document's slots and its branch's new ones, never another
document's. A forward that would attend densely on mdcli's kernel (mdcli.backends.attention.fused)
then splits its queries by the first slot they see (one group a document) and the kernel reads,
for each group, only the slots some query of the group sees, in place (its `slots`): one call per
group and layer. Dense attention reads every document's slots for every query, and the prefix plan
(mdcli.backends.attention.prefix) gathers every document's slots but the first's in every layer; on
one Zen 5 core, steps of 11-16 queries from 4-5 documents over about 2,500 slots took 43-50 ms with
11.7-16.3 ms of attention this way, against 50.7-82.1 ms with 13-49 ms of attention before
(notebook/ask-many.md, "ask-many --each at the issue's document sizes"). Taken where the queries
start at 2 to MAX_GROUPS slots and the groups read at most 1 - MIN_SAVED of the dense work, without
a sliding window (each query would start elsewhere); an ask-many forest or a margins chain starts
every query at slot 0 and stays dense.

Exact as the dense kernel: each slot left out is one the group's every query has masked, whose
weight is exp(dtype-min - max) = 0; only the order of float sums is the kernel's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mdcli.backends.attention.fused import StepMask, fused_attention, step_mask

# Bounds set, not measured: each call costs about 0.1 ms of its own per layer (notebook/ask-many.md),
# so many small documents, or a split that skips little, are left to the dense kernel.
MAX_GROUPS = 16  # most documents split in one forward
MIN_SAVED = 0.25  # of the dense work (queries x slots), the least the split must skip


@dataclass(frozen=True)
class DocumentGroup:
    rows: torch.Tensor  # [Q] long: the forward's queries of one document
    slots: torch.Tensor  # [S] long, ascending: every slot some query of the group sees
    mask: StepMask  # the kernel's mask of these queries over those slots


@dataclass(frozen=True)
class DocumentsPlan:
    """Made once per forward, read by every layer."""

    groups: tuple[DocumentGroup, ...]

    def attend(self, core: str, onednn: bool, layer_type: str, query, keys, values, scale: float) -> torch.Tensor:
        """[1, M, H * D]: each group's queries (of query [1, H, M, D]) over its slots of keys and
        values [1, G, N, D], read in place, on mdcli's kernel (the other plans' call shape: the
        core, oneDNN and the layer type do not apply, the forward has one mask)."""
        _, heads, m, dim = query.shape
        out = query.new_empty(m, heads * dim)  # [M, H * D]
        for group in self.groups:
            attended = fused_attention(query.index_select(2, group.rows), keys, values, group.mask, scale,
                                       keys.shape[1], slots=group.slots)  # [1, Q, H * D]
            out.index_copy_(0, group.rows, attended[0])
        return out[None]


def documents_plan(mask: torch.Tensor, per_group: int) -> DocumentsPlan | None:
    """The split for the engine's additive mask [1, 1, M, N] (per_group: query heads per key/value
    head), or None where the queries do not start at 2 to MAX_GROUPS slots or the split would not
    skip MIN_SAVED of the dense work."""
    allowed = mask[0, 0] == 0  # [M, N]
    m, n = allowed.shape
    first = allowed.to(torch.int8).argmax(1)  # [M]: each query's first visible slot (0 for one that sees none)
    starts, group_of_row = torch.unique(first, return_inverse=True)
    if not 2 <= starts.shape[0] <= MAX_GROUPS:
        return None
    groups, work = [], 0
    for index in range(starts.shape[0]):
        rows = (group_of_row == index).nonzero().flatten()  # [Q]
        slots = allowed.index_select(0, rows).any(0).nonzero().flatten()  # [S]
        work += rows.shape[0] * slots.shape[0]
        if work > (1 - MIN_SAVED) * m * n:
            return None
        picked = mask[0, 0].index_select(0, rows).index_select(1, slots)  # [Q, S]
        groups.append(DocumentGroup(rows=rows, slots=slots, mask=step_mask(picked[None, None], per_group)))
    return DocumentsPlan(tuple(groups))
