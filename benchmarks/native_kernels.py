#!/usr/bin/env python3
"""mdcli's C kernels on their own, on whatever x86-64 CPU runs this: every build it can run checked, then timed.

    python benchmarks/native_kernels.py [--out FILE] [--baseline OLD_gguf_blocks.c] [--no-timing]
    python benchmarks/native_kernels.py --define AHEAD_ROWS=12 --define AHEAD_ROWS=24,SPAN=16

Needs only torch and a C compiler (no mdcli install, no .gguf): it builds
mdcli/backends/native/gguf_blocks.c and attention.c with the AVX2 flags and, where the CPU has
AVX-512, with the AVX-512 flags, as mdcli.backends.weights.gguf_blocks and
mdcli.backends.attention.fused do, so a host that lacks mdcli's other dependencies (the GPU
machine's CPU, for one) still checks the AVX-512 builds.

The block kernel:

- the check: random blocks of every kind (random codes, float16 scales of many magnitudes);
  `*_dequantize` must give the formula's float32 weights bit for bit (d * q + m, d * q, d * (q - 8),
  the 16-bit numbers widened), and `*_gemm` for 1 to 19 rows (every pass size, the shared rebuilds,
  the wide panels and their remainders, 37 outputs: 12 panels of 3 and one left over; 576 and 1,600
  inputs, the latter three spans of inputs) must be within float32 rounding of
  the float64 product (k * 2^-24 * sum |x w|, a bound that holds for any order of summation);
- the timing: the embedded model's step shapes (30 layers of 960 x 576, 576 x 576, 3,072 x 576,
  576 x 1,536 in Q4_1, and the 49,152 x 576 head in Q8_0) with random codes, for 1, 2, 4, 6, 8 and 16
  rows, each build, in alternating order, one thread: ms, ratio to one row, GFLOP/s. Each
  `--define NAME=VALUE[,NAME=VALUE]` adds builds of today's source with those macros (the block
  kernel's prefetch distance AHEAD_ROWS and span SPAN), checked and timed in the same rounds: the
  way to try another setting on another host kind without editing the source.

The attention kernel:

- the check: `attention` against torch's sdpa (each key/value head repeated for its query
  heads) for GQA 9/3, 4/4 and 8/2, 2 to 64 queries, 1 to 1,027 slots (1,600 for 9/3: its keys in parts), head sizes 16, 64 and 128,
  masked (a random part of the cache, always the last slot) and not, within float32 rounding;
- the timing: the embedded model's attention in a step over 1,825 cached slots (30 layers, 9 query
  heads over 3 key/value heads, head size 64, each layer's keys and values cold), for 1 and 8
  queries, on the kernel and as mdcli's bmm core runs it (two batched products and a softmax),
  in alternating order, one thread.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

NATIVE = Path(__file__).resolve().parent.parent / "mdcli" / "backends" / "native"
SOURCE = NATIVE / "gguf_blocks.c"
ATTENTION = NATIVE / "attention.c"
FLAGS = {"AVX2": ["-O3", "-mfma", "-mf16c", "-pthread", "-mavx2"],
         "AVX512": ["-O3", "-mfma", "-mf16c", "-pthread", "-mavx512f"]}
BYTES = {"Q4_1": 20, "Q8_0": 34, "Q4_0": 18, "F16": 64, "BF16": 64}
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def build(flags: list[str], folder: Path, source: Path = SOURCE, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`source` built with `flags` and `-D` each of `defines` (NAME=VALUE), its entry points typed."""
    target = folder / f"{source.stem}-{flags[-1].lstrip('-')}{''.join('-' + d for d in defines)}.so"
    flags = [*flags, *(f"-D{d}" for d in defines)]
    subprocess.run(["cc", *flags, "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    if hasattr(lib, "scratch_floats"):
        lib.scratch_floats.argtypes, lib.scratch_floats.restype = [size], size
    else:  # a version from before the wide panels: no scratch (the extra argument is ignored)
        lib.scratch_floats = lambda k: 1
    # from the K-quants on, a product takes its output's row stride (it may fill some columns of a
    # wider output) and runs on set_threads' threads (1 here)
    lib.strided = hasattr(lib, "set_threads") or hasattr(lib, "use_pool")
    for kind in BYTES:
        gemm, expand = getattr(lib, f"{kind.lower()}_gemm"), getattr(lib, f"{kind.lower()}_dequantize")
        gemm.argtypes = [pointer, size, size, pointer, size, pointer, *([size] if lib.strided else []), pointer]
        gemm.restype = None
        expand.argtypes, expand.restype = [pointer, size, size, pointer], None
    return lib


def random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """[n, k / 32 * bytes] uint8: random codes, float16 scales (and minimums) of many magnitudes; F16
    and BF16 blocks hold random normal numbers."""
    blocks = rng.integers(0, 256, size=(n, k // 32, BYTES[kind]), dtype=np.uint8)
    if kind in ("Q4_1", "Q8_0", "Q4_0"):
        scales = (rng.standard_normal((n, k // 32, 2)) * np.exp(rng.uniform(-8, 2, (n, 1, 1)))).astype(np.float16)
        head = 4 if kind == "Q4_1" else 2
        blocks[:, :, :head] = scales.view(np.uint8).reshape(n, k // 32, 4)[:, :, :head]
    elif kind == "F16":
        blocks[:] = (rng.standard_normal((n, k // 32, 32)).astype(np.float16)).view(np.uint8).reshape(blocks.shape)
    else:  # BF16: the high halves of float32 numbers
        high = (rng.standard_normal((n, k // 32, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        blocks[:] = high.view(np.uint8).reshape(blocks.shape)
    return blocks.reshape(n, -1)


def formula(kind: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """The float32 weights [n, k] the blocks hold, by gguf-py's formulas."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 32, BYTES[kind])
    if kind == "F16":
        return b.reshape(n, -1).view(np.float16).astype(np.float32)
    if kind == "BF16":
        return (b.reshape(n, -1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float32)  # [n, blocks, 1]
    if kind == "Q8_0":
        return (d * b[:, :, 2:].view(np.int8).astype(np.float32)).reshape(n, k)
    codes = b[:, :, 4:] if kind == "Q4_1" else b[:, :, 2:]
    q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float32)  # low nibbles are weights 0-15
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(n, k)
    m = b[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(n, k)


def gemm(lib, kind: str, x: torch.Tensor, blocks: np.ndarray, n: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    scratch = torch.empty(lib.scratch_floats(x.shape[1]))
    stride = (n,) if lib.strided else ()
    getattr(lib, f"{kind.lower()}_gemm")(x.data_ptr(), x.shape[0], x.shape[1], blocks.ctypes.data, n,
                                         out.data_ptr(), *stride, scratch.data_ptr())
    return out


def rounding_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[rows, n] float64: how far any float32 sum of k products, in any order, may lie from the
    exact one: k * 2^-24 * sum |x w| (each product and partial sum rounded once). A wrong code or
    scale moves a product by about |x w| itself, far past it."""
    k = x.shape[1]
    return k * 2.0**-24 * (x.double().abs() @ weights.double().abs().T) + 1e-30


def check(lib, name: str) -> list[str]:
    rng = np.random.default_rng(0)
    failures = []
    n = 37
    for kind, k in ((kind, k) for kind in BYTES for k in (576, 1600)):  # 1,600 inputs: spans of 24, 24 and 2 blocks
        blocks = random_blocks(kind, n, k, rng)
        weights = torch.from_numpy(formula(kind, blocks, k))
        written = torch.empty(n, k)
        getattr(lib, f"{kind.lower()}_dequantize")(blocks.ctypes.data, n, k, written.data_ptr())
        if not torch.equal(written, weights):
            failures.append(f"{name} {kind}: dequantized weights differ from the formula's")
        for rows in range(1, 20):
            x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
            ours = gemm(lib, kind, x, blocks, n).double()
            exact = x.double() @ weights.double().T
            bound = rounding_bound(x, weights)
            if bool(((ours - exact).abs() > bound).any()):
                worst = float(((ours - exact).abs() / bound).max())
                failures.append(f"{name} {kind} {rows} rows: {worst:.2f}x the float32 rounding bound")
    return failures


def timing(libs: dict, repeats: int = 7) -> str:
    rng = np.random.default_rng(1)
    shapes = [("Q4_1", n, k) for _ in range(30) for n, k in LAYER] + [("Q8_0", *HEAD)]
    weights = [(kind, n, k, random_blocks(kind, n, k, rng)) for kind, n, k in shapes]
    count = sum(n * k for _, n, k, _ in weights)
    rows = (1, 2, 4, 6, 8, 16)
    inputs = {m: torch.randn(m, 1536) for m in rows}

    def step(lib, m):
        for kind, n, k, blocks in weights:
            gemm(lib, kind, inputs[m][:, :k].contiguous(), blocks, n)

    cases = [(name, m) for name in libs for m in rows]
    times = {case: [] for case in cases}
    for repeat in range(repeats):
        for case in cases if repeat % 2 == 0 else cases[::-1]:
            started = time.perf_counter()
            step(libs[case[0]], case[1])
            times[case].append(time.perf_counter() - started)
    lines = ["| build | rows | ms | x 1 row | GFLOP/s |", "|---|---:|---:|---:|---:|"]
    for (name, m), values in times.items():
        s, one = statistics.median(values), statistics.median(times[(name, 1)])
        lines.append(f"| {name} | {m} | {1000 * s:.1f} | {s / one:.2f} | {2 * count * m / s / 1e9:.1f} |")
    return "\n".join(lines)


def build_attention(flags: list[str], folder: Path) -> ctypes.CDLL:
    target = folder / f"attention-{flags[-1].lstrip('-')}.so"
    subprocess.run(["cc", *flags, "-shared", "-fPIC", "-o", str(target), str(ATTENTION)], check=True)
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.attention_scratch_floats.argtypes, lib.attention_scratch_floats.restype = [size] * 4, size
    lib.attention_rows.argtypes, lib.attention_rows.restype = [size, size], size
    lib.attention.argtypes = [pointer, *[size] * 6, pointer, pointer, size, size, pointer, ctypes.c_float,
                              pointer, pointer]
    lib.attention.restype = None
    return lib


def kernel_attention(lib, query, keys, values, mask, scale: float) -> torch.Tensor:
    """query [1, H, M, D], keys/values [1, G, N, D] (rows of D contiguous), mask [1, 1, M, N] or None -> [1, M, H * D]."""
    _, heads, m, dim = query.shape
    groups, n = keys.shape[1], keys.shape[2]
    rows = heads // groups * m
    padded = lib.attention_rows(heads // groups, m)
    mask_t = None
    if mask is not None:
        mask_t = torch.zeros(n, padded)
        mask_t[:, :rows] = mask[0, 0].repeat(heads // groups, 1).t()
    out = torch.empty(m, heads * dim)
    scratch = torch.empty(lib.attention_scratch_floats(n, heads // groups, m, dim))
    q = query[0].contiguous()
    lib.attention(q.data_ptr(), q.stride(0), q.stride(1), heads, m, groups, dim, keys.data_ptr(), values.data_ptr(),
                  n, keys.stride(1), None if mask_t is None else mask_t.data_ptr(), ctypes.c_float(scale),
                  out.data_ptr(), scratch.data_ptr(), None)
    return out.view(1, m, heads * dim)


def torch_attention(query, keys, values, mask, scale: float) -> torch.Tensor:
    heads, groups = query.shape[1], keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(heads // groups, 1), values.repeat_interleave(heads // groups, 1),
        attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(1, query.shape[2], -1)


def bmm_attention(query, keys, values, rows, scale: float) -> torch.Tensor:
    """mdcli's bmm core (mdcli.backends.llama._grouped_attention): rows [H/G * M, N] or None."""
    _, heads, m, dim = query.shape
    groups = keys.shape[1]
    stacked = query[0].reshape(groups, heads // groups * m, dim)
    keys_t = keys[0].transpose(1, 2)
    scores = torch.bmm(stacked, keys_t).mul_(scale) if rows is None else torch.baddbmm(rows, stacked, keys_t, alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values[0])
    return out.view(groups, heads // groups, m, dim).permute(2, 0, 1, 3).reshape(1, m, heads * dim)


def check_attention(lib, name: str) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    failures = []
    for heads, groups in ((9, 3), (4, 4), (8, 2)):
        for m in (2, 3, 8, 17, 64):
            for n in (1, 5, 130, 1027) if heads != 9 else (1, 5, 130, 1027, 1600):  # 1,600: 3 groups' keys in 2 parts
                for dim in (16, 64, 128):
                    query = torch.randn(1, heads, m, dim, generator=generator)
                    keys, values = (torch.randn(1, groups, n + 7, dim, generator=generator)[:, :, :n] for _ in range(2))
                    allowed = torch.rand(m, n, generator=generator) < 0.6
                    allowed[:, -1] = True
                    mask = torch.zeros(m, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
                    for given in (mask, None):
                        ours = kernel_attention(lib, query, keys, values, given, dim**-0.5)
                        theirs = torch_attention(query, keys, values, given, dim**-0.5)
                        if not torch.allclose(ours, theirs, rtol=1e-4, atol=2e-6):
                            failures.append(f"{name} attention {heads}/{groups} heads, {m} queries, {n} slots, "
                                            f"head size {dim}, {'masked' if given is not None else 'unmasked'}: "
                                            f"{float((ours - theirs).abs().max()):.3g} off")
    return failures


def attention_timing(libs: dict, repeats: int = 7) -> str:
    layers, groups, heads, dim, slots = 30, 3, 9, 64, 1825
    generator = torch.Generator().manual_seed(3)
    cache = [[torch.randn(1, groups, slots + 512, dim, generator=generator)[:, :, :slots] for _ in range(2)]
             for _ in range(layers)]  # each layer's keys and values, 84 MB in all: cold when read
    cases = {}
    for m in (1, 8):
        query = torch.randn(1, heads, m, dim, generator=generator)
        allowed = torch.rand(m, slots, generator=generator) < 0.95
        allowed[:, :1700] = True
        mask = None if m == 1 else torch.zeros(m, slots).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
        rows = None if mask is None else mask[0, 0].repeat(heads // groups, 1)
        for name, lib in libs.items():
            cases[(f"{name} kernel", m)] = lambda lib=lib, q=query, mk=mask: [
                kernel_attention(lib, q, k, v, mk, 0.125) for k, v in cache]
        cases[("torch bmm core", m)] = lambda q=query, r=rows: [bmm_attention(q, k, v, r, 0.125) for k, v in cache]
    times = {case: [] for case in cases}
    for repeat in range(repeats):
        for case in list(cases) if repeat % 2 == 0 else list(cases)[::-1]:
            started = time.perf_counter()
            cases[case]()
            times[case].append(time.perf_counter() - started)
    lines = ["| attention, 30 layers over 1,825 slots | queries | ms |", "|---|---:|---:|"]
    for (name, m), values in times.items():
        lines.append(f"| {name} | {m} | {1000 * statistics.median(values):.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another version of gguf_blocks.c (e.g. `git show REV:mdcli/backends/native/gguf_blocks.c`), "
                             "built the same ways and timed in the same rounds")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="also build today's gguf_blocks.c with these macros (e.g. AHEAD_ROWS=12), "
                             "checked and timed in the same rounds; repeat for more builds")
    args = parser.parse_args()
    variants = [tuple(d for d in given.split(",") if d) for given in args.define]
    for defines in variants:
        if not defines or any(not d.partition("=")[0].isidentifier() or not d.partition("=")[2] for d in defines):
            parser.error(f"--define {','.join(defines)!r}: give NAME=VALUE pairs, e.g. --define AHEAD_ROWS=12")
    torch.set_num_threads(1)
    flags = cpu_flags()
    runnable = [name for name, needs in (("AVX2", {"avx2", "fma", "f16c"}), ("AVX512", {"avx512f", "fma", "f16c"}))
                if needs <= flags]
    with tempfile.TemporaryDirectory() as folder:
        libs = {name: build(FLAGS[name], Path(folder)) for name in runnable}
        failures = [f for name, lib in libs.items() for f in check(lib, name)]
        attention = {name: build_attention(FLAGS[name], Path(folder)) for name in runnable}
        failures += [f for name, lib in attention.items() for f in check_attention(lib, name)]
        for defines in variants:
            built = {f"{name}, {' '.join(defines)}": build(FLAGS[name], Path(folder), SOURCE, defines) for name in runnable}
            failures += [f for name, lib in built.items() for f in check(lib, name)]
            libs |= built
        if args.baseline:
            libs |= {f"{name}, baseline": build(FLAGS[name], Path(folder), args.baseline) for name in runnable}
        lines = [f"# mdcli's C kernels on {cpu_name()} (AVX-512: {'yes' if 'avx512f' in flags else 'no'})", "",
                 f"`python benchmarks/native_kernels.py{''.join(' --define ' + d for d in args.define)}"
                 f"{' --baseline ' + args.baseline.name if args.baseline else ''}`, "
                 f"torch {torch.__version__}, one thread", "",
                 f"check ({', '.join(runnable)}): " + ("every block kind and row count, and every attention shape, "
                                                         "within float32 rounding" if not failures else "FAILED"),
                 *failures]
        if not args.no_timing:
            lines += ["", timing(libs), "", attention_timing(attention)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
