"""Weight copies laid out for the kernel that takes a forward's size, for mdcli's own forward
(mdcli.backends.llama): packed in oneDNN's blocked layout, transposed, or tiled.

Rules (the selector, mdcli.backends.select, decides where they apply):

* a packed copy (`packed_weights`: every projection and the output head) serves the forwards no
  narrower copy takes, where linears run on oneDNN (x86-64 with AVX-512) and on AVX2-only x86-64
  (where it is the only oneDNN part mdcli uses): oneDNN multiplies faster by a weight stored in the
  blocked layout its kernel reads than by one reordered from row-major on every call;
* a transposed copy (`transposed_weights`, [in, out]) serves a lone token on AVX2-only x86-64, and
  with torch on one thread on AVX-512 too, where its products run on OpenBLAS
  (mdcli.backends.weights.blas): stored [in, out] a weight streams at the core's rate for one row
  but not for several, so each copy serves the step size it wins at;
* a tiled copy (`tiled_weights`, mdcli.backends.weights.tiled) serves forwards of 2 to
  TILED_MAX_ROWS tokens on an AVX2-only x86-64 CPU with torch on one thread;
* two-row products on the packed copy run as four rows on AMD cores with AVX-512 (`pair_padded_linear`);
* every copy sits beside the plain weights, which transformers' forward (prefill, the reference)
  still reads, so each is made only if it fits in half the free memory, in the order packed, tiled,
  transposed; `MDCLI_PACKED_WEIGHTS=0` makes none.

Results differ from the plain kernels' by float32 rounding only (a different summation order).
(measured: notebook/cpu-kernels.md, "A faster decode step"; AVX2: "Zen 3 (AVX2), measured on the
real host kind")
"""

from __future__ import annotations

import weakref

import torch

from mdcli.backends.weights import tiled as tiled_gemm

BATCH_HINT = 8  # the token count oneDNN chooses the layout for; it serves 1 to 16 tokens alike


def packed_weights(model, layers) -> tuple[list[tuple], torch.Tensor]:
    """(qkv, o, gate_up, down) packed per mdcli.backends.llama layer, and the output head packed: made once
    per model and kept beside it (`_COPIES`), so every forward over the same model shares one packed
    copy (the weights do not change while mdcli runs: it only runs inference)."""
    return _copied(model, layers, "packed", pack)


def transposed_weights(model, layers) -> tuple[list[tuple], torch.Tensor]:
    """The same, each weight transposed ([in, out], contiguous) for `transposed_linear`."""
    return _copied(model, layers, "transposed", transpose)


def tiled_weights(model, layers) -> tuple[list[tuple], object]:
    """The same, each weight in mdcli.backends.weights.tiled's tiles for `tiled_linear`."""
    return _copied(model, layers, "tiled", tiled_gemm.tile)


def _copied(model, layers, kind: str, convert) -> tuple[list[tuple], torch.Tensor]:
    cached = _COPIES[kind].get(model)
    if cached is None or len(cached[0]) != len(layers):
        copies = [tuple(convert(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)) for layer in layers]
        cached = (copies, convert(model.lm_head.weight))
        _COPIES[kind][model] = cached
    return cached


# Each model's weight copies by kind, held beside the model, never on it: keyed weakly, they go when
# the model does, and a copy of the model (copy.deepcopy) starts without them.
_COPIES: dict[str, weakref.WeakKeyDictionary] = {kind: weakref.WeakKeyDictionary()
                                                 for kind in ("packed", "transposed", "tiled")}


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> the same matrix as an opaque oneDNN tensor for `packed_linear`."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a packed weight. x: [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN's product with a packed weight takes a slower path for exactly two rows than for three to
# six on AMD cores with AVX-512, so there two rows are multiplied as four (two of zeros); each output
# row depends on its own input row only (measured: notebook/cpu-kernels.md, "Two-token forwards").
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
    with torch.inference_mode(False), torch.no_grad():
        return weight.detach().t().contiguous()


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t (+ bias) for a transposed weight [in, out]. x: [..., in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)  # [rows, out]
    return out.view(*x.shape[:-1], weight_t.shape[1])
