"""The attention kernel before (e2516c4: torch copies the queries transposed in and the outputs out
of each layer's call to `grouped_attention`) and now (`fused.fused_attention`: one call to
`attention`, which lays out both itself and fetches each next tile of values ahead), and mdcli's bmm
core, on a whole step's attention: 30 layers of the embedded model's shapes (9 query heads over 3
key/value heads, head size 64) over 1,825 cached slots, each layer's keys and values cold, 8
queries, rounds in alternating order, process CPU time:

    git show e2516c4:mdcli/backends/native/attention.c > /tmp/attention_e2516c4.c
    taskset -c 1 python benchmarks/attention_kernel_before_after.py /tmp/attention_e2516c4.c
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from mdcli.backends.attention import fused
from mdcli.backends.host import cpu_line
from mdcli.backends.llama import _grouped_attention
from mdcli.backends.native import build
from mdcli.bench.attention import abba

LAYERS, GROUPS, HEADS, DIM, SLOTS, QUERIES, ROUNDS = 30, 3, 9, 64, 1825, 8, 21


def old_library(source: Path) -> ctypes.CDLL:
    lib = build.load_x86(source)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.attention_scratch_floats.argtypes, lib.attention_scratch_floats.restype = [size] * 3, size
    lib.attention_lanes.restype = size
    lib.grouped_attention.argtypes = [pointer, size, size, size, pointer, pointer, size, size, pointer,
                                      ctypes.c_float, pointer, pointer]
    return lib


def old_attention(lib, query, keys, values, mask: fused.StepMask, scale: float) -> torch.Tensor:
    """e2516c4's fused.fused_attention, as it was."""
    _, heads, m, dim = query.shape
    rows = heads // GROUPS * m
    padded = -(-rows // lib.attention_lanes()) * lib.attention_lanes()
    transposed = torch.zeros(GROUPS, dim, padded)
    transposed[:, :, :rows] = query[0].reshape(GROUPS, rows, dim).transpose(1, 2)
    out = torch.empty(GROUPS, padded, dim)
    scratch = torch.empty(lib.attention_scratch_floats(keys.shape[2], padded, dim))
    lib.grouped_attention(transposed.data_ptr(), GROUPS, padded, dim, keys.data_ptr(), values.data_ptr(),
                          keys.shape[2], keys.stride(1), mask.transposed.data_ptr(), ctypes.c_float(scale),
                          out.data_ptr(), scratch.data_ptr())
    out = out[:, :rows].view(GROUPS, heads // GROUPS, m, dim)
    return out.permute(2, 0, 1, 3).reshape(1, m, heads * dim)


def main() -> int:
    torch.set_num_threads(1)
    lib = old_library(Path(sys.argv[1]))
    generator = torch.Generator().manual_seed(3)
    caches = [[torch.randn(1, GROUPS, SLOTS + 512, DIM, generator=generator)[:, :, :SLOTS] for _ in range(2)]
              for _ in range(LAYERS)]  # 84 MB: each layer's keys and values cold when read
    query = torch.randn(1, HEADS, QUERIES, DIM, generator=generator)
    allowed = torch.rand(QUERIES, SLOTS, generator=generator) < 0.95
    allowed[:, :1700] = True
    mask = torch.zeros(QUERIES, SLOTS).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    step_mask, rows = fused.step_mask(mask, HEADS // GROUPS), mask[0, 0].repeat(HEADS // GROUPS, 1)
    cases = {
        "kernel before (e2516c4)": lambda: [old_attention(lib, query, k, v, step_mask, 0.125) for k, v in caches],
        "kernel now": lambda: [fused.fused_attention(query, k, v, step_mask, 0.125, GROUPS) for k, v in caches],
        "torch bmm core": lambda: [_grouped_attention(query, k, v, rows, 0.125, GROUPS) for k, v in caches],
    }
    outputs = {name: run() for name, run in cases.items()}
    for name, out in outputs.items():
        assert torch.allclose(torch.stack(out), torch.stack(outputs["torch bmm core"]), rtol=1e-4, atol=1e-5), name
    measured = abba(cases, ROUNDS)
    print(f"{cpu_line()}, one thread; {LAYERS} layers, {QUERIES} queries over {SLOTS:,} cold slots, "
          f"{ROUNDS} rounds in alternating order, process CPU time\n")
    print("| attention of a step | median ms | fastest ms |\n|---|---:|---:|")
    for name, (median, fastest) in measured.items():
        print(f"| {name} | {median:.1f} | {fastest:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
