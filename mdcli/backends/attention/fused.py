"""Dense attention of a few queries on mdcli's own C kernel: scores, softmax and values in one call per layer.

Rule: on AMD's x86-64 hosts (AVX2-only Zen 3, AVX-512 Zen 5), float32 on the CPU, a dense forward
of 1 to FUSED_MAX_QUERIES queries on the bmm core attends with `fused_attention`
(mdcli/backends/native/attention.c) where the kernel builds here and serves the head size
(`fused_serves`; the plan decides, mdcli.backends.select). Intel's AVX-512 hosts keep the bmm core:
on a Xeon it was faster.
torch's bmm core runs two batched products, an add, a softmax and their temporaries per layer; the
kernel reads each key and each value once for all the group's query rows, keeps the scores in the
core's second cache, and runs the softmax down the keys across rows (measured: notebook/attention.md,
"One kernel for a few queries' attention").

Where a group stacks at most 4 query rows (a lone branch: SmolLM2's 3 heads a group), the AVX-512
build lays the head's dimensions across the lanes instead of the rows, so a lone branch's attention
no longer fills 3 of 16 lanes (Zen 5, the embedded model's one-branch step at 1,819 tokens: 13.8 ->
11.3 ms; docs/performance.md, "The files users run").

The key/value groups are split over torch's threads (mdcli/backends/native/pool.c, the one
pool every kernel runs on), each group by the same code: the same numbers on any thread count.
Where the groups are not a power of two, a long cache's keys are cut into parts too (each a run,
merged after by the parts' softmax maxima and sums), the parts chosen by the call's shape alone.

Exact to float32 rounding: the same scores, softmax and weighted sum in another order of float sums,
exp by a polynomial within 2 ulp; tested against torch's attention (tests/test_fused_attention.py).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from mdcli.backends.native import build as native

SOURCE = Path(__file__).parent.parent / "native" / "attention.c"
# Dense forwards of this many queries attend on the kernel: from a lone query (a one-branch step on
# Zen 3: 45.7 against 48.3 ms on the bmm core with OpenBLAS's weighted sum, notebook/attention.md,
# "The kernel's own layouts...") to the widest forest step the selector's other rules measured on
# the bmm core (BMM_MAX_QUERIES on AVX2); past it sdpa's tiles.
FUSED_MIN_QUERIES, FUSED_MAX_QUERIES = 1, 64
# Where the kernel serves a step, it beats the one-product cascade over a shared document up to 48
# queries (mdcli.backends.attention.prefix, JOINED_MIN_QUERIES = 24 against torch's products) and
# loses at 64, on an AVX2-only Zen 3 core: the cascade is taken from 64 queries there (measured:
# notebook/attention.md, "One kernel for a few queries' attention").
JOINED_MIN_QUERIES_WITH_KERNEL = 64


@dataclass(frozen=True)
class StepMask:
    """A step's mask as the kernel reads it, made once per step and mask kind: [N, R] additive,
    R the stacked rows (H/G heads x M queries, as transformers pairs them) padded to the kernel's
    vector width with rows that see everything (their outputs are dropped)."""

    transposed: torch.Tensor  # [N, R_padded]


def fused_serves(head_dim: int) -> bool:
    """The kernel runs here and sums values of this head size (a multiple of its value chunk)."""
    return fused_works() and head_dim % library().attention_dim_multiple() == 0


def step_mask(mask: torch.Tensor | None, per_group: int) -> StepMask | None:
    """mask [1, 1, M, N] additive (None: a lone query seeing everything) -> the kernel's [N, R]."""
    if mask is None:
        return None
    rows = mask[0, 0].repeat(per_group, 1)  # [H/G * M, N], row r * M + m = query m's row
    padded = torch.zeros(rows.shape[1], library().attention_rows(per_group, mask.shape[2]), dtype=torch.float32)
    padded[:, : rows.shape[0]] = rows.t()
    return StepMask(padded)


def fused_attention(query, keys, values, mask: StepMask | None, scale: float, groups: int,
                    lib: ctypes.CDLL | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per key/value group, query head h reading group h // (H / G).

    query: [1, H, M, D]; keys, values: [1, G, N, D] float32 with rows of D contiguous (views of
    the cache's buffer); mask: `step_mask` of the engine's mask over the slots read, or None for a
    lone query seeing them all; lib: another build of the kernel (`bound`), for comparing one with
    this one; slots: [S] long, ascending: read only these slots, in place (S keys), else all N.
    Returns [1, M, H * D]."""
    lib = library() if lib is None else lib
    _, heads, m, dim = query.shape
    queries = query[0]  # [H, M, D]: the kernel reads each query's D elements in a row
    if queries.stride(2) != 1:
        queries = queries.contiguous()
    n = keys.shape[2] if slots is None else slots.shape[0]
    if keys.stride(3) != 1 or keys.stride(2) != dim or values.stride() != keys.stride():
        keys, values = keys.contiguous(), values.contiguous()
    out = torch.empty(m, heads * dim, dtype=torch.float32)  # [M, H * D], as the output projection reads it
    scratch = scores_scratch(n, heads // groups, m, dim, lib)
    native.use_threads(torch.get_num_threads())
    lib.attention(
        queries.data_ptr(), queries.stride(0), queries.stride(1), heads, m, groups, dim, keys.data_ptr(), values.data_ptr(),
        n, keys.stride(1), None if mask is None else mask.transposed.data_ptr(), ctypes.c_float(scale),
        out.data_ptr(), scratch.data_ptr(), None if slots is None else slots.data_ptr())
    return out.view(1, m, heads * dim)


_SCRATCH = threading.local()  # each thread's scores, kept for the next layer: forwards on two threads never share one


def scores_scratch(n: int, per_group: int, m: int, dim: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """This thread's float32 scratch for an attention call over n slots, m queries and heads of dim,
    per_group query heads a key/value group (lib: the build called; None: this CPU's)."""
    return _scratch((library() if lib is None else lib).attention_scratch_floats(n, per_group, m, dim))


def _scratch(size: int) -> torch.Tensor:
    """This thread's float32 scratch for the scores, of at least `size` values."""
    held = getattr(_SCRATCH, "scores", None)
    if held is None or held.numel() < size:
        held = _SCRATCH.scores = torch.empty(size, dtype=torch.float32)
    return held


@cache
def library() -> ctypes.CDLL | None:
    """The kernel for this CPU (built on first use, mdcli.backends.native.build); None where it cannot be."""
    lib = native.load_x86(SOURCE)
    return None if lib is None else bound(lib)


def bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, a build of attention.c, with its functions' argument and result types declared."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.attention_scratch_floats.argtypes, lib.attention_scratch_floats.restype = [size] * 4, size
    lib.attention_rows.argtypes, lib.attention_rows.restype = [size, size], size
    lib.attention_dim_multiple.argtypes, lib.attention_dim_multiple.restype = [], size
    lib.attention.argtypes = [pointer, *[size] * 6, pointer, pointer, size, size, pointer, ctypes.c_float,
                              pointer, pointer, pointer]
    lib.attention.restype = None
    return lib



@cache
def fused_works() -> bool:
    """The kernel builds here and computes torch's attention, masked and not, within float32 rounding."""
    if library() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    for heads, groups, m, n, dim in ((9, 3, 5, 37, 64), (4, 4, 1, 20, 32), (6, 2, 2, 300, 128)):
        query = torch.randn(1, heads, m, dim, generator=generator)
        keys, values = (torch.randn(1, groups, n, dim, generator=generator) for _ in range(2))
        allowed = torch.rand(m, n, generator=generator) < 0.7
        allowed[:, -1] = True
        mask = torch.zeros(m, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
        for given in (mask, None):
            ours = fused_attention(query, keys, values, step_mask(given, heads // groups), 0.125, groups)
            theirs = torch.nn.functional.scaled_dot_product_attention(
                query, keys.repeat_interleave(heads // groups, 1), values.repeat_interleave(heads // groups, 1),
                attn_mask=given, scale=0.125).transpose(1, 2).reshape(1, m, heads * dim)
            if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
                return False
    return True
