"""Benchmark: one layer's attention on the three plans mdcli's forward chooses between.

    python -m mdcli.bench.attention            # one thread, the embedded model's head shapes
    python -m mdcli.bench.attention --step     # whole steps' attention: 30 layers, cold caches, ABBA

For the masks of real forests (built here as the engine lays them out: a document in one run of
slots, branches hanging off it, their generated tokens interleaved step by step), one decode step's
attention (9 query heads over 3 key/value heads, head size 64, the bmm core) is timed:

* dense: every query against every slot, masked (mdcli.backends.llama's bmm core);
* gathered: each query's visible slots copied out, then attended (mdcli.backends.attention.sparse);
* prefix: each bucket's visible prefix read in place, the rest gathered (mdcli.backends.attention.prefix);

next to the work the rule counts for each (query-slot products, a gathered slot counted as this
host kind's gather cost, a bucket as BUCKET_COST), and the plan the rule picks. All three compute the
same values (the largest difference is shown). This is what the rule's constants are fitted to.

`--step` times a whole decode step's attention instead: every layer of the embedded model (30) with
its own keys and values (so they come from memory, as in a real step, where the weights stream
between two layers), as mdcli's forward runs it (the plan made once, the bmm core, no reading
ahead), rounds in alternating order (ABBA), for one query and for the ask-many step of 8 branches,
dense and on the plan the rule picks or the prefix plan forced.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from mdcli.backends.attention import sparse as sa
from mdcli.backends.attention.prefix import (
    PrefixPlan,
    bucket_prefixes,
    dense_work,
    plan_prefixes,
)
from mdcli.backends.attention.prefix import grouped_attention as prefix_attention
from mdcli.backends.attention.sparse import GATHER_COST_AVX512
from mdcli.backends.host import has_avx512
from mdcli.backends.llama import _grouped_attention
from mdcli.bench.kernels import median_seconds
from mdcli.bench.margins import machine

HEADS, KV_HEADS, DIM = 9, 3, 64


@dataclass
class Scene:
    name: str
    allowed: object  # [M, N] bool: what each of the step's M queries sees


def _scattered(n_branches: int, written: int, start: int):
    """Slots of each branch's `written` tokens, written one step at a time for all branches."""
    return [[start + step * n_branches + b for step in range(written)] for b in range(n_branches)]


def margins_step(questions: int, segments: int, document: int = 4000, suffix: int = 60, written: int = 24) -> Scene:
    """Margins' chain layout: the document in one run; question q's margin of segment i reads its
    first i segments, then its own suffix (laid after the document), then the tokens it wrote."""
    reads = [document * (b % segments + 1) // segments for b in range(questions * segments)]
    return Scene(f"margins step: {questions} questions x {segments} segments, {document:,}-token document",
                 _branches(reads, document, suffix, written))


def separate_prompts(branches: int, prompt: int = 230, shared: int = 30, written: int = 12) -> Scene:
    """Classification: unrelated prompts after a short shared system prompt, tokens interleaved."""
    return Scene(f"classification step: {branches} prompts of {prompt} tokens",
                 _branches([shared] * branches, shared, prompt, written))


def shared_document(branches: int, document: int = 1500, question: int = 30, written: int = 64) -> Scene:
    """ask-many: every branch reads the whole document, then its question and its answer."""
    return Scene(f"ask-many step: {branches} questions over a {document:,}-token document",
                 _branches([document] * branches, document, question, written))


def _branches(reads: list[int], own_start: int, own: int, written: int):
    """[B, N] bool: branch b sees the first reads[b] slots, then its own `own` slots (laid one branch
    after another from `own_start`), the `written` tokens it wrote (interleaved, one step at a time
    for all branches) and this step's own new slot."""
    branches = len(reads)
    start = own_start + branches * own
    n = start + branches * written + branches
    allowed = torch.zeros(branches, n, dtype=torch.bool)
    for b, (read, tokens) in enumerate(zip(reads, _scattered(branches, written, start))):
        allowed[b, :read] = True
        allowed[b, own_start + b * own: own_start + (b + 1) * own] = True
        allowed[b, tokens] = True
        allowed[b, n - branches + b] = True
    return allowed


def scenes() -> list[Scene]:
    return [
        margins_step(1, 8), margins_step(4, 8), margins_step(8, 8), margins_step(4, 16, written=12),
        separate_prompts(8), separate_prompts(32), separate_prompts(64), separate_prompts(16, prompt=120),
        separate_prompts(32, prompt=600), separate_prompts(32, prompt=1200),
        shared_document(8), shared_document(32),
    ]


def measure(scene: Scene, repeats: int) -> dict:
    gather_cost = GATHER_COST_AVX512 if has_avx512() else sa.GATHER_COST

    torch.manual_seed(0)
    allowed = scene.allowed
    m, n = allowed.shape
    mask = torch.zeros(m, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]  # [1, 1, M, N]
    query = torch.randn(1, HEADS, m, DIM)
    keys, values = torch.randn(1, KV_HEADS, n, DIM), torch.randn(1, KV_HEADS, n, DIM)
    scale = DIM ** -0.5
    rows = mask[0, 0].repeat(HEADS // KV_HEADS, 1)
    gathered = sa._gathered(mask, allowed, forced=True)
    prefix = plan_prefixes(mask, allowed, allowed, *bucket_prefixes(allowed, max_buckets=10_000))
    with torch.inference_mode():
        dense_out = _grouped_attention(query, keys, values, rows, scale, KV_HEADS)
        outs = {
            "gathered": sa.grouped_attention(gathered, query, keys, values, gathered.masks, scale),
            "prefix": prefix_attention(prefix, query, keys, values, None, scale),
        }
        runs = {
            "dense": lambda: _grouped_attention(query, keys, values, rows, scale, KV_HEADS),
            "gathered": lambda: sa.grouped_attention(gathered, query, keys, values, gathered.masks, scale),
            "prefix": lambda: prefix_attention(prefix, query, keys, values, None, scale),
        }
        times = {name: 1000 * median_seconds(run, repeats) for name, run in runs.items()}
    chosen = sa.plan_for(mask, gather_cost)
    return {
        "scene": scene.name, "queries": m, "slots": n, "buckets": len(prefix.buckets),
        "work": {"dense": m * n, "gathered": sa.gathered_work(gathered.groups, gathered.group_queries,
                                                              gathered.group_keys, gather_cost),
                 "prefix": prefix.work(gather_cost), "dense_scaled": dense_work(m, n)},
        "ms": times,
        "chosen": "dense" if chosen is None else ("prefix" if isinstance(chosen, PrefixPlan) else "gathered"),
        "largest difference": max(float((out - dense_out).abs().max()) for out in outs.values()),
    }


LAYERS = 30


def step_cases(branches: int, document: int, question: int, written: int) -> dict:
    """Callables, one step's attention each over LAYERS layers of their own cold keys and values."""
    cases = {}
    for m, name in ((1, "1 query"), (branches, f"{branches} branches")):
        allowed = shared_document(m, document, question, written).allowed
        n = allowed.shape[1]
        mask = torch.zeros(m, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
        query = torch.randn(1, HEADS, m, DIM)
        caches = [(torch.randn(1, KV_HEADS, n + 512, DIM)[:, :, :n], torch.randn(1, KV_HEADS, n + 512, DIM)[:, :, :n])
                  for _ in range(LAYERS)]  # views of a longer buffer, as the engine's cache is
        cases[f"{name}, dense"] = _dense_step(query, caches, mask)
        if m > 1:
            cases[f"{name}, the rule's plan"] = _planned_step(query, caches, mask, "auto")
            cases[f"{name}, prefix plan"] = _planned_step(query, caches, mask, "prefix")
    return cases


def _dense_step(query, caches, mask):
    def run():
        rows = None if query.shape[2] == 1 else mask[0, 0].repeat(HEADS // KV_HEADS, 1)
        for keys, values in caches:
            _grouped_attention(query, keys, values, rows, DIM ** -0.5, KV_HEADS)
    return run


def _planned_step(query, caches, mask, mode: str):
    gather_cost = GATHER_COST_AVX512 if has_avx512() else sa.GATHER_COST

    def run():
        plan = sa.plan_for(mask, gather_cost, mode)
        rows = mask[0, 0].repeat(HEADS // KV_HEADS, 1) if plan is None else None  # per step, as the forward
        for keys, values in caches:
            if plan is None:
                _grouped_attention(query, keys, values, rows, DIM ** -0.5, KV_HEADS)
            else:
                plan.attend("bmm", False, "full_attention", query, keys, values, DIM ** -0.5)
    return run


def abba(cases: dict, rounds: int, clock=time.process_time) -> dict:
    """Median and fastest milliseconds of each case, rounds in alternating order, after one untimed
    run of each. clock: process CPU time by default; time.perf_counter (wall time) where cases run
    on several threads, whose CPU time adds up."""
    times = {name: [] for name in cases}
    with torch.inference_mode():
        for run in cases.values():
            run()
        for r in range(rounds):
            for name, run in (cases.items() if r % 2 == 0 else reversed(cases.items())):
                started = clock()
                run()
                times[name].append(clock() - started)
    return {name: (1000 * statistics.median(t), 1000 * min(t)) for name, t in times.items()}


def step_main(args) -> int:
    print(f"# {machine()}; {LAYERS} layers, H={HEADS} G={KV_HEADS} D={DIM}, "
          f"bmm core, {args.rounds} rounds ABBA (process CPU time)\n")
    print(f"ask-many step: {args.branches} branches over a {args.document:,}-token document, "
          f"{args.question}-token questions, {args.written} tokens written each\n")
    print("| case | median ms | fastest ms |")
    print("|---|---:|---:|")
    for name, (median, fastest) in abba(step_cases(args.branches, args.document, args.question, args.written),
                                        args.rounds).items():
        print(f"| {name} | {median:.1f} | {fastest:.1f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--step", action="store_true", help="whole steps' attention, 30 layers (ABBA)")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--document", type=int, default=1800)
    parser.add_argument("--question", type=int, default=25)
    parser.add_argument("--written", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.step:
        return step_main(args)
    print(f"# {machine()}; torch threads {args.threads}; one layer, H={HEADS} G={KV_HEADS} D={DIM}, bmm core, "
          f"median of {args.repeats}\n")
    print("| forest | queries | slots | buckets | dense ms | gathered ms | prefix ms | work gathered / dense "
          "| work prefix / dense | rule picks | fastest | largest difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for scene in scenes():
        r = measure(scene, args.repeats)
        ms, work = r["ms"], r["work"]
        fastest = min(ms, key=ms.get)
        print(f"| {r['scene']} | {r['queries']} | {r['slots']:,} | {r['buckets']} | {ms['dense']:.2f} | "
              f"{ms['gathered']:.2f} | {ms['prefix']:.2f} | {work['gathered'] / work['dense']:.2f} | "
              f"{work['prefix'] / work['dense_scaled']:.2f} | {r['chosen']} | {fastest} | "
              f"{r['largest difference']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
