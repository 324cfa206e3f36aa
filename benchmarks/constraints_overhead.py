#!/usr/bin/env python3
"""Per-step decode cost with and without output constraints, 1 and 8 branches, one thread.

    PYTHONPATH=. python benchmarks/constraints_overhead.py --rounds 3 --tokens 32

The embedded model, examples/story.txt, 1 or 8 questions (ask-many prompts), greedy, EOS ignored
so every branch decodes --tokens tokens. Variants, run in alternating order each round: free,
under a regex (`[A-Za-z0-9 ,.'-]{1,400}`), under a JSON schema (several typed fields; branches may
end when their document is complete, so its per-step time is over the steps it took). Reported:
the median over rounds of decode seconds per step (the run's own counters).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mdcli import api
from mdcli.constraints import compile_for
from mdcli.events import Done

QUESTIONS = ["Who is the main character?", "Where is it set?", "What is the boat called?", "What is the weather?",
             "Who else appears?", "What happens at the end?", "What is the mood?", "What is the main event?"]
CONSTRAINTS = {
    "free": None,
    "regex": api.Constraint(regex=r"[A-Za-z0-9 ,.'-]{1,400}"),
    "schema": api.Constraint(schema="name, age int, place, weather, boat, mood, ending, score float"),
}


def per_step(lm, story: str, branches: int, tokens: int, variant: str) -> float:
    job = api.AskMany(document=story, questions=QUESTIONS[:branches], max_new_tokens=tokens)
    specs = job.branches(lm.tokenizer)
    constraint = compile_for(CONSTRAINTS[variant], lm.tokenizer)
    for spec in specs:
        spec.ignore_eos, spec.constraint = True, constraint
    for event in api.run_specs(lm, specs, strategy="ask-many"):
        if isinstance(event, Done):
            return event.stats.decode_seconds / max(event.stats.steps - 1, 1)
    raise RuntimeError("no done event")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = api.load_model(quiet=True)
    story = open("examples/story.txt", encoding="utf-8").read()
    for branches in (1, 8):
        times: dict[str, list[float]] = {name: [] for name in CONSTRAINTS}
        per_step(lm, story, branches, 4, "schema")  # warm-up
        for r in range(args.rounds):
            order = list(CONSTRAINTS) if r % 2 == 0 else list(reversed(CONSTRAINTS))
            for name in order:
                times[name].append(per_step(lm, story, branches, args.tokens, name))
        free = statistics.median(times["free"])
        line = ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms ({statistics.median(t) / free:.2f}x)"
                         for name, t in times.items())
        print(f"{branches} branch{'es' if branches > 1 else ''}: {line}", flush=True)


if __name__ == "__main__":
    main()
