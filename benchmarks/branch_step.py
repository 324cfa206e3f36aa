#!/usr/bin/env python3
"""Branches nearly free: the eight-branch decode step against the one-branch step, its parts, and their floors.

    python benchmarks/branch_step.py [--context 1819] [--steps 32] [--branches 1,8] [--out FILE]
    python benchmarks/branch_step.py --products-only --product-rows 16,32,64,128   # where the kernel and tiles cross

One thread, the embedded model as `mdcli` loads it (every forward on its .gguf blocks). In one run:

- the host: the CPU; what one thread reads per second (a sum over 512 MB, as a decode step reads its
  weights); the core's float32 multiply-add peak (benchmarks/fma_peak.c: twelve independent vector
  multiply-add chains, built with the kernels' flags), and torch's own GEMM rate on 1,024 x 1,024
  matrices beside it;
- products: the step's 121 block products (30 layers' fused q/k/v, o, fused gate/up, down, and the
  head) for forwards of 1, 2, 4, 8 and 16 rows (`--product-rows`), on the block kernel
  (`gguf_blocks.narrow_product`) and, from 8 rows, tile by tile on torch's GEMM (`tiled_product`),
  in alternating order: milliseconds, the ratio to one row, GFLOP/s, and the floor: the larger of
  the blocks' bytes over the read rate and the FLOPs over the core's peak; `--products-only` stops
  there (with wide `--product-rows`, where the kernel and the tiles cross: the plan's
  block_kernel_rows);
- the step: mdcli's engine step (mdcli.bench.steppers.EngineStepper: one greedy token for each
  branch, each branch a question over one shared `--context`-token document) at each width, the
  widths' steps taken in turn; its floor: the products' and attention's floors added, each the
  larger of its bytes over the read rate and its FLOPs over the core's peak;
- the step's parts (mdcli.bench.step.StepProfile of products and attention alone, every width's
  profiled steps taken in turn):
  products, attention and everything else, each width's products and attention against their
  floors, and what the 1.5x target asks of them: the multiply-add rate the products and attention
  of the widest step would need, given the rest of that step as measured, against the rate they reach.

The issue this answers (37) asks for the eight-branch step within 1.5x of the one-branch step.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.backends.native import build as native  # noqa: E402
from mdcli.backends.weights import gguf_blocks  # noqa: E402
from mdcli.bench.ask import Case, prompts_for  # noqa: E402
from mdcli.bench.step import StepProfile  # noqa: E402
from mdcli.bench.steppers import EngineStepper, median_step_seconds, memory_read_gbps  # noqa: E402
from mdcli.models.load import LoadOptions, load_model  # noqa: E402

PRODUCT_ROWS = (1, 2, 4, 8, 16)
PEAK_SOURCE = Path(__file__).with_name("fma_peak.c")
TARGET = 1.5  # issue 37: the eight-branch step within 1.5x of the one-branch step


def core_peak_gflops(vectors: int = 120_000_000, repeats: int = 7) -> float | None:
    """The core's float32 multiply-add peak on one thread, GFLOP/s: the best of a few runs of
    fma_peak.c's independent chains, built with the kernels' flags; None where it cannot be built."""
    lib = native.load_x86(PEAK_SOURCE)
    if lib is None:
        return None
    lib.fma_peak_flops.argtypes, lib.fma_peak_flops.restype = [ctypes.c_int64], ctypes.c_int64
    lib.fma_peak_flops(vectors // 10)
    best, flops = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        flops = lib.fma_peak_flops(vectors)
        best = min(best, time.perf_counter() - started)
    return flops / best / 1e9


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


def products_table(lm, read_gbps: float, peak: float, product_rows=PRODUCT_ROWS, repeats: int = 7) -> str:
    weights = step_weights(lm)
    count = sum(w.shape[0] * w.shape[1] for w in weights)
    stored = sum(w.nbytes for w in weights)
    inputs = {m: [torch.randn(m, w.shape[1]) for w in weights] for m in product_rows}

    def kernel(m: int, product) -> None:
        for w, x in zip(weights, inputs[m]):
            product(x, w, torch.empty(m, w.shape[0]))

    cases = {(m, "block kernel"): (m, gguf_blocks.narrow_product) for m in product_rows}
    cases |= {(m, "tiles + torch GEMM"): (m, gguf_blocks.tiled_product) for m in product_rows if m >= 8}
    times: dict = {key: [] for key in cases}
    for repeat in range(repeats):
        for key in list(cases) if repeat % 2 == 0 else list(cases)[::-1]:
            started = time.perf_counter()
            kernel(*cases[key])
            times[key].append(time.perf_counter() - started)
    fewest = min(product_rows)
    one = statistics.median(times[(fewest, "block kernel")])
    lines = [f"{count / 1e6:.0f} M weights in {stored / 1e6:.0f} MB of blocks; one product of M rows is {2 * count / 1e9:.2f} x M GFLOP",
             "", f"| rows | path | ms | x {fewest} row{'s' if fewest > 1 else ''} | GFLOP/s | floor ms | x floor |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for (m, path), seconds in times.items():
        s = statistics.median(seconds)
        floor = max(stored / read_gbps / 1e9, 2 * count * m / peak / 1e9)
        lines.append(f"| {m} | {path} | {1000 * s:.1f} | {s / one:.2f} | {2 * count * m / s / 1e9:.1f} | "
                     f"{1000 * floor:.1f} | {s / floor:.2f} |")
    both = [m for m in product_rows if (m, "tiles + torch GEMM") in times]
    if both:
        lines += ["", "| rows | block kernel / tiles, median of the rounds' ratios (range) |", "|---:|---|"]
        for m in both:
            ratios = [k / t for k, t in zip(times[(m, "block kernel")], times[(m, "tiles + torch GEMM")])]
            lines.append(f"| {m} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines)


def part_work(lm, branches: int, context: int) -> dict[str, tuple[float, float]]:
    """(bytes read, FLOPs) of each part of a step at `branches`. Products: the blocks, and 2 x weights
    x rows. Attention: the cached keys and values of `context` slots, and 4 x heads x head size x
    slots x rows per layer (scores and weighted sums; the softmax's exp not counted)."""
    config = lm.model.config
    weights = step_weights(lm)
    count = sum(w.shape[0] * w.shape[1] for w in weights)
    head_dim = config.hidden_size // config.num_attention_heads
    cache_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * 4
    attention_flops = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * context * branches
    return {"products": (sum(w.nbytes for w in weights), 2 * count * branches),
            "attention": (cache_bytes, attention_flops)}


def floors_ms(work: dict[str, tuple[float, float]], read_gbps: float, peak: float) -> dict[str, float]:
    """Each part's floor: its bytes over the read rate or its FLOPs over the core's peak, whichever is longer."""
    return {part: 1000 * max(bytes_ / read_gbps, flops / peak) / 1e9 for part, (bytes_, flops) in work.items()}


def flops_ms(work: dict[str, tuple[float, float]], peak: float) -> dict[str, float]:
    """Each part's FLOPs at the core's peak."""
    return {part: 1000 * flops / peak / 1e9 for part, (_, flops) in work.items()}


def profiled_parts_ms(steppers: dict[int, EngineStepper], lm, steps: int) -> dict[int, dict[str, float]]:
    """ms per step of products (linears and head), attention and everything else, per width, from a
    StepProfile of those parts alone (mdcli's functions wrapped by name) over `steps` steps of each
    width taken in turn."""
    profiles = {width: StepProfile(lm, parts=("linears", "lm_head", "attention")) for width in steppers}
    for _ in range(steps):
        for width, stepper in steppers.items():
            with profiles[width].observe():
                stepper.step()
    parts = {}
    for width, profile in profiles.items():
        table = dict(profile.table())
        products, attention = table["linears"] + table["lm_head"], table["attention"]
        parts[width] = {"products": products, "attention": attention,
                        "everything else": table["step"] - products - attention, "step": table["step"]}
    return parts


def parts_lines(parts: dict[int, dict[str, float]], floors: dict[int, dict[str, float]], peak: float,
                at_peak: dict[int, dict[str, float]]) -> list[str]:
    """The parts table and what the target asks of the widest step's products and attention."""
    one, wide = min(parts), max(parts)
    lines = [f"| part | {one} branch ms | {wide} branches ms | {wide} / {one} | {one}-branch floor ms | "
             f"{wide}-branch floor ms | {wide} branches x floor |", "|---|---:|---:|---:|---:|---:|---:|"]
    for part in ("products", "attention", "everything else", "step"):
        a, b = parts[one][part], parts[wide][part]
        if part in floors[wide]:
            lines.append(f"| {part} | {a:.1f} | {b:.1f} | {b / a:.2f} | {floors[one][part]:.1f} | "
                         f"{floors[wide][part]:.1f} | {b / floors[wide][part]:.2f} |")
        else:
            lines.append(f"| {part} | {a:.1f} | {b:.1f} | {b / a:.2f} | | | |")
    compute = at_peak[wide]["products"] + at_peak[wide]["attention"]  # their FLOPs at the peak, ms
    spent = parts[wide]["products"] + parts[wide]["attention"]
    budget = TARGET * parts[one]["step"] - parts[wide]["everything else"]
    best = (compute + parts[wide]["everything else"]) / parts[one]["step"]
    lines += ["", f"At {peak:.1f} GFLOP/s their FLOPs take {compute:.1f} ms at {wide} branches; they took "
              f"{spent:.1f} ms, **{100 * compute / spent:.0f}% of the core's peak**. Were they at the peak, "
              f"everything else as measured, the {wide}-branch step would be {best:.2f}x the {one}-branch one."]
    if budget > 0:
        need = 100 * compute / budget
        lines.append(f"Within {TARGET}x of the {one}-branch step ({parts[one]['step']:.1f} ms), with everything else as "
                     f"measured ({parts[wide]['everything else']:.1f} ms), they would have {budget:.1f} ms: "
                     f"**{need:.0f}% of the core's peak**{' (out of reach)' if need > 100 else ''}.")
    else:
        lines.append(f"Everything else alone ({parts[wide]['everything else']:.1f} ms) exceeds {TARGET}x the "
                     f"{one}-branch step ({parts[one]['step']:.1f} ms).")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1819)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--branches", default="1,8")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--product-rows", default=",".join(map(str, PRODUCT_ROWS)),
                        help="the forwards' widths the products table times (default %(default)s)")
    parser.add_argument("--product-repeats", type=int, default=7)
    parser.add_argument("--products-only", action="store_true", help="the host and the products table alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lm = load_model(LoadOptions(quiet=True))
    read_gbps, gemm, measured_peak = memory_read_gbps(), gemm_gflops(), core_peak_gflops()
    peak = measured_peak or gemm  # without a compiler here, torch's GEMM rate stands in for the peak
    peak_line = (f"the core's float32 multiply-add peak is {measured_peak:.1f} GFLOP/s (benchmarks/fma_peak.c); "
                 if measured_peak else "the core's peak was not measured (no C compiler): floors use torch's GEMM rate; ")
    widths = [int(b) for b in args.branches.split(",")]
    lines = [f"# The {'-'.join(map(str, widths))}-branch decode steps, their products and their floors",
             "", f"{_dt.date.today()}, {cpu_line()}, one thread; `python benchmarks/branch_step.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"one thread reads {read_gbps:.1f} GB/s; {peak_line}torch's float32 GEMM reaches {gemm:.1f} GFLOP/s", "",
             "## Products", "", products_table(lm, read_gbps, peak, [int(m) for m in args.product_rows.split(",")],
                                                args.product_repeats), ""]
    if args.products_only:
        return finish(lines, args.out)
    prompts = prompts_for(lm, Case(max(widths), args.context, args.steps))
    context = len(prompts[0])
    steppers = {width: EngineStepper(lm, prompts[:width]) for width in widths}
    medians = median_step_seconds(steppers, args.steps)
    one = medians[widths[0]]
    work = {width: part_work(lm, width, context) for width in widths}
    floors = {width: floors_ms(work[width], read_gbps, peak) for width in widths}
    lines += ["## Steps", "", f"prompt {context} tokens; each width's steps taken in turn, medians", "",
              f"| branches | ms | x {widths[0]} branch | floor ms | x floor |", "|---:|---:|---:|---:|---:|"]
    for width, seconds in medians.items():
        floor = sum(floors[width].values())
        lines.append(f"| {width} | {1000 * seconds:.1f} | {seconds / one:.2f} | {floor:.1f} | {1000 * seconds / floor:.2f} |")
    parts = profiled_parts_ms(steppers, lm, args.steps)
    lines += ["", "The step's floor is its parts' floors added: the products' and attention's, each the larger of "
              "its bytes over the read rate and its FLOPs over the peak (the rest has none).", "",
              "## Parts", "", "StepProfile (mdcli.bench.step) of products and attention alone, the widths' profiled steps taken in turn, ms per step", "",
              *parts_lines(parts, floors, peak, {width: flops_ms(work[width], peak) for width in widths})]
    finish(lines, args.out)


def finish(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)


if __name__ == "__main__":
    main()
