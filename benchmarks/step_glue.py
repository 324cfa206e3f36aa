#!/usr/bin/env python3
"""Per-step glue: the milliseconds of a decode step spent outside the model's forward, 1 and 8 branches.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/step_glue.py --rounds 2 --tokens 64 --speculate off

The embedded model, the whole-process benchmark's 1,700-token report (`mdcli.bench.margins.
bench_document`), 1 or 8 of `mdcli.bench.ask.QUESTIONS` (ask-many prompts), greedy, EOS ignored so
every branch decodes --tokens tokens (`--temperature T`: sampled, seed 0, instead). The forward the
run is handed is wrapped in a timer; a step's glue is the decode time (the run's own counter) minus
the time inside that forward, per step: the layout, mask, sampling, accepting, detokenizing, event
building and speculation bookkeeping around it. Branch counts alternate ABBA over the rounds.
`--profile B` prints cProfile's view of one run with B branches, the model's forward left out.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from mdcli import api
from mdcli.backends.host import cpu_line
from mdcli.bench.ask import QUESTIONS
from mdcli.bench.margins import bench_document
from mdcli.core.sampling import SamplingParams
from mdcli.events import Done


class TimedForward:
    """The model's forward with the seconds spent inside it added up."""

    def __init__(self, forward) -> None:
        self.inner, self.device, self.dtype, self.seconds = forward, forward.device, forward.dtype, 0.0

    def __call__(self, *args):
        started = time.perf_counter()
        out = self.inner(*args)
        self.seconds += time.perf_counter() - started
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def one_run(lm, timer: TimedForward, report: str, branches: int, tokens: int, speculate: str,
            temperature: float = 0.0) -> tuple[float, float, int]:
    """(step ms, glue ms per step, steps) of one ask-many run."""
    job = api.AskMany(document=report, questions=QUESTIONS[:branches], max_new_tokens=tokens)
    specs = job.branches(lm.tokenizer)
    for spec in specs:
        spec.ignore_eos = True
        if temperature:
            spec.sampling = SamplingParams(temperature=temperature, seed=0)
    events = api.run_specs(lm, specs, strategy="ask-many", speculate=speculate)
    for event in events:
        if event.type == "start":
            break
    prefill_forward = None
    for event in events:
        if prefill_forward is None and event.type == "token":
            prefill_forward = timer.seconds  # the decode starts with the first token
        if isinstance(event, Done):
            stats = event.stats
            forward = timer.seconds - prefill_forward
            steps = max(stats.steps, 1)
            return 1e3 * stats.decode_seconds / steps, 1e3 * (stats.decode_seconds - forward) / steps, stats.steps
    raise RuntimeError("no done event")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--speculate", default="off")
    parser.add_argument("--branches", default="1,8")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample (seed 0) instead of greedy")
    parser.add_argument("--profile", type=int, default=0, help="profile one run with this many branches instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = api.load_model(quiet=True)
    lm.forward = timer = TimedForward(lm.forward)
    report = bench_document(lm.tokenizer, 1700)
    if args.profile:
        one_run(lm, timer, report, args.profile, 4, args.speculate, args.temperature)  # warm-up
        profile = cProfile.Profile()
        profile.enable()
        one_run(lm, timer, report, args.profile, args.tokens, args.speculate, args.temperature)
        profile.disable()
        stats = pstats.Stats(profile).sort_stats("cumtime")
        stats.print_stats(r"mdcli/(core|speculative|strategies|events|render)", 40)
        stats.print_callees(r"choose|accept|steps.py.*\(forward\)|engine.py.*\(forward\)")
        return
    counts = [int(b) for b in args.branches.split(",")]
    one_run(lm, timer, report, max(counts), 4, args.speculate, args.temperature)  # warm-up
    results: dict[int, list[tuple[float, float, int]]] = {b: [] for b in counts}
    for r in range(args.rounds):
        for b in counts if r % 2 == 0 else counts[::-1]:
            results[b].append(one_run(lm, timer, report, b, args.tokens, args.speculate, args.temperature))
    print(f"CPU: {cpu_line()}; torch threads {torch.get_num_threads()}; speculate {args.speculate}; "
          f"temperature {args.temperature}; {args.tokens} tokens per branch; median of {args.rounds} rounds (ABBA)")
    for b, runs in results.items():
        step, glue = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{b} branch{'es' if b > 1 else ''}: step {step:.1f} ms, glue {glue:.2f} ms/step "
              f"(each run: {', '.join(f'{g:.2f}' for _, g, _ in runs)}), steps {runs[-1][2]}", flush=True)


if __name__ == "__main__":
    main()
