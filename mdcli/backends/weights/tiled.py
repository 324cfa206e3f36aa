"""Products of a few rows by a weight read once: mdcli's own small kernel for AVX2 x86-64 CPUs.

Rule: on an AVX2-only x86-64 CPU with torch on one thread, mdcli.backends.llama multiplies forwards
of 2 to TILED_MAX_ROWS tokens by a tiled copy of each weight (the selector, mdcli.backends.select,
applies it). `MDCLI_TILED_GEMM=0` turns it off, `=always` uses it on any x86-64 CPU with AVX2
(tests, measurement).

Why: a decode forward of 2-64 tokens (several branches, or a branch and its guesses) multiplies a
few rows of activations by every weight. Memory-bound, it should cost about what one row costs, the
weight being read once either way; on AVX2-only cores no kernel torch or numpy ships does that (2 to
8 rows cost 1.6-1.8x one). `tiled_gemm.c` (mdcli/backends/native/) streams a copy of each weight laid
out in tiles of 16 output columns once, each loaded weight vector serving up to 4 rows (more rows
re-read the tile from the core's caches). (measured: notebook/cpu-kernels.md, "Small products on
Zen 3: mdcli's own kernel")

The kernel is C with AVX2 intrinsics, compiled once per machine with the system's C compiler
(`$CC`, else `cc`) into mdcli's cache folder (`$MDCLI_CACHE_DIR/kernels`, see
mdcli.backends.native.build), and loaded with ctypes: nothing to build at install, nothing new to
download. Without a compiler, or if the library fails its check against torch, mdcli keeps torch's
and numpy's kernels (the step is slower, the tokens the same).

Each output sums blocks of 128 inputs, each a multiply-add chain in input order: another summation
order than other BLAS kernels, so logits agree with them to float32 rounding (tested like every
other kernel).
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from mdcli.backends.host import cpu_capability
from mdcli.backends.native import build as native

TILE = 16  # output columns per tile, as TILE in tiled_gemm.c
SOURCE = Path(__file__).parent.parent / "native" / "tiled_gemm.c"
FLAGS = ("-O3", "-mavx2", "-mfma")
# mdcli.backends.llama multiplies forwards of up to this many tokens by the tiled copy where it makes
# one, wider ones by its packed copy: tiled beats packed at every width measured, up to 64 (measured:
# notebook/cpu-kernels.md, "Small products on Zen 3: mdcli's own kernel"; wider not measured).
TILED_MAX_ROWS = 64


def tiled_works() -> bool:
    """The kernel compiled (or was compiled before) for this machine and computes what torch does."""
    return _cpu_has_avx2_fma() and library() is not None and _agrees_with_torch()


def tile(weight: torch.Tensor) -> TiledWeight:
    """[out, in] float32 -> the weight as tiles of TILE output columns: [ceil(out / TILE), in, TILE]."""
    with torch.inference_mode(False), torch.no_grad():
        out, inner = weight.shape
        padded = torch.zeros(-(-out // TILE) * TILE, inner, dtype=weight.dtype)  # [out rounded up, in]
        padded[:out] = weight.detach()
        tiles = padded.view(-1, TILE, inner).transpose(1, 2).contiguous()  # [tiles, in, TILE]
    return TiledWeight(tiles, out)


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """A weight in tiles (`tile`): [ceil(out / TILE), in, TILE], and its true output size."""

    tiles: torch.Tensor
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as the weight's own shape."""
        return self.out_features, self.tiles.shape[1]


def tiled_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for a tiled W. x: [..., in] float32 CPU -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, in]
    if flat.dtype != torch.float32 or flat.device.type != "cpu":  # the kernel reads raw float32 memory
        raise ValueError(f"the tiled kernel multiplies float32 CPU tensors, not {flat.dtype} on {flat.device}")
    rows, inner = flat.shape
    out = torch.empty(rows, weight.out_features, dtype=flat.dtype)  # [rows, out]
    library().tiled_gemm(flat.data_ptr(), rows, inner, weight.tiles.data_ptr(), weight.out_features, out.data_ptr())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use and kept in the cache folder (mdcli.backends.native.build); None if it cannot be."""
    lib = native.load(SOURCE, FLAGS)
    if lib is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.tiled_gemm.argtypes = [pointer, size, size, pointer, size, pointer]
    lib.tiled_gemm.restype = None
    return lib


def _cpu_has_avx2_fma() -> bool:
    """x86-64 whose torch build found AVX2 (which implies FMA for ATen) or AVX-512."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return False
    return cpu_capability() in {"AVX2", "AVX512"}


@cache
def _agrees_with_torch() -> bool:
    """Every row count the kernel branches on (1-4 and a second pass) and a partial last tile."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(37, 24, generator=generator), torch.randn(37, generator=generator)
    tiled = tile(weight)
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, 24, generator=generator)
        if not torch.allclose(tiled_linear(x, tiled, bias), x @ weight.T + bias, rtol=1e-5, atol=1e-5):
            return False
    return True
