#!/usr/bin/env python3
"""A decode step's products on a file's own blocks: every matrix of a loaded model, as the step multiplies them.

    python benchmarks/file_products.py -m FILE [--rows 1,8] [--threads 1,2] [--rounds 6]
    python benchmarks/file_products.py -m FILE --baseline OLD_gguf_blocks.c [--threads 2]  # A/B two builds
    python benchmarks/file_products.py -m FILE --rows 1 --by-kind --build avx2=avx2 --build plain-codes=-DLOOKUP_ROWS=0

Loads FILE (a .gguf, or a bf16/f16 folder) as mdcli does, on its blocks, and times the step's products
(each layer's fused q/k/v, o, fused gate/up, down, and the head: gguf_reading.model_blocks) for
forwards of each `--rows`, on each `--threads` count, in alternating rounds: the median ms per
step (wall time: several threads' CPU time adds up) and the bytes read per second. With `--baseline`, that source and today's are built with the
kernels' AVX-512 (else AVX2) flags and called directly on the same blocks, alternating, on each
`--threads` count (both builds handed mdcli's pool of threads), their ratio printed: how the notebook's kernel changes were measured (notebook/gguf-blocks.md, "The
files users run"). With `--build NAME=FLAGS` (repeatable) today's source is also built with FLAGS
added to the kernels' flags (`avx2`: the AVX2 build's flags instead, on an AVX-512 host), each
build's ratio to today's printed; `--by-kind` times each weight kind's matrices apart, called the
same way (ms, G weights/s), as notebook/gguf-blocks.md's "The same files on a Zen 4 core" was measured.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.backends.host import cpu_line, cpuinfo_fields  # noqa: E402
from mdcli.bench.attention import abba  # noqa: E402  (the benchmarks' alternating timer)
from mdcli.backends.native.build import X86_FLAGS, handed_pool, host_defines, use_threads, x86_capability  # noqa: E402
from mdcli.backends.weights import gguf_blocks, gguf_reading  # noqa: E402
from mdcli.backends.weights.gguf_blocks import JoinedBlocks  # noqa: E402
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS  # noqa: E402
from mdcli.models.load import load_model  # noqa: E402


def matrices(path: str) -> list:
    """Every block matrix one decode step multiplies by, a JoinedBlocks' parts one by one."""
    lm = load_model(path, quiet=True, prompt_cache="off")
    layers, head = gguf_reading.model_blocks(lm.model)
    found = []
    for weight in [w for layer in layers for w in layer] + [head]:
        found.extend(weight.parts if isinstance(weight, JoinedBlocks) else [weight])
    return found


def step_with(weights: list, rows: int, threads: int):
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def step():
        torch.set_num_threads(threads)
        for weight in weights:
            gguf_blocks.block_linear(inputs[weight.shape[1]], weight, rows_on_kernel=64)
    return step


def built(source: Path, folder: Path, flags: str = "") -> ctypes.CDLL:
    """`source` built with the kernels' flags for this CPU and its host kind's defines, as mdcli builds
    it (flags "avx2": the AVX2 build's; other flags are added to them: -UNEAR_HINTS, say, builds
    without a Zen 4 core's hints), its products typed (strided or not)."""
    target = folder / f"{source.stem}-{abs(hash((str(source), flags)))}.so"
    capability = "AVX2" if flags == "avx2" else x86_capability()
    base = (*X86_FLAGS[capability], *host_defines(cpuinfo_fields(), capability), *([] if flags == "avx2" else flags.split()))
    subprocess.run(["cc", *base, "-I", str(gguf_blocks.SOURCE.parent), "-shared", "-fPIC", "-o", str(target), str(source)],
                   check=True)
    lib = handed_pool(ctypes.CDLL(str(target)))  # its jobs on the threads every kernel shares
    lib.strided = hasattr(lib, "set_threads") or hasattr(lib, "use_pool")  # from the K-quants on: the output's row stride, then the scratch
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for kind in KERNEL_KINDS:
        if hasattr(lib, f"{kind.lower()}_gemm"):
            product = getattr(lib, f"{kind.lower()}_gemm")
            product.argtypes = [pointer, size, size, pointer, size, pointer, *([size] if lib.strided else []), pointer]
            product.restype = None
    return lib


def by_kind(weights: list) -> dict[str, list]:
    """The matrices of each weight kind, in the step's order."""
    kinds: dict[str, list] = {}
    for weight in weights:
        kinds.setdefault(weight.kind, []).append(weight)
    return kinds


def weight_count(weights: list) -> int:
    return sum(w.shape[0] * w.shape[1] for w in weights)


def direct_step(lib: ctypes.CDLL, weights: list, rows: int, threads: int = 1):
    """The step's products through `lib`'s entry points, on `threads` threads of the pool."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    outputs = [torch.empty(rows, w.shape[0]) for w in weights]
    lib.scratch_floats.argtypes, lib.scratch_floats.restype = [ctypes.c_int64], ctypes.c_int64
    scratch = torch.empty(max(lib.scratch_floats(w.shape[1]) for w in weights))
    calls = []
    for weight, out in zip(weights, outputs):
        product = getattr(lib, f"{weight.kind.lower()}_gemm")
        x = inputs[weight.shape[1]]
        stride = (out.shape[1],) if lib.strided else ()
        calls.append((product, (x.data_ptr(), rows, x.shape[1], weight.data.data_ptr(), weight.shape[0],
                                out.data_ptr(), *stride, scratch.data_ptr())))

    def step():
        use_threads(threads)
        held = (inputs, outputs, scratch)  # the memory the calls' pointers point into, alive while they run
        for product, arguments in calls:
            product(*arguments)
        return held
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--baseline", type=Path, default=None, help="an older gguf_blocks.c to A/B against today's")
    parser.add_argument("--build", action="append", default=[], metavar="NAME=FLAGS",
                        help="also today's source built with FLAGS added (avx2: the AVX2 build), A/B on each --threads count")
    parser.add_argument("--by-kind", action="store_true", help="each weight kind apart, called straight into the kernel")
    args = parser.parse_args()
    weights = matrices(args.model)
    megabytes = sum(w.nbytes for w in weights) / 1e6
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_line()}; {args.model}: {len(weights)} matrices, {megabytes:,.0f} MB of blocks")
    if args.baseline or args.build or args.by_kind:
        with tempfile.TemporaryDirectory() as folder:
            libs = {"today": built(gguf_blocks.SOURCE, Path(folder))}
            if args.baseline:
                libs["baseline"] = built(args.baseline, Path(folder))
            for spec in args.build:
                name, _, flags = spec.partition("=")
                libs[name] = built(gguf_blocks.SOURCE, Path(folder), flags)
            groups = by_kind(weights) if args.by_kind else {"all": weights}
            counts = [int(t) for t in args.threads.split(",")]
            for count, threads, (kind, group) in ((c, t, g) for c in rows for t in counts for g in groups.items()):
                medians = {name: median for name, (median, _) in abba(
                    {name: direct_step(lib, group, count, threads) for name, lib in libs.items()}, args.rounds,
                    clock=time.perf_counter).items()}
                today = medians["today"]
                rate = weight_count(group) / today / 1e6  # weights a millisecond / 1e6: G weights/s
                # a build's time as a multiple of today's; the baseline's as before: today / baseline
                others = ", ".join(f"baseline {ms:.2f} ms, today / baseline {today / ms:.2f}" if name == "baseline"
                                   else f"{name} {ms:.2f} ms ({ms / today:.2f}x)" for name, ms in medians.items()
                                   if name != "today")
                print(f"{count} rows, {threads} thread(s), {kind} ({sum(w.nbytes for w in group) / 1e6:,.0f} MB): "
                      f"today {today:.2f} ms ({rate:.1f} G weights/s){'; ' + others if others else ''}")
        return
    cases = {(count, threads): step_with(weights, count, threads)
             for count in rows for threads in (int(t) for t in args.threads.split(","))}
    for (count, threads), (ms, _) in abba(cases, args.rounds, clock=time.perf_counter).items():
        print(f"{count} rows, {threads} thread(s): {ms:.1f} ms, {megabytes / ms:.1f} GB/s")


if __name__ == "__main__":
    main()
