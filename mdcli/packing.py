"""Projection weights copied once into oneDNN's blocked layout, for mdcli's own forward (fastforward.py).

oneDNN multiplies by a weight faster when the weight is stored in the blocked layout its kernel
reads, instead of being reordered from a plain row-major matrix on every call. Measured on one AMD
EPYC (Zen 5, AVX-512) core, the embedded model's 211 projections (BENCHMARKS.md, "A faster decode
step"): 8 tokens 83 -> 48 ms, 1 token 44 -> 40 ms; the output head is packed too. The cost is memory: the packed copy sits beside
the plain weights, which transformers' own forward (prefill, the reference) still reads, so it is
made only where mdcli.kernels runs linears on oneDNN, only when it fits in half the free memory,
and `MDCLI_PACKED_WEIGHTS=0` turns it off. Results differ from the plain kernels' by float32
rounding only (a different summation order).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OPT_OUT = "MDCLI_PACKED_WEIGHTS"
BATCH_HINT = 8  # the token count oneDNN chooses the layout for; measured as good from 1 to 16 tokens


def packing_wanted(model) -> bool:
    import torch

    from mdcli.kernels import kernel_name
    from mdcli.memory import available_memory_bytes

    if os.environ.get(OPT_OUT, "").strip().lower() in {"0", "off", "no", "false"}:
        return False
    weight = model.model.layers[0].mlp.up_proj.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or kernel_name(weight.device, weight.dtype) != "oneDNN":
        return False
    head = model.lm_head.weight
    needed = sum(p.numel() * p.element_size() for p in (*model.model.layers.parameters(), head))
    free = available_memory_bytes(weight.device)
    return free is not None and needed <= free // 2


def packed_weights(model, layers) -> tuple[list[tuple], torch.Tensor]:
    """(qkv, o, gate_up, down) packed per fastforward layer, and the output head packed: made once
    per model and kept on it, so every engine over the same model shares one packed copy (the
    weights do not change while mdcli runs: it only runs inference)."""
    cached = model.__dict__.get(_CACHE)
    if cached is None or len(cached[0]) != len(layers):
        packed = [tuple(pack(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)) for layer in layers]
        cached = (packed, pack(model.lm_head.weight))
        model.__dict__[_CACHE] = cached
    return cached


_CACHE = "_mdcli_packed_projections"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> the same matrix as an opaque oneDNN tensor for `packed_linear`."""
    import torch

    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a packed weight. x: [..., in] -> [..., out]."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
