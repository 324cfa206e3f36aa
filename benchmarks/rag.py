#!/usr/bin/env python3
"""Retrieval over a folder, side by side: 8 questions, --retrieve 4, the forest against `generate`.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/rag.py --repeats 2 --new-tokens 32 --out benchmarks/results/rag

The corpus is written by this script (deterministic): 12 plain-text field reports about as many
sites, together over 20,000 tokens of the embedded model, into a temporary folder. The 8 questions
each name a site, a week and a quantity, two questions per site for four of the sites. Every question's prompt is built exactly as `mdcli ask-many DIR -q
... --retrieve 4` builds it (strategies.ask_many.AskMany: BM25 over chunks of 256 tokens, the 4
best laid out in corpus order, each under its `[n] path:lines` tag), and all approaches get those
same prompts and generate exactly N greedy tokens per question (EOS suppressed), so the work is
equal; every run checks that the tokens agree with the forest's.

    forest      mdcli's run over one shared cache (run_specs; radix prefill of the prompts)
    sequential  `model.generate` once per question
    batched     one `model.generate` over the left-padded prompts

In process, one torch thread (torch.set_num_threads(1)); the model load and the retrieval are
outside the timed region (retrieval for 8 questions takes milliseconds: reported separately).
Repeats alternate the order (forest first, then last), and each ratio is the median over repeats
of the paired ratio. Also reported: the prompts' tokens and how many of them the forest prefilled
(the shared share is what retrieval in corpus order buys). Writes <out>.md and <out>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from mdcli.api import AskMany, load_model, read_inputs, run_specs
from mdcli.backends.host import has_avx512
from mdcli.bench.ask import Case, batched, forest, sequential
from mdcli.core.decoding import BranchSpec
from mdcli.events import Done

SITES = ["Aldermoor", "Brackwater", "Corrin Fell", "Dunmere", "Eskdale", "Fairhollow", "Glenross", "Harrowgate",
         "Inverbeck", "Juniper Point", "Kestrel Bay", "Larkspur"]
MEASURES = ["rainfall", "river level", "soil temperature", "wind speed", "bird count", "visitor count",
            "water clarity", "snow depth", "pollen count", "seedling survival"]
QUESTIONS = [  # two about each of four sites, as questions about a folder tend to cluster
    "What rainfall was recorded at Brackwater in week 7?",
    "What was the river level at Brackwater in week 12?",
    "How many birds were counted at Eskdale in week 12?",
    "What was the soil temperature at Eskdale in week 3?",
    "What wind speed was measured at Kestrel Bay in week 9?",
    "How many visitors came to Kestrel Bay in week 15?",
    "What was the snow depth at Inverbeck in week 5?",
    "What was the pollen count at Inverbeck in week 2?",
]


def write_corpus(folder: Path, weeks: int = 20) -> None:
    """Twelve field reports, one per site: a paragraph per week, each measure with its number."""
    rng = random.Random(33)
    for site in SITES:
        lines = [f"Field report: {site}", ""]
        for week in range(1, weeks + 1):
            facts = [f"the {measure} was {rng.randint(2, 990)}" for measure in rng.sample(MEASURES, 6)]
            weather = rng.choice(["dry and bright", "wet and windy", "overcast", "cold with frost", "mild"])
            lines.append(f"Week {week} at {site}. The weather was {weather}. During the week " + ", ".join(facts) + ".")
            lines.append(f"The team at {site} logged these readings on the {rng.choice(['north', 'south', 'east'])} "
                         f"transect and checked the instruments before leaving.")
            lines.append("")
        (folder / f"{site.lower().replace(' ', '-')}.txt").write_text("\n".join(lines))


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--retrieve", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(quiet=True)
    with tempfile.TemporaryDirectory() as folder:
        write_corpus(Path(folder))
        documents = read_inputs([folder]).documents
        corpus_tokens = sum(len(model.tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in documents)
        started = time.perf_counter()
        job = AskMany(documents=documents, questions=QUESTIONS, retrieve=args.retrieve, max_new_tokens=args.new_tokens)
        specs = job.branches(model.tokenizer, model.context_length)
        retrieval_seconds = time.perf_counter() - started
    prompts = [spec.prompt_ids for spec in specs]
    case = Case(branches=len(prompts), context_tokens=0, new_tokens=args.new_tokens)
    cited = [sorted({Path(s.path).name for s in spec.sources}) for spec in specs]
    prompt_tokens, prefilled = prefill_share(model, prompts)
    runners = {"forest": lambda: forest(model, prompts, case, reference=False),
               "sequential": lambda: sequential(model, prompts, case),
               "batched": lambda: batched(model, prompts, case)}
    forest(model, prompts[:2], Case(2, 0, 2), reference=False)  # warm-up, untimed
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    same_tokens = True
    for repeat in range(args.repeats):
        order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
        measured = {name: runners[name]() for name in order}
        same_tokens &= all(m.tokens == measured["forest"].tokens for m in measured.values())
        for name, measurement in measured.items():
            seconds[name].append(measurement.seconds)
            print(f"repeat {repeat + 1} {name}: {measurement.seconds:.2f} s", flush=True)
    ratios = {name: statistics.median(s / f for s, f in zip(seconds[name], seconds["forest"])) for name in runners}
    report = {
        "date": _dt.date.today().isoformat(), "cpu": cpu_name(), "avx512": has_avx512(),
        "threads": torch.get_num_threads(), "model": model.name, "files": len(documents),
        "corpus_tokens": corpus_tokens, "questions": len(prompts), "retrieve": args.retrieve,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "retrieval_seconds": round(retrieval_seconds, 3),
        "prompt_tokens": prompt_tokens, "prefilled_tokens": prefilled, "same_tokens": same_tokens,
        "seconds": seconds, "ratio_to_forest": ratios, "sources": dict(zip(QUESTIONS, cited)),
    }
    markdown = render(report)
    print(markdown)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown)


def prefill_share(model, prompts: list[list[int]]) -> tuple[int, int]:
    """(all prompts' tokens, tokens the forest prefilled): one run, one new token per question."""
    specs = [BranchSpec(label=str(i), prompt_ids=p, max_new_tokens=1) for i, p in enumerate(prompts)]
    stats = next(e for e in run_specs(model, specs, strategy="bench") if isinstance(e, Done)).stats
    return stats.prompt_tokens, stats.prefill_tokens


def render(r: dict) -> str:
    median = {name: statistics.median(values) for name, values in r["seconds"].items()}
    shared = 1 - r["prefilled_tokens"] / r["prompt_tokens"]
    return "\n".join([
        f"# RAG: {r['questions']} questions, --retrieve {r['retrieve']}, {r['new_tokens']} new tokens",
        "",
        f"{r['date']} · {r['cpu']} · AVX-512 {'yes' if r['avx512'] else 'no'} · {r['threads']} thread · "
        f"{r['model']} · in process, model load and retrieval ({r['retrieval_seconds']} s) not timed · "
        f"{r['repeats']} repeats, alternating order",
        "",
        f"Corpus: {r['files']} files, {r['corpus_tokens']:,} tokens. Prompts: {r['prompt_tokens']:,} tokens, "
        f"{r['prefilled_tokens']:,} prefilled by the forest ({shared:.0%} of prompt tokens shared, prefilled once).",
        "",
        "| approach | median seconds | ratio to forest (median of pairs) |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {median[name]:.2f} | {r['ratio_to_forest'][name]:.2f}x |" for name in r["seconds"]),
        "",
        f"Same tokens in every approach: {'yes' if r['same_tokens'] else 'NO'}.",
        "",
    ])


if __name__ == "__main__":
    main()
