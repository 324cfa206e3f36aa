"""A lone token's products on OpenBLAS (the BLAS inside numpy's wheels), for mdcli's own forward.

Rule: with torch on one thread, on x86-64 with AVX-512 or AVX2 only, a lone token's products run on
OpenBLAS over the transposed copy of its weights (`openblas_linear`; the copy:
mdcli.backends.weights.packed), and so does bmm attention's weighted sum of the cached values for
forwards of up to the plan's `blas_queries` tokens (`openblas_bmm`), OpenBLAS pinned to one thread
inside mdcli's forwards (`one_blas_thread`, its setting restored afterwards). With more torch
threads, torch's own multi-threaded kernels on the packed copy keep the step. The selector
(mdcli.backends.select) applies the rule; `MDCLI_CPU_KERNELS=torch` turns it off with the rest of
mdcli's CPU kernel choices.

Why: a decode step of one branch is matrix-vector products, every weight read once for one row of
activations. On AVX-512 cores every kernel torch ships reads the weights at about half the core's
bandwidth there, while OpenBLAS's sgemv on a transposed copy ([in, out], contiguous) streams it at
the core's rate. numpy already ships that OpenBLAS, built for every x86 level and picking its
kernels from the CPU, so no new binary is needed: `openblas_linear` views torch's tensors as numpy
arrays (no copy), multiplies, and views the result back. OpenBLAS's own thread pool spins while
torch's OpenMP threads want the same cores, hence one thread each and only when torch runs one.
(measured: notebook/cpu-kernels.md, "A lone token on OpenBLAS"; AVX2: "Zen 3 again: OpenBLAS,
reading ahead, two-row padding")

Results differ from torch's kernels only by float32 rounding (another summation order); the tests
compare logits with transformers' forward and tokens with `generate`, as for every other kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import numpy as np
import torch
from threadpoolctl import ThreadpoolController


def openblas_works() -> bool:
    """numpy's BLAS is an OpenBLAS that threadpoolctl can set to one thread, and it computes what
    torch computes (checked once)."""
    return openblas_library() is not None and _agrees_with_torch()


def openblas_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t (+ bias) on OpenBLAS. x: [..., in] float32 CPU; weight_t: [in, out] contiguous
    -> [..., out]. One row is a GEMV reading weight_t once; several rows are a GEMM."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = torch.from_numpy(np.dot(flat.numpy(), weight_t.numpy()))  # [rows, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight_t.shape[1])


def openblas_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) on OpenBLAS: a [B, M, K], b [B, K, N] (each matrix with unit stride in its
    last dimension, e.g. a view of mdcli.core.cache's buffer) -> [B, M, N]. For a lone query's
    probabilities x cached values ([G, H/G, N] x [G, N, D]) it reads the values faster than torch's
    bmm (measured: notebook/cpu-kernels.md, "A lone token on OpenBLAS")."""
    return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread inside, its own setting restored after (a ctypes call each way)."""
    blas = openblas_library()
    if blas is None:
        yield
        return
    before = blas.get_num_threads()
    if before != 1:
        blas.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            blas.set_num_threads(before)


@cache
def openblas_library():
    """threadpoolctl's handle on the OpenBLAS numpy loaded, or None (numpy on MKL or another BLAS,
    or threadpoolctl missing). Only numpy's own: another library's OpenBLAS in the process is not
    the one `np.dot` calls, and setting its threads would pin nothing."""
    libraries = ThreadpoolController().select(internal_api="openblas").lib_controllers
    numpy_libs = [lib for lib in libraries if "numpy" in str(lib.filepath)]
    return numpy_libs[0] if numpy_libs else None


@cache
def _agrees_with_torch() -> bool:
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((2, 3, 64), (64, 48), (48,)))
    try:
        with one_blas_thread():
            got = openblas_linear(x, w.contiguous(), b)
    except (RuntimeError, TypeError, ValueError):
        return False
    return bool(torch.allclose(got, x @ w + b, rtol=1e-5, atol=1e-5))
