"""CPU int8 weights (`--cpu-weights int8`): a decode step reads a quarter of float32's bytes.

Rule: with `--cpu-weights int8`, every decoder projection and the output head multiply by int8
copies: forwards of up to KERNEL_MAX_ROWS tokens on torch's int8 kernel, longer ones (a prefill) by
the dequantized weight in float32. Why: a CPU decode step of a small batch is bound by reading the
weights, and the embedded model's 538 MB of float32 projections are 135 MB as int8 (one byte per
weight, one scale per output row). (measured: notebook/int8.md, "int8 weights on CPU:
`--cpu-weights int8`")

Every projection of the decoder layers and the output head is quantized once at load time:
symmetric, per output row, round to nearest, the scale a bf16 number (`quantize`). Products run on
torch's int8 weight-only kernel (`torch._weight_int8pack_mm`): activations rounded to bf16, sums in
float32, the result rounded to bf16, then back to float32; the rest of the model (embeddings, norms,
rotary, attention, the cache) stays float32. The kernel reads the rows of a product independently, so
a token's output does not depend on the other tokens in the forward (bit-identical where measured;
the tests hold it to one bf16 step, as they may run on another host); forwards
of more than KERNEL_MAX_ROWS tokens (a prefill) multiply by the dequantized weight in float32
instead, where torch's float32 kernels are faster, which differs from the kernel by float32
rounding before the same bf16 rounding.

So the model is a different, slightly lossy model (the quantization), and runs of it agree in the
tie-aware sense the README gives for bf16: each branch is token for token the same int8 model run
alone until a token where the reference's own logits are a near-tie. Every product, the forest's and
the reference's, goes through `int8_linear`, so the reference is this same int8 model (transformers'
forward over `Int8Linear` modules), not the float32 one.

Refused with a one-line reason (`setting_refusal`, `model_refusal`): another device than the CPU,
a dtype other than float32, bitsandbytes weights, projections that are not `nn.Linear` (GPT-2's
Conv1D), or a torch without the kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from mdcli.backends.weights.row_slices import joined_rows
from mdcli.errors import UnsupportedModelError

CHOICES = ("float32", "int8")
# Forwards of up to this many tokens take the int8 kernel, longer ones the dequantized float32
# product, which is the faster past 32 rows (measured: notebook/int8.md, "int8 weights on CPU:
# `--cpu-weights int8`").
KERNEL_MAX_ROWS = 32
# The kernel reads the inner dimension in blocks and does not check it: other widths give garbage or
# crash the process (torch 2.13; blocks of 16 on AVX-512, of 8 under ATEN_CPU_CAPABILITY=avx2), so
# such a matrix always takes the dequantized product.
KERNEL_INNER_MULTIPLE = 16
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Int8Weight:
    """A quantized [N, K] weight: values [N, K] int8, scales [N] bf16; value x scale ~ the weight."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8: each row's scale its largest magnitude over 127, rounded to bf16 first
    so that the values are rounded against the scale the kernel multiplies by."""
    with torch.inference_mode(False), torch.no_grad():
        rows = weight.detach().float()  # [N, K]
        scales = (rows.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)  # [N]
        values = torch.round(rows / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [N, K]
    return Int8Weight(values, scales)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] float32: x times the quantized weight, activations and
    result rounded to bf16 (the kernel's arithmetic either way)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
    kernel = rows.shape[0] <= KERNEL_MAX_ROWS and weight.values.shape[1] % KERNEL_INNER_MULTIPLE == 0
    out = kernel_product(rows, weight) if kernel else dequantized_product(rows, weight)  # [M, N] bf16
    out = out.to(x.dtype).view(*x.shape[:-1], weight.values.shape[0])
    return out if bias is None else out + bias


def kernel_product(rows: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """rows [M, K] bf16 (K a multiple of KERNEL_INNER_MULTIPLE) -> [M, N] bf16 on torch's int8 kernel."""
    return torch._weight_int8pack_mm(rows.contiguous(), weight.values, weight.scales)


def dequantized_product(rows: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The kernel's arithmetic on float32's own kernels (rows [M, K] bf16 -> [M, N] bf16): the same
    sums in another order, so float32 rounding apart before the bf16 rounding."""
    return (torch.nn.functional.linear(rows.float(), weight.values.float()) * weight.scales.float()).to(torch.bfloat16)


@functools.cache
def int8_linear_class():
    """The `Int8Linear` module class, made on first use (this module is imported without torch, as
    `mdcli --help` must be fast)."""
    class Int8Linear(nn.Module):
        """An nn.Linear whose weight is int8 (`Int8Weight`); forward is `int8_linear`. The values
        and scales may be row slices of a matrix fused with the layer's other projections."""

        def __init__(self, weight: Int8Weight, bias) -> None:
            super().__init__()
            self.out_features, self.in_features = weight.values.shape
            self.register_buffer("values", weight.values, persistent=False)
            self.register_buffer("scales", weight.scales, persistent=False)
            self.bias = bias

        @property
        def int8(self) -> Int8Weight:
            return Int8Weight(self.values, self.scales)

        def forward(self, x):
            return int8_linear(x, self.int8, self.bias)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, bf16 scales"

    return Int8Linear


def has_int8_weights(model) -> bool:
    """Whether `quantize_model` has run on this model."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return False
    return type(getattr(layers[0].mlp, "up_proj", None)).__name__ == "Int8Linear"


def setting_refusal(device, dtype, bits: int | None) -> tuple[str, str] | None:
    """Why `--cpu-weights int8` cannot run with this device, dtype and bitsandbytes setting, and the
    fix (None: it can); checked before any weights are read."""
    if device.type != "cpu":
        return f"--cpu-weights int8 is for CPU runs, not {device.type}", "use --load-in-8bit on CUDA, or --device cpu"
    if bits:
        return f"--cpu-weights int8 and --load-in-{bits}bit both quantize the weights", "give one of them"
    if dtype != torch.float32:
        return (f"--cpu-weights int8 keeps float32 activations, not {str(dtype).removeprefix('torch.')}",
                "drop --dtype or give --dtype float32")
    if not hasattr(torch, "_weight_int8pack_mm"):
        return f"torch {torch.__version__} has no int8 weight kernel", "install torch 2.3 or later"
    return None


def model_refusal(model) -> tuple[str, str] | None:
    """Why this model's weights cannot be made int8 here, and the fix (None: they can)."""
    layers = _layers(model)
    kind = getattr(getattr(model, "config", None), "model_type", None) or "this model"
    for layer in layers or [None]:
        modules = None if layer is None else _projections(layer)
        if modules is None or any(type(m) is not nn.Linear for m in modules.values()):
            return (f"--cpu-weights int8 takes Llama-style layers of nn.Linear projections, and {kind}'s are not",
                    "drop --cpu-weights int8")
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        return f"--cpu-weights int8 needs an nn.Linear output head, and {kind} has none", "drop --cpu-weights int8"
    return None


def quantize_model(model) -> int:
    """Replace every decoder projection and the output head with `Int8Linear` modules, in place;
    returns the bytes the int8 weights take. A model `model_refusal` names is refused
    (UnsupportedModelError) before anything changes. q/k/v and gate/up are quantized as one matrix
    each, the modules holding row slices of it, so mdcli's own forward multiplies by them fused without a
    copy (quantization is per row: fusing changes no number). The float32 projection weights are
    released (a tied output head keeps the input embedding it shares)."""
    refused = model_refusal(model)
    if refused:
        raise UnsupportedModelError(refused[0], fix=refused[1])
    Int8Linear = int8_linear_class()
    total = 0
    for layer in _layers(model):
        modules = _projections(layer)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)):
            fused = quantize(_cat([modules[name].weight for name in group]))
            total += fused.nbytes
            start = 0
            for name in group:
                old = modules[name]
                rows = old.out_features
                part = Int8Weight(fused.values[start:start + rows], fused.scales[start:start + rows])
                setattr(_owner(layer, name), name, Int8Linear(part, old.bias))
                start += rows
    head = model.lm_head
    quantized = quantize(head.weight)
    total += quantized.nbytes
    model.lm_head = Int8Linear(quantized, head.bias)
    return total


def described(nbytes: int) -> str:
    """How a run names its int8 weights (the header's dtype reason, the bench's): "int8 weights, 129 MiB"."""
    return f"int8 weights, {nbytes / 2**20:.0f} MiB"


def fused_int8(modules) -> Int8Weight:
    """The one quantized matrix that `modules` (Int8Linear, in order) are consecutive row slices of,
    or a copy joining them where they are not (a model quantized by other means)."""
    values = [m.values for m in modules]
    scales = [m.scales for m in modules]
    joined_values, joined_scales = joined_rows(values), joined_rows(scales)
    if joined_values is None or joined_scales is None:
        return Int8Weight(torch.cat(values).contiguous(), torch.cat(scales).contiguous())
    return Int8Weight(joined_values, joined_scales)


def _cat(weights) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()


def _layers(model):
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", None) or [])


def _projections(layer) -> dict | None:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        return None
    modules = {name: getattr(attention, name, None) for name in _PROJECTIONS[:4]}
    modules |= {name: getattr(mlp, name, None) for name in _PROJECTIONS[4:]}
    return None if any(m is None for m in modules.values()) else modules


def _owner(layer, name: str):
    return layer.self_attn if name in _PROJECTIONS[:4] else layer.mlp
