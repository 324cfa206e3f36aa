"""Reading a .gguf's blocks for a model, each matrix checked bit for bit against the model's weights.

Rule: a block matrix is used only where the kernel's own rebuild of it (mdcli.backends.weights.gguf_blocks)
is, bit for bit, the float32 weight the model holds, or, for a model built on the meta device
(mdcli.models.on_blocks), the weight transformers' GGUF loader would make of that tensor. q and k
are tried as stored and with llama.cpp's rotary permutation undone; a record of a passed check
(mdcli.models.block_checks) lets a later load confirm each layout on its first rows instead. A file
that cannot be read, holds a type the kernel does not read, or whose blocks would not fit in half
the free memory gives no blocks, with the reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from mdcli.backends.host import available_memory_bytes
from mdcli.backends.weights.gguf_blocks import (
    BLOCK,
    SPOT_ROWS,
    BlockWeight,
    JoinedBlocks,
    keep_blocks,
    kept_blocks,
    matches,
    source_of,
)
from mdcli.backends.weights.gguf_file import read_tensors
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, inner_of, whole_blocks

CHECK_ROWS = 4096  # a big matrix is checked this many rows at a time (its float32 never whole in memory)


def model_blocks(model, free_memory=available_memory_bytes) -> tuple[list[tuple[BlockWeight, ...]], BlockWeight] | str:
    """(qkv, o, gate_up, down) in blocks for each decoder layer, fused as mdcli.backends.llama fuses
    them, and the head; or why there are none. Read from the model's .gguf once and kept beside the
    model, like mdcli.backends.weights.packed's copies."""
    cached = kept_blocks(model)
    if cached is None:
        source = source_of(model)
        cached = read_blocks(source, model, free_memory) if source else "the model was not loaded from a .gguf"
        keep_blocks(model, cached)
    return cached


def read_blocks(path: Path, model, free_memory=available_memory_bytes,
                reference: Callable[[str], Callable] | None = None, *,
                known: Mapping[str, int] | None = None,
                layouts: dict[str, int] | None = None) -> tuple[list[tuple[BlockWeight, ...]], BlockWeight] | str:
    """The blocks of `path` for every projection and the head, each checked bit for bit against the
    model's float32 weight; or the first reason not. Where the model holds no float32 weight (a
    model built on the meta device: mdcli.models.on_blocks), the check is against
    `reference(tensor name)(start, stop)`: rows start..stop of the float32 weights transformers'
    loader makes of that tensor.

    known: for such a model, the layout each tensor matched when this file last passed the check
    with the same kernel and loader (mdcli.models.block_checks): those tensors take that layout,
    confirmed on their first SPOT_ROWS rows instead of checked whole. layouts: filled with the
    layout each tensor took (an index into `_tensor_blocks`' candidates: 0 as stored, 1 with
    llama.cpp's rotary permutation undone)."""

    def choose(name: str, candidates: list[BlockWeight], weight: torch.Tensor) -> BlockWeight | None:
        return _chosen(name, candidates, reference(name) if weight.is_meta and reference is not None else weight,
                       known if weight.is_meta else None, layouts)

    try:
        tensors = read_tensors(path)
    except (OSError, ValueError, struct.error) as exc:  # no copy, never a failed run
        return f"{path.name} could not be read: {exc}"
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    needed = sum(t.data.nbytes for name, t in tensors.items()
                 if t.data is not None and name.startswith(("blk.", "output.", "token_embd.")))
    free = free_memory(model.lm_head.weight.device)
    if free is not None and needed > free // 2:  # the rule mdcli.backends.weights.packed's copies follow
        return f"the .gguf's blocks ({needed / 2**20:.0f} MiB) do not fit in half the free memory"
    copies = []
    for index, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        parts = []
        for name, module, rows in (("attn_q", attention.q_proj, heads), ("attn_k", attention.k_proj, kv_heads),
                                   ("attn_v", attention.v_proj, None), ("attn_output", attention.o_proj, None),
                                   ("ffn_gate", mlp.gate_proj, None), ("ffn_up", mlp.up_proj, None),
                                   ("ffn_down", mlp.down_proj, None)):
            tensor_name = f"blk.{index}.{name}.weight"
            candidates = _tensor_blocks(tensors, tensor_name, rows)
            if isinstance(candidates, str):
                return candidates
            chosen = choose(tensor_name, candidates, module.weight)
            tensors[tensor_name].release()  # copied out and checked: not resident twice
            if chosen is None:
                return f"blk.{index}.{name}.weight is not the model's float32 weight"
            parts.append(chosen)
        q, k, v, o, gate, up, down = parts
        fused = (join_parts([q, k, v]), o, join_parts([gate, up]), down)
        if None in fused:
            return f"layer {index} joins weights of different input widths"
        copies.append(fused)
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = _tensor_blocks(tensors, head_name, None)
    if isinstance(head, str):
        return head
    chosen_head = choose(head_name, head, model.lm_head.weight)
    tensors[head_name].release()
    if chosen_head is None:
        return "the output head's blocks are not the model's float32 weights"
    return copies, chosen_head


def read_embedding(path: Path, reference: Callable[[str], Callable], *, known: Mapping[str, int] | None = None,
                   layouts: dict[str, int] | None = None) -> BlockWeight | str:
    """The blocks of `path`'s token embedding, checked bit for bit against
    `reference("token_embd.weight")` as read_blocks checks the projections (`known` and `layouts`
    as there); or why not."""
    name = "token_embd.weight"
    try:
        candidates = _tensor_blocks(read_tensors(path), name, None)
    except (OSError, ValueError, struct.error) as exc:
        return f"{path.name} could not be read: {exc}"
    if isinstance(candidates, str):
        return candidates
    return _chosen(name, candidates, reference(name), known, layouts) or "token_embd.weight is not the model's embedding"


def _tensor_blocks(tensors: dict, name: str, heads: int | None) -> list[BlockWeight] | str:
    """The tensor's blocks as BlockWeight candidates: as stored and, for q and k (`heads`), with the
    rows in the order transformers' GGUF loader puts Llama's (it undoes llama.cpp's rotary
    permutation); which one is the model's, `_matching` finds."""
    tensor = tensors.get(name)
    if tensor is None:
        return f"the .gguf has no tensor {name}"
    kind = tensor.kind
    if kind not in KERNEL_KINDS:
        return f"{name} is {kind}; mdcli's kernel reads {', '.join(KERNEL_KINDS)}"
    if not whole_blocks(kind, tensor.shape[-1]):
        return f"{name}'s rows of {tensor.shape[-1]} weights are not whole passes of {BLOCK}"
    data = torch.from_numpy(np.array(tensor.data))  # [out, row bytes] uint8, copied out of the mapped file
    inner = inner_of(kind, data.shape[1])
    stored = BlockWeight(kind, data, inner)
    if heads is None or data.shape[0] % (2 * heads):
        return [stored]
    rows = torch.arange(data.shape[0]).view(heads, -1, 2).transpose(1, 2).reshape(-1)  # [out]: stored row of each
    return [stored, BlockWeight(kind, data[rows].contiguous(), inner)]


def join_parts(parts: list[BlockWeight]) -> BlockWeight | JoinedBlocks | None:
    """One weight of the parts' rows in order (q/k/v, gate/up, as mdcli.backends.llama fuses): one
    BlockWeight where they share a kind, else a JoinedBlocks of runs of one kind each; None where
    their input widths differ."""
    if len({w.in_features for w in parts}) != 1:
        return None
    runs: list[list[BlockWeight]] = []
    for weight in parts:
        if runs and runs[-1][0].kind == weight.kind:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    joined = tuple(BlockWeight(run[0].kind, torch.cat([w.data for w in run]), run[0].in_features) for run in runs)
    return joined[0] if len(joined) == 1 else JoinedBlocks(joined)


def _chosen(name: str, candidates: list[BlockWeight], weight, known: Mapping[str, int] | None,
            layouts: dict[str, int] | None) -> BlockWeight | None:
    """The candidate `known` names for `name` where it names one and its first rows match, else
    the one `_matching` finds; its index goes into `layouts`. (The first rows tell the layouts
    apart, and catch a record that is wrong for this file, at a small part of the whole check.)"""
    index = known.get(name) if known is not None else None
    if index is not None and not (0 <= index < len(candidates) and _first_rows_match(candidates[index], weight)):
        index = None
    if index is None:
        index = _matching(candidates, weight)
    if index is None:
        return None
    if layouts is not None:
        layouts[name] = index
    return candidates[index]


def _first_rows_match(candidate: BlockWeight, weight: torch.Tensor | Callable[[int, int], torch.Tensor]) -> bool:
    return _rows_match(candidate, weight, 0, min(SPOT_ROWS, candidate.shape[0]))


def _matching(candidates: list[BlockWeight], weight: torch.Tensor | Callable[[int, int], torch.Tensor]) -> int | None:
    """The index of the candidate whose weights are `weight`, bit for bit, or None. `weight` may be
    a function of a row range giving those rows (a big matrix is then compared a slice at a time,
    never made whole in float32)."""
    for index, candidate in enumerate(candidates):
        rows = candidate.shape[0]
        step = CHECK_ROWS if callable(weight) else max(rows, 1)
        if all(_rows_match(candidate, weight, start, min(start + step, rows)) for start in range(0, rows, step)):
            return index
    return None


def _rows_match(candidate: BlockWeight, weight: torch.Tensor | Callable[[int, int], torch.Tensor],
                start: int, stop: int) -> bool:
    """Rows start..stop of the candidate's weights are those of `weight` (a tensor, or a function
    of a row range), bit for bit."""
    rows = BlockWeight(candidate.kind, candidate.data[start:stop], candidate.in_features)
    return matches(rows, weight(start, stop) if callable(weight) else weight[start:stop])
