"""Weights kept as consecutive row slices of one buffer (fused q/k/v and gate/up), recognised again.

mdcli.backends.llama fuses a layer's float32 projections into one matrix and re-points each module's
weight at its rows; mdcli.backends.weights.int8 quantizes them fused the same way. Both find the fused
matrix again from the slices instead of copying it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def joined_rows(tensors) -> torch.Tensor | None:
    """The tensor `tensors` are consecutive row slices of (one contiguous buffer, in order), else None."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
