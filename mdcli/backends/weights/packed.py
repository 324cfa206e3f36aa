"""Projection weights copied once into oneDNN's blocked layout, for mdcli's own forward (fastforward.py).

oneDNN multiplies by a weight faster when the weight is stored in the blocked layout its kernel
reads, instead of being reordered from a plain row-major matrix on every call. Measured on one AMD
EPYC (Zen 5, AVX-512) core, the embedded model's 211 projections (BENCHMARKS.md, "A faster decode
step"): 8 tokens 83 -> 48 ms, 1 token 44 -> 40 ms; the output head is packed too. The cost is memory: the packed copy sits beside
the plain weights, which transformers' own forward (prefill, the reference) still reads, so it is
made only where mdcli.backends.kernels runs linears on oneDNN, only when it fits in half the free memory,
and `MDCLI_PACKED_WEIGHTS=0` turns it off. Results differ from the plain kernels' by float32
rounding only (a different summation order).

On an x86-64 CPU with AVX2 only (Zen 3) the packed copy is made too (there it is the only oneDNN
part mdcli uses: 8 tokens 97 -> 68 ms, 1 token 44 -> 40), and a second, transposed copy for the
lone-token step: MKL's product `x @ w_t` with the weight stored [in, out] streams it at 1.35x
the speed of `F.linear` on the [out, in] one (211 matrices, 1 token: 38.8 -> 28.7 ms), but not
at 8 tokens (92 ms), so each copy serves the step size it wins at. The same memory rule covers
both: the packed copy first, then the transposed one if it still fits.

On an x86-64 CPU with AVX-512 the transposed copy is made too where a lone token's products run
on OpenBLAS (mdcli.backends.weights.blas: torch on one thread), which streams it at the core's rate.

On an AVX2-only x86-64 CPU with torch on one thread, a tiled copy (mdcli.backends.weights.tiled) serves forwards
of 2 to TILED_MAX_ROWS tokens, where every kernel torch and numpy ship costs 1.6-1.8x a lone row; it
is made before the transposed copy (it gains more) under the same memory rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mdcli.backends.weights import gguf_blocks

from mdcli.backends.weights import tiled as tiled_gemm

if TYPE_CHECKING:
    import torch

BATCH_HINT = 8  # the token count oneDNN chooses the layout for; measured as good from 1 to 16 tokens


def packed_weights(model, layers) -> tuple[list[tuple], torch.Tensor]:
    """(qkv, o, gate_up, down) packed per fastforward layer, and the output head packed: made once
    per model and kept on it, so every engine over the same model shares one packed copy (the
    weights do not change while mdcli runs: it only runs inference)."""
    return _copied(model, layers, _CACHE, pack)


def transposed_weights(model, layers) -> tuple[list[tuple], torch.Tensor]:
    """The same, each weight transposed ([in, out], contiguous) for `transposed_linear`."""
    return _copied(model, layers, _TRANSPOSED_CACHE, transpose)


def tiled_weights(model, layers) -> tuple[list[tuple], object]:
    """The same, each weight in mdcli.backends.weights.tiled's tiles for `tiled_linear`."""
    return _copied(model, layers, _TILED_CACHE, tiled_gemm.tile)


def _copied(model, layers, key: str, convert) -> tuple[list[tuple], torch.Tensor]:
    cached = model.__dict__.get(key)
    if cached is None or len(cached[0]) != len(layers):
        copies = [tuple(convert(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)) for layer in layers]
        cached = (copies, convert(model.lm_head.weight))
        model.__dict__[key] = cached
    return cached


_TRANSPOSED_CACHE = "_mdcli_transposed_projections"
_TILED_CACHE = "_mdcli_tiled_projections"
_CACHE = "_mdcli_packed_projections"


@contextlib.contextmanager
def copies_set_aside(model) -> Iterator[None]:
    """The model without the weight copies kept on it, for the block (`copy.deepcopy` cannot copy
    oneDNN's packed tensors, and a copy of the model wants none of them: an int8 copy reads no .gguf
    blocks either); put back after."""
    keys = (_CACHE, _TRANSPOSED_CACHE, _TILED_CACHE, gguf_blocks.CACHE_KEY)
    aside = {key: model.__dict__.pop(key) for key in keys if key in model.__dict__}
    try:
        yield
    finally:
        model.__dict__.update(aside)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> the same matrix as an opaque oneDNN tensor for `packed_linear`."""
    import torch

    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a packed weight. x: [..., in] -> [..., out]."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN's product with a packed weight takes a slower path for exactly two rows than for three to
# six (Zen 4, AVX-512, one thread, the embedded model's 120 layer projections: 2 rows 35.2 ms, the
# same 2 rows padded to 4 25.4 ms, 3 rows 26.5 ms; BENCHMARKS.md "Two-token forwards"), so two rows
# are multiplied as four (two of zeros). Each output row depends on its own input row only.
PAIR_PADDED_ROWS = 4


def pair_padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_linear`, with a two-row input multiplied as PAIR_PADDED_ROWS rows (zeros below)."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    if flat.shape[0] != 2:
        return packed_linear(x, weight, bias)
    padded = flat.new_zeros(PAIR_PADDED_ROWS, flat.shape[1])  # [4, in]
    padded[:2] = flat
    out = packed_linear(padded, weight, bias)[:2]  # [2, out]
    return out.view(*x.shape[:-1], out.shape[-1])


def transpose(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> a contiguous [in, out] copy for `transposed_linear`."""
    import torch

    with torch.inference_mode(False), torch.no_grad():
        return weight.detach().t().contiguous()


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t (+ bias) for a transposed weight [in, out]. x: [..., in] -> [..., out]."""
    import torch

    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)  # [rows, out]
    return out.view(*x.shape[:-1], weight_t.shape[1])
