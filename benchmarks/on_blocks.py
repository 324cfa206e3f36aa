#!/usr/bin/env python3
"""Speed on the blocks alone against speed with the float32 copy: prefill and decode steps, side by side.

    python benchmarks/on_blocks.py [--threads 1,2] [--context 1700] [--repeats 4] [--out FILE]

Issue 39 removes the float32 copy of a .gguf's weights (mdcli.models.on_blocks) and asks that speed
hold: prefill throughput on the blocks at least 0.9x the float32 prefill, and the narrow decode
steps no slower. Both models are loaded in this one process: the default load (every forward on
the blocks) and `LoadOptions(keep_float32=True)` (the load before: float32 weights, the causal
prefill on transformers' forward, forwards of a few tokens on the blocks). Each measurement runs
on both in alternating order (ABBA); the report names the CPU and the command.

- prefill: the prompt of the first of mdcli.bench.ask's questions over a `--context`-token
  document, fed as the engine feeds it (1,024-token forwards, the last row's logits), seconds;
- step: one greedy decode step of 1 and of 8 branches over that document (mdcli.bench.steppers),
  median milliseconds.
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
from mdcli.bench.ask import Case, prompts_for  # noqa: E402
from mdcli.bench.steppers import EngineStepper, median_step_seconds  # noqa: E402
from mdcli.core.cache import new_cache  # noqa: E402
from mdcli.models.load import LoadOptions, load_model  # noqa: E402

FORWARD_TOKENS = 1024  # the engine's default max_forward_tokens


def prefill_seconds(lm, prompt: list[int]) -> float:
    tokens = torch.tensor(prompt)
    cache = new_cache()
    started = time.perf_counter()
    for start in range(0, len(prompt), FORWARD_TOKENS):
        stop = min(start + FORWARD_TOKENS, len(prompt))
        keep = torch.tensor([stop - start - 1]) if stop == len(prompt) else None
        lm.forward(tokens[start:stop], torch.arange(start, stop), None, cache, keep)
    return time.perf_counter() - started


def measure(models: dict, prompts: list[list[int]], repeats: int, steps: int) -> dict[str, dict[str, float]]:
    names = list(models)
    prefill = {name: [] for name in names}
    prefill_seconds(models[names[0]], prompts[0][:64])  # warm both up
    prefill_seconds(models[names[1]], prompts[0][:64])
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            prefill[name].append(prefill_seconds(models[name], prompts[0]))
    result = {name: {"prefill s": statistics.median(prefill[name])} for name in names}
    for width in (1, 8):
        steppers = {name: EngineStepper(models[name], prompts[:width]) for name in names}
        for name, seconds in median_step_seconds(steppers, steps).items():
            result[name][f"{width}-branch step ms"] = 1000 * seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--context", type=int, default=1700)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = {"blocks alone": load_model(LoadOptions(quiet=True)),
              "float32 copy kept": load_model(LoadOptions(quiet=True, keep_float32=True))}
    assert models["blocks alone"].forward.plan.on_blocks and not models["float32 copy kept"].forward.plan.on_blocks
    prompts = prompts_for(models["blocks alone"], Case(8, args.context, args.steps))
    lines = [f"CPU: {cpu_line()}; {_dt.date.today().isoformat()}; the embedded model; prompt {len(prompts[0]):,} "
             f"tokens; medians of {args.repeats} prefills (ABBA) and {args.steps} steps (alternating).",
             f"Command: `python benchmarks/on_blocks.py {' '.join(sys.argv[1:])}`", ""]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        result = measure(models, prompts, args.repeats, args.steps)
        columns = list(result["blocks alone"])
        lines += [f"torch threads: {threads}", "", "| | " + " | ".join(columns) + " |",
                  "|---|" + "---:|" * len(columns)]
        lines += [f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |" for name, row in result.items()]
        kept, alone = result["float32 copy kept"], result["blocks alone"]
        lines += ["| throughput, blocks alone / float32 kept | " + " | ".join(
            f"{kept[c] / alone[c]:.2f}x" for c in columns) + " |", ""]
        print("\n".join(lines[-(len(result) + 5):]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
