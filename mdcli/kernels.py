"""CPU matrix kernels for mdcli's own forwards.

torch sends float32 `nn.Linear` on CPU to MKL's sgemm. On AMD processors MKL runs an AVX2 path,
while oneDNN (also inside every x86 torch wheel) picks its kernels from the CPU's features and uses
AVX-512 where it exists. Measured on one AMD EPYC (Zen 5) core with the embedded model's 211
weight matrices, one step of M new tokens (see BENCHMARKS.md):

    M tokens      1       8      16     512 (prefill)
    MKL        20.4    41.2    57.5    1072 ms
    oneDNN     13.8    25.2    32.4     513 ms

`onednn_linear()` routes float32 CPU linears through oneDNN while mdcli runs the model. The results
differ from MKL's only by float32 rounding (relative 1e-6, the order of any change of summation
order); the exactness tests compare against plain `generate` run the stock way. Anything else (GPU,
bf16, quantized weights, autograd) keeps torch's own path, and `MDCLI_CPU_LINEAR=torch` turns the
routing off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OPT_OUT = "MDCLI_CPU_LINEAR"


def cpu_linear_context(device: torch.device, dtype: torch.dtype):
    """The context mdcli's forwards run in: oneDNN linears on float32 CPU, else nothing."""
    import torch

    if device.type != "cpu" or dtype != torch.float32 or not onednn_linear_available():
        return nullcontext()
    return onednn_linear()


def linear_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """What mdcli's forwards use for linears here, for reports: "oneDNN" or "torch"."""
    import torch

    routed = device.type == "cpu" and dtype == torch.float32 and onednn_linear_available()
    return "oneDNN" if routed else "torch"


def onednn_linear_available() -> bool:
    """True when routing is wanted (no opt-out) and oneDNN's linear works and agrees with torch's."""
    if os.environ.get(OPT_OUT, "").strip().lower() in {"torch", "mkl", "default", "off", "0"}:
        return False
    return _onednn_linear_works()


@cache
def _onednn_linear_works() -> bool:
    """Checked once: the op exists in this torch build and computes what `F.linear` computes."""
    import torch
    import torch.nn.functional as F

    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((2, 3, 64), (48, 64), (48,)))
    try:
        got = op(x, w, b, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    want = F.linear(x, w, b)
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


@contextmanager
def onednn_linear() -> Iterator[None]:
    """While inside: float32 CPU `F.linear` without autograd runs on oneDNN.

    `nn.Linear.forward` looks `F.linear` up on every call, so replacing the module attribute
    reaches every linear layer of a transformers model without touching the model. Contexts may
    nest and overlap across threads: the first to enter installs the routing, the last to leave
    restores torch's own function.
    """
    import torch.nn.functional as F

    global _depth, _stock_linear
    with _routing_lock:
        if _depth == 0:
            _stock_linear = F.linear
            F.linear = _routed_linear
        _depth += 1
    try:
        yield
    finally:
        with _routing_lock:
            _depth -= 1
            if _depth == 0:
                F.linear = _stock_linear


_routing_lock = threading.Lock()
_depth = 0
_stock_linear = None


def _routed_linear(input, weight, bias=None):  # noqa: A002 - F.linear's own parameter name
    import torch

    if _plain_float32_cpu(input) and _plain_float32_cpu(weight) and (bias is None or _plain_float32_cpu(bias)) and not (
        torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    ):
        return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")
    return _stock_linear(input, weight, bias)


def _plain_float32_cpu(tensor) -> bool:
    """A dense float32 CPU tensor, not a quantized or distributed subclass."""
    import torch

    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
    )
