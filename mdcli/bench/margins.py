"""Benchmark: the margins stage of `mdcli margins` against the paper's sequential algorithm.

    python -m mdcli.bench.margins                      # ~4,000-token report, 8 segments, 48-token margins
    python -m mdcli.bench.margins --sweep 256,512,1024,2048   # how the segment size changes time and recall
    python -m mdcli.bench.margins --questions 4        # whole stage, 4 questions in one forest vs 4 runs
                                                       # (see mdcli/bench/margins_questions.py)

Both sides run the same model on the same margin prompts (token ids built by
strategies.margins, chain layout), greedy, fp32, CPU, `torch.set_num_threads(1)`:

* mdcli: one Decoder phase: the radix prefill stores the document once plus one instruction per
  margin, then every margin decodes in the same forward, one token per margin per step.
* sequential, as the paper's code (writer/writing-in-the-margins) does it with plain transformers
  calls: ONE growing DynamicCache; for each segment, feed the new tokens of its margin prompt,
  generate the margin greedily token by token, then crop the cache back to the end of the segment
  (the longest prefix the next prompt shares) and read on.

The margins must be identical token for token; the script says so and exits 1 if not.
The sweep runs only mdcli (chain layout, or `--layout independent`) and reports, per segment
size, the segments, the cache tokens, the time and how many planted facts ("Project X went over
budget because Y") a single margin recovers (name and reason in the same margin).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache

from mdcli.backends.host import cpu_line
from mdcli.backends.reference import cache_argument
from mdcli.bench import BASELINE_KERNELS, BASELINE_KERNELS_HELP
from mdcli.bench.harness import baseline_kernels, kernels_line
from mdcli.bench.margins_questions import compare_questions
from mdcli.bench.twin import float32_twin
from mdcli.core.decoding import common_prefix_length
from mdcli.events import Finish
from mdcli.models.load import load_model
from mdcli.strategies.margins import Margins, new_decoder
from mdcli.strategies.segmenting import split_text, token_counter

OVER_BUDGET = [
    ("Falcon", "steel prices rose", "steel"),
    ("Osprey", "the vendor charged for extra training days", "training"),
    ("Kestrel", "asbestos was found in the walls", "asbestos"),
    ("Condor", "the contractor went bankrupt", "bankrupt"),
]
ON_BUDGET = ["Heron", "Swift", "Plover", "Egret", "Lark", "Wren", "Finch", "Tern"]
QUERY = "Which projects went over budget, and why?"
_WORKS = [
    "built a new loading dock for the warehouse", "upgraded the office network", "replaced the payroll software",
    "renovated the third floor", "moved the archive to a new building", "installed solar panels on the roof",
    "rebuilt the customer portal", "trained the sales team on the new catalogue",
]
_FILLER = [
    "The team met every Monday to review progress and agree on the next steps.",
    "Several colleagues from other departments helped during the busiest weeks.",
    "A short survey after the work showed that most staff were satisfied with the result.",
    "The work was planned in three phases so that daily operations were never interrupted.",
    "Documentation was written for the people who will maintain the result in the coming years.",
    "The steering committee approved the final report at its quarterly meeting.",
    "Lessons learned were collected in a shared folder for future projects.",
    "Suppliers were selected through the usual tender process with three competing offers.",
]
_OTHER_NEWS = [
    "The cafeteria introduced a new menu with more vegetarian dishes, and the queue at lunch time got shorter.",
    "The human resources team organised a training day on workplace safety for all new employees.",
    "The annual summer party took place in the park next to the office, with music and a barbecue.",
    "Facilities replaced the old coffee machines on every floor after many complaints about the taste.",
    "The library added two hundred new books and a quiet room for reading during breaks.",
    "A new parking policy gives priority to car pools and to colleagues who cycle to work.",
]


def project_paragraph(rng: random.Random, name: str, reason: str | None) -> str:
    budget = rng.randrange(80, 400) * 1000
    work = rng.choice(_WORKS)
    if reason is None:
        outcome = f"It finished on time and under budget, spending {budget - rng.randrange(5, 30) * 1000:,} dollars."
    else:
        outcome = f"It went over budget by {rng.randrange(10, 90) * 1000:,} dollars because {reason}."
    filler = " ".join(rng.sample(_FILLER, 3))
    return f"Project {name} {work}. Its budget was {budget:,} dollars. {outcome} {filler}"


def bench_document(tokenizer, target_tokens: int, seed: int = 0) -> str:
    """A synthetic quarterly report of about `target_tokens` tokens: project paragraphs (four of
    them over budget, for a reason) between paragraphs of unrelated office news."""
    rng = random.Random(seed)
    facts = list(OVER_BUDGET)
    paragraphs: list[str] = ["Quarterly report of the projects office."]
    index = 0
    while len(tokenizer("\n\n".join(paragraphs), add_special_tokens=False)["input_ids"]) < target_tokens:
        if index % 3 == 2:
            paragraphs.append(" ".join(rng.sample(_OTHER_NEWS, 3)))
        elif facts and index % 5 == 1:
            name, reason, _ = facts.pop(0)
            paragraphs.append(project_paragraph(rng, name, reason))
        else:
            paragraphs.append(project_paragraph(rng, ON_BUDGET[index % len(ON_BUDGET)], None))
        index += 1
    return "\n\n".join(paragraphs) + "\n"


@dataclass
class SideResult:
    margins: list[list[int]]
    seconds: float
    prefill_seconds: float
    generate_seconds: float
    prefill_tokens: int


def run_mdcli(lm, specs) -> SideResult:
    """The margins stage as `mdcli margins` runs it: one Decoder phase over one shared cache."""
    decoder = new_decoder(lm)
    started = time.perf_counter()
    infos = decoder.announce(specs)
    finishes = {e.branch: e.token_ids for e in decoder.decode() if isinstance(e, Finish)}
    seconds = time.perf_counter() - started
    stats = decoder.stats(seconds)
    return SideResult(
        margins=[finishes[info.id] for info in infos],
        seconds=seconds,
        prefill_seconds=stats.prefill_seconds,
        generate_seconds=stats.decode_seconds,
        prefill_tokens=stats.prefill_tokens,
    )


def run_sequential(lm, prompts: list[list[int]], margin_tokens: int, chunk: int = 1024) -> SideResult:
    """The paper's algorithm with plain transformers calls: one growing cache, rolled back to the
    end of each segment after its margin is generated."""
    model, eos = float32_twin(lm).model, lm.eos_token_ids
    cache, cached, prefilled = DynamicCache(), 0, 0
    margins: list[list[int]] = []
    prefill_seconds = generate_seconds = 0.0
    started = time.perf_counter()
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            logits = None
            for start in range(cached, len(prompt), chunk):
                piece = torch.tensor([prompt[start : start + chunk]])
                logits = model(input_ids=piece, **cache_argument(model, cache), use_cache=True,
                               logits_to_keep=1).logits[0, -1]
            prefilled += len(prompt) - cached
            t1 = time.perf_counter()
            margin: list[int] = []
            while True:
                token = int(logits.argmax())
                margin.append(token)
                if token in eos or len(margin) >= margin_tokens:
                    break
                logits = model(input_ids=torch.tensor([[token]]), **cache_argument(model, cache),
                               use_cache=True).logits[0, -1]
            margins.append(margin)
            generate_seconds += time.perf_counter() - t1
            prefill_seconds += t1 - t0
            if i + 1 < len(prompts):  # roll back to the end of the segment: what the next prompt shares
                cached = common_prefix_length(prompt, prompts[i + 1])
                cache.crop(cached - cache.get_seq_length())  # transformers 5: minus the tokens to drop
    return SideResult(margins, time.perf_counter() - started, prefill_seconds, generate_seconds, prefilled)


def segment_budget_for(tokenizer, document: str, segments: int) -> int:
    """The smallest --segment-tokens (in steps of 8) that cuts the document into `segments`."""
    count = token_counter(tokenizer)
    budget = max(16, math.ceil(count(document) / segments))
    while len(split_text(document, budget, count)) > segments:
        budget += 8
    return budget


def margin_specs(lm, document: str, segment_tokens: int, margin_tokens: int, layout: str = "chain"):
    job = Margins(
        documents=[document], query=QUERY, segment_tokens=segment_tokens, margin_tokens=margin_tokens,
        layout=layout,  # type: ignore[arg-type]
    )
    segments = job.segments(lm.tokenizer)
    return segments, job.margin_specs(lm.tokenizer, segments)


def compare(lm, document: str, segments: int, margin_tokens: int, repeats: int, kernels: str = "stock") -> bool:
    budget = segment_budget_for(lm.tokenizer, document, segments)
    segs, specs = margin_specs(lm, document, budget, margin_tokens)
    prompts = [s.prompt_ids for s in specs]
    ours = min((run_mdcli(lm, specs) for _ in range(repeats)), key=lambda r: r.seconds)
    with baseline_kernels(lm, kernels):
        theirs = min((run_sequential(lm, prompts, margin_tokens) for _ in range(repeats)), key=lambda r: r.seconds)
    same = sum(a == b for a, b in zip(ours.margins, theirs.margins))
    doc_tokens = sum(s.tokens for s in segs)
    print(f"document: {doc_tokens:,} tokens in {len(segs)} segments (--segment-tokens {budget}); "
          f"margins of at most {margin_tokens} tokens; best of {repeats}\n")
    print("| margins stage | mdcli (all margins at once) | sequential (paper) | speedup |")
    print("| --- | ---: | ---: | ---: |")
    for name, a, b in [
        ("total, s", ours.seconds, theirs.seconds),
        ("prefill, s", ours.prefill_seconds, theirs.prefill_seconds),
        ("generation, s", ours.generate_seconds, theirs.generate_seconds),
    ]:
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    generated = sum(len(m) for m in ours.margins)
    print(f"| tokens prefilled | {ours.prefill_tokens:,} | {theirs.prefill_tokens:,} | |")
    print(f"| margin tokens generated | {generated:,} | {sum(len(m) for m in theirs.margins):,} | |")
    print(f"| margins identical | {same}/{len(prompts)} | | |")
    return same == len(prompts)


def sweep(lm, document: str, sizes: list[int], margin_tokens: int, layout: str) -> None:
    print(f"query: {QUERY!r}; {len(OVER_BUDGET)} planted facts; {layout} layout; "
          f"margins of at most {margin_tokens} tokens\n")
    print("| --segment-tokens | segments | cache tokens | margins stage, s | facts found | margins cut at the limit |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        segs, specs = margin_specs(lm, document, size, margin_tokens, layout)
        result = run_mdcli(lm, specs)
        texts = [lm.tokenizer.decode(m, skip_special_tokens=True) for m in result.margins]
        found = sum(any(name in t and keyword in t for t in texts) for name, _, keyword in OVER_BUDGET)
        cut = sum(len(m) >= margin_tokens for m in result.margins)
        print(f"| {size} | {len(segs)} | {result.prefill_tokens:,} | {result.seconds:.1f} | "
              f"{found}/{len(OVER_BUDGET)} | {cut}/{len(segs)} |")


def machine() -> str:


    return (f"{cpu_line()}, nproc {os.cpu_count()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, torch threads {torch.get_num_threads()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.margins", description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--margin-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sweep", type=str, default=None, help="comma-separated --segment-tokens values")
    parser.add_argument("--layout", choices=["chain", "independent"], default="chain", help="for --sweep")
    parser.add_argument("--questions", type=int, default=None,
                        help="whole stage with this many questions in one forest vs one run per question")
    parser.add_argument("--processes", action="store_true",
                        help="with --questions: also time one whole `mdcli margins` process per question")
    parser.add_argument("--rules-first", action="store_true",
                        help="with --questions: an experimental classifier prompt with its rules first (shared)")
    parser.add_argument("--classify-tokens", type=int, default=24, help="with --questions")
    parser.add_argument("--answer-tokens", type=int, default=256, help="with --questions")
    parser.add_argument("--speculate", default="off",
                        help="with --questions: both sides' speculative decoding, auto | off | N (default off; "
                        "`mdcli margins` defaults to auto)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="with --questions: skip the untimed one-question stage run before both sides")
    parser.add_argument("--model", type=str, default=None)
    parser.add_argument("--baseline-kernels", choices=BASELINE_KERNELS, default="stock", help=BASELINE_KERNELS_HELP)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="float32", device="cpu", quiet=True)
    document = bench_document(lm.tokenizer, args.doc_tokens)
    print(f"model: {lm.name}, fp32, greedy; machine: {machine()}; {kernels_line(lm, args.baseline_kernels)}\n")
    if args.questions:
        budget = segment_budget_for(lm.tokenizer, document, args.segments)
        limits = {"margin_tokens": args.margin_tokens, "classify_tokens": args.classify_tokens,
                  "answer_tokens": args.answer_tokens}
        print(f"document: {args.doc_tokens:,}-token report in {args.segments} segments (--segment-tokens {budget}); "
              f"margins <= {args.margin_tokens}, classifications <= {args.classify_tokens}, "
              f"answers <= {args.answer_tokens} tokens\n")
        ok = compare_questions(lm, document, args.questions, budget, limits, processes=args.processes,
                               model=args.model, rules_first=args.rules_first, speculate=args.speculate,
                               warmup=not args.no_warmup)
        return 0 if ok else 1
    if args.sweep:
        sweep(lm, document, [int(s) for s in args.sweep.split(",")], args.margin_tokens, args.layout)
        return 0
    same = compare(lm, document, args.segments, args.margin_tokens, args.repeats, args.baseline_kernels)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
