#!/usr/bin/env python3
"""Are the block kernel's products slower inside a decode step than on their own, and do they wait on memory?

    taskset -c 1 python benchmarks/products_in_place.py [--steps 20] [--rows 1,2,8] [--out FILE]

One thread, the embedded model as `mdcli` loads it (every forward on its .gguf blocks). Two
comparisons, each in alternating order:

- in the step or replayed: a 1- and an 8-branch engine step (mdcli.bench.steppers.EngineStepper, a
  1,819-token document) with the time inside `gguf_blocks.narrow_product` summed, against the same
  121 calls (the step's own inputs, recorded from one step) replayed on their own right after; a
  sum over 64 MB before each leaves the caches as cold as a step finds them after another;
- cold or warm weights: the step's 120 layer products with each layer's own blocks (66 MB of Q4_1,
  past the last-level cache) against the first layer's four products 30 times (2.2 MB, from the caches),
  at each of `--rows`: if the kernel waited on memory, the warm weights would be faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from branch_step import step_weights  # noqa: E402

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.backends.weights import gguf_blocks  # noqa: E402
from mdcli.bench.ask import Case, prompts_for  # noqa: E402
from mdcli.bench.attention import abba  # noqa: E402
from mdcli.bench.steppers import EngineStepper  # noqa: E402
from mdcli.models.load import load_model  # noqa: E402

FLUSH_FLOATS = 16 * 2**20  # 64 MB, twice the last-level cache of the hosts measured


class TimedProducts:
    """gguf_blocks.narrow_product, its seconds summed, its calls recorded while `recording`."""

    def __init__(self) -> None:
        self.product = gguf_blocks.narrow_product
        self.seconds, self.recording, self.calls = 0.0, False, []

    def __call__(self, flat, weight, out) -> None:
        if self.recording:
            self.calls.append((flat.clone(), weight, out.clone()))
        started = time.perf_counter()
        self.product(flat, weight, out)
        self.seconds += time.perf_counter() - started


def in_step_or_replayed(lm, widths: tuple[int, ...], steps: int) -> list[str]:
    timed = TimedProducts()
    gguf_blocks.narrow_product = timed  # the forward looks the product up by name at each call
    try:
        steppers = {b: EngineStepper(lm, prompts_for(lm, Case(branches=b, context_tokens=1819, new_tokens=64)))
                    for b in widths}
        replays = {}
        for branches, stepper in steppers.items():
            timed.calls, timed.recording = [], True
            stepper.step()
            timed.recording = False
            replays[branches] = timed.calls
        flush = torch.ones(FLUSH_FLOATS)
        times = {(b, part): [] for b in widths for part in ("step", "in the step", "replayed")}
        for _ in range(steps):
            for branches, stepper in steppers.items():
                flush.sum()
                timed.seconds, started = 0.0, time.perf_counter()
                stepper.step()
                times[(branches, "step")].append(time.perf_counter() - started)
                times[(branches, "in the step")].append(timed.seconds)
                flush.sum()
                timed.seconds = 0.0
                for flat, weight, out in replays[branches]:
                    timed(flat, weight, out)
                times[(branches, "replayed")].append(timed.seconds)
    finally:
        gguf_blocks.narrow_product = timed.product
    lines = ["| branches | step ms | its products ms | the same products replayed ms |", "|---:|---:|---:|---:|"]
    for b in widths:
        ms = [1000 * statistics.median(times[(b, part)]) for part in ("step", "in the step", "replayed")]
        lines.append(f"| {b} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} |")
    return lines


def cold_or_warm(lm, rows: tuple[int, ...], repeats: int = 9) -> list[str]:
    layers = step_weights(lm)[:-1]  # the head (one matrix) has no warm twin
    first = layers[:4]
    warm = first * (len(layers) // 4)
    inputs = {m: {k: torch.randn(m, k) for k in {w.shape[1] for w in layers}} for m in rows}

    def run(weights, m: int) -> None:
        for w in weights:
            gguf_blocks.narrow_product(inputs[m][w.shape[1]], w, torch.empty(m, w.shape[0]))

    measured = abba({(m, name): partial(run, layers if name == "cold" else warm, m)
                     for m in rows for name in ("cold", "warm")}, repeats)
    stored = sum(w.nbytes for w in layers) / 1e6
    lines = [f"| rows | each layer's own blocks ({stored:.0f} MB) ms | the first layer's, {len(layers) // 4} times, ms | warm / cold |",
             "|---:|---:|---:|---:|"]
    for m in rows:
        (cold, _), (warm_ms, _) = measured[(m, "cold")], measured[(m, "warm")]
        lines.append(f"| {m} | {cold:.1f} | {warm_ms:.1f} | {warm_ms / cold:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", default="1,2,8", help="rows of the cold-or-warm comparison")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lm = load_model()
    if not lm.forward.own.on_blocks:
        parser.error("the embedded model does not run on its .gguf blocks here: nothing to compare")
    rows = tuple(int(r) for r in args.rows.split(","))
    lines = [f"{cpu_line()}, one thread; `python benchmarks/products_in_place.py --steps {args.steps} --rows {args.rows}`",
             "", "In the step or replayed (medians):", "", *in_step_or_replayed(lm, (1, 8), args.steps),
             "", "Cold or warm weights, the 120 layer products (medians of 9 rounds in alternating order, process CPU time):", "",
             *cold_or_warm(lm, rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
