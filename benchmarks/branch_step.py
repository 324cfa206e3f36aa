#!/usr/bin/env python3
"""Branches nearly free: the eight-branch decode step against the one-branch step, its parts, and their floors.

    python benchmarks/branch_step.py [--context 1819] [--steps 32] [--branches 1,8] [--out FILE]

One thread, the embedded model as `mdcli` loads it (every forward on its .gguf blocks). In one run:

- the host: the CPU; what one thread reads per second (a sum over 512 MB, as a decode step reads its
  weights); the core's float32 multiply-add rate, as torch's own GEMM reaches it on 1,024 x 1,024
  matrices (the practical ceiling of any float32 product here);
- products: the step's 211 block products (30 layers' fused q/k/v, o, fused gate/up, down, and the
  head) for forwards of 1, 2, 4, 8 and 16 rows, on `gguf_blocks.block_linear` (the kernel the plan
  uses at that width) and, from 8 rows, tile by tile on torch's GEMM (`tiled_product`), in alternating
  order: milliseconds, the ratio to one row, GFLOP/s, and the floor: the larger of the blocks' bytes
  over the read rate and the FLOPs over the GEMM rate;
- the step: mdcli's engine step (mdcli.bench.steppers.EngineStepper: one greedy token for each
  branch, each branch a question over one shared `--context`-token document) at each width, the
  widths' steps taken in turn; its floor: reading the weights and the cached keys and values once
  (bytes over the read rate) or their FLOPs (over the GEMM rate), whichever is larger.

The issue this answers (37) asks for the eight-branch step within 1.5x of the one-branch step.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.backends.weights import gguf_blocks  # noqa: E402
from mdcli.bench.ask import Case, prompts_for  # noqa: E402
from mdcli.bench.steppers import EngineStepper, median_step_seconds, memory_read_gbps  # noqa: E402
from mdcli.models.load import LoadOptions, load_model  # noqa: E402

PRODUCT_ROWS = (1, 2, 4, 8, 16)


def gemm_gflops(size: int = 1024, repeats: int = 10) -> float:
    """torch's float32 GEMM rate on one thread, GFLOP/s: the best of a few size x size products."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def step_weights(lm) -> list:
    """The BlockWeights one decode step multiplies by: each layer's four products, then the head."""
    own = lm.forward.own
    return [w for layer in own.block_layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [own.block_head]


def products_table(lm, read_gbps: float, gemm: float, repeats: int = 7) -> str:
    weights = step_weights(lm)
    count = sum(w.shape[0] * w.shape[1] for w in weights)
    stored = sum(w.nbytes for w in weights)
    inputs = {m: [torch.randn(m, w.shape[1]) for w in weights] for m in PRODUCT_ROWS}

    def kernel(m: int, product) -> None:
        for w, x in zip(weights, inputs[m]):
            product(x, w, torch.empty(m, w.shape[0]))

    def planned(x, w, out):
        out.copy_(gguf_blocks.block_linear(x, w))

    cases = {(m, "block_linear"): (m, planned) for m in PRODUCT_ROWS}
    cases |= {(m, "tiles + torch GEMM"): (m, gguf_blocks.tiled_product) for m in PRODUCT_ROWS if m >= 8}
    times: dict = {key: [] for key in cases}
    for repeat in range(repeats):
        for key in list(cases) if repeat % 2 == 0 else list(cases)[::-1]:
            started = time.perf_counter()
            kernel(*cases[key])
            times[key].append(time.perf_counter() - started)
    one = statistics.median(times[(1, "block_linear")])
    lines = [f"{count / 1e6:.0f} M weights in {stored / 1e6:.0f} MB of blocks; one product of M rows is {2 * count / 1e9:.2f} x M GFLOP",
             "", "| rows | path | ms | x 1 row | GFLOP/s | floor ms | x floor |", "|---:|---|---:|---:|---:|---:|---:|"]
    for (m, path), seconds in times.items():
        s = statistics.median(seconds)
        floor = max(stored / read_gbps / 1e9, 2 * count * m / gemm / 1e9)
        lines.append(f"| {m} | {path} | {1000 * s:.1f} | {s / one:.2f} | {2 * count * m / s / 1e9:.1f} | "
                     f"{1000 * floor:.1f} | {s / floor:.2f} |")
    return "\n".join(lines)


def step_floor_ms(lm, branches: int, context: int, read_gbps: float, gemm: float) -> float:
    """The step's floor: its weights and cached keys and values read once, or its FLOPs, whichever takes longer."""
    config = lm.model.config
    weights = step_weights(lm)
    count = sum(w.shape[0] * w.shape[1] for w in weights)
    head_dim = config.hidden_size // config.num_attention_heads
    cache_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * 4
    attention_flops = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * context * branches
    read = (sum(w.nbytes for w in weights) + cache_bytes) / read_gbps / 1e9
    compute = (2 * count * branches + attention_flops) / gemm / 1e9
    return 1000 * max(read, compute)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1819)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--branches", default="1,8")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = load_model(LoadOptions(quiet=True))
    read_gbps, gemm = memory_read_gbps(), gemm_gflops()
    widths = [int(b) for b in args.branches.split(",")]
    lines = [f"# The {'-'.join(map(str, widths))}-branch decode steps, their products and their floors",
             "", f"{_dt.date.today()}, {cpu_line()}, one thread; `python benchmarks/branch_step.py "
             f"--context {args.context} --steps {args.steps} --branches {args.branches}`", "",
             f"one thread reads {read_gbps:.1f} GB/s; torch's float32 GEMM reaches {gemm:.1f} GFLOP/s", "",
             "## Products", "", products_table(lm, read_gbps, gemm), ""]
    prompts = prompts_for(lm, Case(max(widths), args.context, args.steps))
    steppers = {width: EngineStepper(lm, prompts[:width]) for width in widths}
    medians = median_step_seconds(steppers, args.steps)
    one = medians[widths[0]]
    lines += ["## Steps", "", f"prompt {len(prompts[0])} tokens; each width's steps taken in turn, medians", "",
              f"| branches | ms | x {widths[0]} branch | floor ms | x floor |", "|---:|---:|---:|---:|---:|"]
    for width, seconds in medians.items():
        floor = step_floor_ms(lm, width, len(prompts[0]), read_gbps, gemm)
        lines.append(f"| {width} | {1000 * seconds:.1f} | {seconds / one:.2f} | {floor:.1f} | {1000 * seconds / floor:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
