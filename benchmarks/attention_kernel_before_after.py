"""mdcli's attention kernel from another source (a commit's attention.c with today's entry point,
`attention`) against today's, and mdcli's bmm core, on a whole step's attention: 30 layers of the
embedded model's shapes (9 query heads over 3 key/value heads, head size 64) over 1,825 cached
slots, each layer's keys and values cold, 1 or 8 queries, rounds in alternating order, process CPU
time (wall time with --threads above 1):

    git show 6d2e976:mdcli/backends/native/attention.c > /tmp/attention_6d2e976.c
    taskset -c 1 python benchmarks/attention_kernel_before_after.py /tmp/attention_6d2e976.c --queries 8
    python benchmarks/attention_kernel_before_after.py /tmp/attention_6d2e976.c --queries 1 --threads 2

(Sources before 69d5241, e2516c4 and older, had another entry point; their comparison with it is
benchmarks/results/attention-kernel-before-after-zen3.txt.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mdcli.backends.attention import fused
from mdcli.backends.host import cpu_line
from mdcli.backends.llama import _grouped_attention
from mdcli.backends.native import build
from mdcli.bench.attention import abba

LAYERS, GROUPS, HEADS, DIM, SLOTS, ROUNDS = 30, 3, 9, 64, 1825, 21


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="the other attention.c")
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="threads of the pool both kernels run on")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp())  # the baseline beside today's headers (pool.h), which it may include
    for header in fused.SOURCE.parent.glob("*.h"):
        shutil.copy(header, folder)
    before = build.load_x86(Path(shutil.copy(args.baseline, folder)))
    if before is None:
        parser.error(f"{args.baseline} does not build here")
    before = fused.bound(before)
    generator = torch.Generator().manual_seed(3)
    caches = [[torch.randn(1, GROUPS, SLOTS + 512, DIM, generator=generator)[:, :, :SLOTS] for _ in range(2)]
              for _ in range(LAYERS)]  # 84 MB: each layer's keys and values cold when read
    m = args.queries
    query = torch.randn(1, HEADS, m, DIM, generator=generator)
    allowed = torch.rand(m, SLOTS, generator=generator) < 0.95
    allowed[:, :1700] = True
    mask = torch.zeros(m, SLOTS).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    step_mask, rows = fused.step_mask(mask, HEADS // GROUPS), mask[0, 0].repeat(HEADS // GROUPS, 1)
    cases = {
        f"kernel before ({args.baseline.name})":
            lambda: [fused.fused_attention(query, k, v, step_mask, 0.125, GROUPS, before) for k, v in caches],
        "kernel now": lambda: [fused.fused_attention(query, k, v, step_mask, 0.125, GROUPS) for k, v in caches],
        "torch bmm core": lambda: [_grouped_attention(query, k, v, rows, 0.125, GROUPS) for k, v in caches],
    }
    outputs = {name: torch.stack(run()) for name, run in cases.items()}
    for name, out in outputs.items():
        assert torch.allclose(out, outputs["torch bmm core"], rtol=1e-4, atol=1e-5), name
    measured = abba(cases, ROUNDS, clock=time.process_time if args.threads == 1 else time.perf_counter)
    print(f"{cpu_line()}, {args.threads} thread(s); {LAYERS} layers, {m} queries over {SLOTS:,} cold slots, "
          f"{ROUNDS} rounds in alternating order, {'process CPU' if args.threads == 1 else 'wall'} time\n")
    print("| attention of a step | median ms | fastest ms |\n|---|---:|---:|")
    for name, (median, fastest) in measured.items():
        print(f"| {name} | {median:.1f} | {fastest:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
