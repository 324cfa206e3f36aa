"""CPU kernels for mdcli's own float32 forwards: linears and masked attention on oneDNN.

torch sends float32 `nn.Linear` on CPU to MKL's sgemm. On AMD processors MKL runs an AVX2 path,
while oneDNN (also inside every x86 torch wheel) picks its kernels from the CPU's features and uses
AVX-512 where it exists. Measured on one AMD EPYC (Zen 5) core with the embedded model's 211
weight matrices, one forward of M new tokens (BENCHMARKS.md):

    M tokens      1       8      16     512 (prefill)
    MKL        20.4    41.2    57.5    1072 ms
    oneDNN     13.8    25.2    32.4     513 ms

A forest's decode step is several queries attending through an explicit mask. sdpa's CPU flash
kernel computes that at about 65 GFLOP/s; two oneDNN products per key/value head (scores =
queries x keys, then probabilities x values), with the query heads that share a key/value head
stacked into one matrix, are 1.4x faster over 1,700 cached tokens and 1.8x over 4,700 (8 queries,
per layer: 412 -> 292 us and 1092 -> 602 us).

`cpu_kernels(device, dtype)` installs both where they were measured to pay: x86-64 CPUs with AVX-512
(torch's reported CPU capability). On a Zen 3 core with AVX2 only the same routing was measured
slower than torch's own kernels (prefill of a 1,819-token forest 9.18 s vs 8.40 s, 8-branch step
160 vs 154 ms), so there mdcli keeps torch's; re-measured on a real Zen 3 core with
`python -m mdcli.bench.kernels` (benchmarks/results/step-zen3-kernels.txt): oneDNN linears 0.99x
of MKL at 1 token, 0.92x at 8, 0.75x at 512, its attention products 0.65-0.94x of sdpa. (mdcli's
own decode forward does use oneDNN there, for weights packed once: see `avx2_step`.) On both host
kinds, with torch on one thread, mdcli's own forward takes a lone token's products to OpenBLAS
instead (`lone_blas_step`, mdcli.backends.weights.blas). `kernel_choice` says which ran and why; reports and
the `start` event carry it. `MDCLI_CPU_KERNELS=torch|onednn` forces either (`auto`, the default,
decides by the CPU). They are process-wide switches (`F.linear` and transformers' "sdpa" entry),
installed only while mdcli runs the model, so another thread's forwards during that time take them
too; they act only on plain float32 CPU tensors without autograd; everything else (GPU, bf16,
quantized weights, a single query, an unmasked causal prefill, attention with extras such as
soft-capping or sinks) keeps transformers' and torch's own path. The results differ from the stock
kernels' only by float32 rounding (relative 1e-6, what any change of summation order gives); the
exactness tests compare with plain `generate` run the stock way, and run the engine both ways.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from mdcli.backends.weights import gguf_blocks

from mdcli.backends.weights import tiled as tiled_gemm
from mdcli.backends.weights.blas import openblas_works
from mdcli.backends.host import cpu_capability, cpu_vendor
from mdcli.errors import UsageError

if TYPE_CHECKING:
    import torch

OPT_OUT = "MDCLI_CPU_KERNELS"  # auto (default) | torch | onednn
MAX_GEMM_ATTENTION_QUERIES = 256  # above this (a long masked prefill), sdpa's tiled kernel uses less memory

_FORCE_TORCH = {"torch", "stock", "default", "off", "0"}
_FORCE_ONEDNN = {"onednn", "mkldnn", "on", "1"}


@dataclass(frozen=True)
class KernelChoice:
    """Which kernels mdcli's forwards use on this device, dtype and CPU, and why."""

    name: str  # "oneDNN" | "torch"
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_kernels(device: torch.device, dtype: torch.dtype):
    """The context mdcli's forwards run in: oneDNN linears and attention where chosen, else nothing."""
    if _routing(device, dtype).name == "torch":  # per forward: the routing alone, not the report's note
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(onednn_linear())
    stack.enter_context(onednn_attention())
    return stack


def kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """What mdcli's forwards use here, for reports: "oneDNN" or "torch"."""
    return _routing(device, dtype).name


def kernel_choice(device: torch.device, dtype: torch.dtype, blocks: str | None = None) -> KernelChoice:
    """Which kernels mdcli's forwards use and why, for the header, the `start` event and reports:
    the routing (`_routing`), noting where forwards of a few tokens read the model's .gguf blocks
    (`blocks`: their kinds, from mdcli.backends.weights.gguf_blocks.serving), else where a lone token's step runs on
    OpenBLAS (`lone_blas_step`), and where forwards of a few tokens run on mdcli's tiled kernel
    (`tiled_step`)."""
    choice = _routing(device, dtype)
    notes = [f"1-{gguf_blocks.max_rows()} tokens on the .gguf's own {blocks} blocks (the same float32 weights)"] \
        if blocks else []
    notes += [note for wanted, note in ((lone_blas_step, "one thread: a lone token on OpenBLAS"),
                                        (tiled_step, f"2-{tiled_gemm.TILED_MAX_ROWS} tokens on mdcli's tiled kernel"))
              if wanted(device, dtype) and not (blocks and wanted is lone_blas_step)]
    return KernelChoice(choice.name, "; ".join([choice.reason, *notes])) if notes else choice


def tiled_step(device: torch.device, dtype: torch.dtype) -> bool:
    """True where mdcli's own decode forward multiplies forwards of a few tokens by a tiled weight
    copy on mdcli's own kernel (mdcli.backends.weights.tiled): a float32 CPU model on an AVX2-only x86-64 CPU
    (`avx2_step`, measured on Zen 3) with torch on one thread (the kernel runs one), or wherever
    the kernel runs with MDCLI_TILED_GEMM=always; never with MDCLI_TILED_GEMM=0, by default not
    with MDCLI_CPU_KERNELS forcing a side (as `avx2_step`), and only where the kernel built and
    agrees with torch."""
    import torch

    setting = tiled_gemm.setting()
    if setting == "off" or device.type != "cpu" or dtype != torch.float32:
        return False
    if setting == "auto" and not (avx2_step(device, dtype) and torch.get_num_threads() == 1):
        return False
    return tiled_gemm.tiled_works()


def _routing(device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """Route float32 CPU forwards to oneDNN only where that was measured to win (AVX-512 on x86-64),
    unless MDCLI_CPU_KERNELS forces a side."""
    import torch

    if device.type != "cpu" or dtype != torch.float32:
        return KernelChoice("torch", "not a float32 CPU model")
    setting = kernel_setting()
    if setting == "torch":
        return KernelChoice("torch", f"{OPT_OUT}=torch")
    if not _onednn_linear_works():
        return KernelChoice("torch", "no working oneDNN in this torch build")
    if setting == "onednn":
        return KernelChoice("oneDNN", f"forced by {OPT_OUT}=onednn")
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return KernelChoice("torch", "not x86-64, where oneDNN was measured")
    capability = cpu_capability()
    if "AVX512" not in capability:
        return KernelChoice("torch", f"{capability} without AVX-512: oneDNN measured slower there")
    return KernelChoice("oneDNN", "AVX-512: measured faster there")


def avx2_step(device: torch.device, dtype: torch.dtype) -> bool:
    """True for a float32 CPU model on an x86-64 CPU with AVX2 but not AVX-512, where mdcli's own
    decode forward (mdcli.backends.llama) takes its AVX2 choices: linears stay on torch's kernels
    (routed oneDNN was slower there), but the step multiplies by weight copies laid out for it
    (oneDNN-packed for several tokens, transposed for one) and attends with two batched products.
    Measured on a Zen 3 core (BENCHMARKS.md, "A faster decode step", AVX2). False wherever
    MDCLI_CPU_KERNELS forces a side (torch: stock everywhere; onednn: the AVX-512 choices)."""
    return _auto_float32_x86_cpu(device, dtype) and cpu_capability() == "AVX2" and _onednn_linear_works()


def lone_blas_step(device: torch.device, dtype: torch.dtype) -> bool:
    """True where mdcli's own decode forward multiplies a lone token's step on OpenBLAS over
    transposed weight copies (mdcli.backends.weights.blas): a float32 CPU model, x86-64 with AVX-512 (measured
    on Zen 4: 0.78x -> 0.55x of transformers' step) or AVX2 only (measured on Zen 3: 0.66x ->
    0.63x), the kernel choice left to auto, torch on one thread (OpenBLAS's threads and torch's
    fight over the cores: 381 ms a step with two each), numpy's OpenBLAS present and agreeing with
    torch."""
    import torch

    if not _auto_float32_x86_cpu(device, dtype) or torch.get_num_threads() != 1:
        return False
    return _measured_vector_isa() and _onednn_linear_works() and openblas_works()


def read_ahead_step(device: torch.device, dtype: torch.dtype) -> bool:
    """True where mdcli's own forward streams the cached keys and values of each layer through the
    CPU's caches (`read_ahead`) before a forward of several tokens multiplies by them: a float32
    CPU model, x86-64 with AVX-512 (measured on Zen 4, see `read_ahead`) or AVX2 only (Zen 3: steps
    of several tokens 1-4% faster in each of eight paired comparisons of one run, e.g. a branch with
    3 guesses 137.8 -> 134.5 ms, 8 branches 185.4 -> 180.2 ms; 5 of 7 pairs in other runs, the two
    losses 1-2%), the kernel choice left to auto; on AMD cores only. On an Intel Xeon with AVX-512
    (family 6, model 207) it cost 5-8% in every pair of one run: 2 branches 68.8 / 68.1 against
    63.8 / 64.8 ms, 8: 89.4 / 87.8 against 83.5 / 82.8, 16: 114.8 / 112.8 against 105.7 / 105.9, a
    branch with 3 guesses 74.9 / 74.0 against 70.1 / 69.9 (BENCHMARKS.md, "Intel Xeon with AVX-512")."""
    return _auto_float32_x86_cpu(device, dtype) and _measured_vector_isa() and cpu_vendor() == "AMD"


def read_ahead(*views: torch.Tensor) -> None:
    """Read every view once, in order, so that the products that follow find it in the CPU's caches.

    Between two uses of a layer's cached keys and values a step streams ~500 MB of weights, so they
    come from memory, and the batched products of a few queries read memory badly: on one Zen 4
    core, 12 query rows per key/value group over 1,533 cold cached slots, 30 layers, the scores
    took 8.2 ms and the weighted sum 6.6 (the keys read at ~5 GB/s, a plain sum reads 27); the
    whole attention 15.6-18.2 ms, and 11.6-12.4 once a sum had read them. Whole steps of the
    embedded model over 1,500 tokens (`python -m mdcli.bench.step --guesses G`, BENCHMARKS.md
    "Reading the cache ahead"): a branch verifying 1 / 3 / 7 guesses 45.7 -> 43.3, 51.5 -> 46.7,
    67.1 -> 62.6 ms, 8 branches 69.3 -> 64.5 ms; a lone token, whose weighted sum runs on OpenBLAS,
    unchanged (36.6 / 36.2), so it is not read ahead."""
    for view in views:
        view.sum()  # the result is not wanted: the reading is the point


def _measured_vector_isa() -> bool:
    """torch dispatches to AVX-512 or to AVX2: the two host kinds the step rules were measured on
    (Zen 4 and Zen 3); an older or emulated-down capability keeps torch's own path."""
    capability = cpu_capability()
    return "AVX512" in capability or capability == "AVX2"


def _auto_float32_x86_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """A float32 model on an x86-64 CPU with the kernel choice left to auto: where the host-kind
    step rules (`avx2_step`, `lone_blas_step`) apply at all."""
    import torch

    if device.type != "cpu" or dtype != torch.float32 or kernel_setting() != "auto":
        return False
    return platform.machine().lower() in {"x86_64", "amd64"}


def kernel_setting() -> str:
    """MDCLI_CPU_KERNELS as "auto", "torch" or "onednn"; anything else is a usage error."""
    raw = os.environ.get(OPT_OUT, "").strip().lower()
    if raw in {"", "auto"}:
        return "auto"
    if raw in _FORCE_TORCH:
        return "torch"
    if raw in _FORCE_ONEDNN:
        return "onednn"
    raise UsageError(f"{OPT_OUT}={raw!r} is not a kernel choice", fix=f"set {OPT_OUT} to auto, torch or onednn")


def onednn_available() -> bool:
    """True when mdcli's float32 CPU forwards would be routed to oneDNN on this machine."""
    import torch

    return _routing(torch.device("cpu"), torch.float32).name == "oneDNN"


def onednn_works() -> bool:
    """The oneDNN linear exists in this torch build and agrees with torch (whatever the routing)."""
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
        transposed = op(x, w.t().contiguous().t(), None, "none", [], "")  # a weight given as a strided view
    except (RuntimeError, NotImplementedError):
        return False
    return all(
        bool(torch.allclose(a, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)) for a, bias in ((got, b), (transposed, None))
    )


# -- swapping a function in while any context is open -------------------------------------------


class _Swap:
    """A process-wide switch shared by every thread: the first context to open runs `install` (which
    puts the replacement in place and returns what it replaced), the last to close runs `restore`
    with that."""

    def __init__(self, install: Callable[[], object], restore: Callable[[object], None]) -> None:
        self._install, self._restore = install, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: object = None

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = self._install()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore(self._saved)


# -- linears -------------------------------------------------------------------------------------


def onednn_linear():
    """While inside: float32 CPU `F.linear` without autograd runs on oneDNN.

    `nn.Linear.forward` looks `F.linear` up on every call, so replacing the module attribute
    reaches every linear layer of a transformers model without touching the model.
    """
    return _LINEAR_SWAP.active()


def _install_linear() -> Callable:
    import torch.nn.functional as F

    global _stock_linear
    _stock_linear = F.linear
    F.linear = _routed_linear
    return _stock_linear


def _restore_linear(stock) -> None:
    import torch.nn.functional as F

    F.linear = stock


_LINEAR_SWAP = _Swap(_install_linear, _restore_linear)
_stock_linear: Callable | None = None


def _routed_linear(input, weight, bias=None):  # noqa: A002 - F.linear's own parameter name
    import torch

    if (
        _plain_float32_cpu(input)
        and _plain_float32_cpu(weight)
        and (bias is None or _plain_float32_cpu(bias))
        and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
    ):
        return _onednn_matmul_t(input, weight, bias)
    return _stock_linear(input, weight, bias)


def _onednn_matmul_t(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) on oneDNN. x: [..., K], w: [N, K] (any strides) -> [..., N]."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _plain_float32_cpu(tensor) -> bool:
    """A dense float32 CPU tensor, not a quantized or distributed subclass."""
    import torch

    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
    )


# -- masked attention ----------------------------------------------------------------------------


def onednn_attention():
    """While inside: transformers' "sdpa" attention runs masked multi-query float32 CPU attention
    as oneDNN products (`_gemm_attention`) and hands every other call to the stock function."""
    return _ATTENTION_SWAP.active()


def _install_attention() -> tuple[bool, Callable | None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _stock_sdpa
    local = ALL_ATTENTION_FUNCTIONS._local_mapping  # the instance every model looks "sdpa" up in
    saved = ("sdpa" in local, local.get("sdpa"))
    _stock_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _routed_attention
    return saved


def _restore_attention(saved: tuple[bool, Callable | None]) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    had_local, function = saved
    if had_local:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = function
    else:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


_ATTENTION_SWAP = _Swap(_install_attention, _restore_attention)
_stock_sdpa: Callable | None = None
# keyword arguments that change what attention computes: any of them given means the stock path
_ATTENTION_EXTRAS = ("softcap", "s_aux", "sinks", "position_bias", "cache")


def _routed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if _gemm_attention_applies(query, key, value, attention_mask, dropout, kwargs):
        return _gemm_attention(query, key, value, attention_mask, scaling), None
    return _stock_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)


def _gemm_attention_applies(query, key, value, mask, dropout, extras: dict) -> bool:
    import torch

    if mask is None or dropout or extras.get("output_attentions"):
        return False
    if any(extras.get(name) is not None for name in _ATTENTION_EXTRAS):  # may be tensors: no truth test
        return False
    if not all(_plain_float32_cpu(t) for t in (query, key, value, mask)) or torch.is_grad_enabled():
        return False
    batch, heads, queries, _ = query.shape
    return (
        batch == 1
        and key.shape[0] == value.shape[0] == 1
        and 2 <= queries <= MAX_GEMM_ATTENTION_QUERIES
        and heads % key.shape[1] == 0
        and key.shape[1] == value.shape[1]
        and mask.shape == (1, 1, queries, key.shape[2])
    )


def _gemm_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, one key/value head at a time.

    query: [1, H, M, D]; key: [1, G, N, D]; value: [1, G, N, Dv]; mask: [1, 1, M, N] additive.
    Query head h reads key/value head h // (H / G), as transformers' `repeat_kv` pairs them, so the
    H / G query heads of a group are stacked into one [H/G * M, D] matrix against that group's keys.
    Returns [1, M, H, Dv], the layout transformers' attention functions return.
    """
    import torch

    _, heads, queries, dim = query.shape
    groups, dim_v = key.shape[1], value.shape[-1]
    per_group = heads // groups
    scale = dim**-0.5 if scaling is None else scaling
    stacked = query[0].reshape(groups, per_group * queries, dim)  # [G, H/G * M, D]
    rows = mask[0, 0].repeat(per_group, 1) if per_group > 1 else mask[0, 0]  # [H/G * M, N]
    out = query.new_empty(groups, per_group * queries, dim_v)  # [G, H/G * M, Dv]
    for g in range(groups):
        scores = _onednn_matmul_t(stacked[g], key[0, g])  # [H/G * M, N]
        scores.mul_(scale).add_(rows)
        probabilities = torch.softmax(scores, dim=-1)
        out[g] = _onednn_matmul_t(probabilities, value[0, g].t())  # [H/G * M, Dv]
    return out.reshape(heads, queries, dim_v).transpose(0, 1).unsqueeze(0).contiguous()  # [1, M, H, Dv]
