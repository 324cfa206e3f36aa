"""Benchmark of `mdcli think`: 8 paths x 128 tokens from a ~300-token question, on CPU.

    python -m mdcli.bench.think [--model M] [--paths 8] [--new-tokens 128] [--threads 1]

Side by side, in one process, same sampling settings (temperature 0.8, top-p 0.9):

* mdcli think, the paths stage: every path decodes in one shared cache (question prefilled once);
* `model.generate(num_return_sequences=8, do_sample=True, min_new_tokens=N, max_new_tokens=N)`:
  a padded batch of 8 copies of the question;
* 8 sequential `model.generate` calls.

With sampling the tokens differ between methods, so every method is forced to the same length: HF
by min_new_tokens, mdcli by a model whose EOS set is empty (a bench-only stand-in for an ignore-EOS
option). Then the cost of each merge: reencode (exact: the paths' texts are fed as new tokens) vs
attend (approximate: only the merge prompt is fed). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass, replace

import torch
import transformers

from mdcli.bench import BASELINE_KERNELS, BASELINE_KERNELS_HELP
from mdcli.bench.harness import baseline_kernels, kernels_line
from mdcli.bench.twin import float32_twin
from mdcli.core.sampling import SamplingParams
from mdcli.events import Finish, Fork, Note, Token
from mdcli.models.load import load_model
from mdcli.strategies.think import Think, run_think

QUESTION = (
    "Two trains run on the same straight line between the cities of Aster and Borel, which are 420 "
    "kilometres apart. The first train leaves Aster at 9:00 in the morning travelling towards Borel at a "
    "steady 80 kilometres per hour. It stops for exactly 15 minutes at the town of Cedar, which lies 160 "
    "kilometres from Aster, and then continues at the same speed. The second train leaves Borel at 9:30 "
    "travelling towards Aster at 100 kilometres per hour, without stopping. A freight train also leaves "
    "Cedar at 10:00 heading towards Borel at 60 kilometres per hour, but it uses a parallel track and does "
    "not interfere with the others. The weather is clear, the tracks are level, and all clocks in both "
    "cities show the same time. The station master at Aster wants to publish a timetable that shows, to "
    "the nearest minute, when and where the two passenger trains pass each other, how far each has "
    "travelled at that moment, and whether the freight train has already passed Cedar's signal box, which "
    "is 5 kilometres past the station. She also wants to know which passenger train reaches its "
    "destination first, and by how many minutes, assuming that neither train slows down when they pass "
    "and that the first train's stop at Cedar is the only stop on the whole line. Finally, she asks what "
    "would change if the second train left fifteen minutes later, at 9:45, instead. Work out the meeting "
    "time and place, both arrival times, and the answer for the later departure."
)
TEMPERATURE = 0.8
TOP_P = 0.9
SEED = 0


@dataclass
class Timing:
    label: str
    seconds: float
    tokens: int


@dataclass
class MergeCost:
    mode: str
    fed_tokens: int
    merge_seconds: float  # last path finished -> first conclusion token
    conclusion_seconds: float  # last path finished -> conclusion finished
    conclusion_tokens: int


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu", dtype="float32", quiet=True)
    ignore_eos = replace(lm, eos_token_ids=frozenset())  # equal work: every path runs to its limit
    prompt = _path_prompt(lm)
    load_before = os.getloadavg()
    _warm_up(lm, prompt)

    reencode_timing, reencode_cost = _time_think(ignore_eos, args, merge="reencode")
    attend_timing, attend_cost = _time_think(ignore_eos, args, merge="attend")
    greedy_timing, _ = _time_think(ignore_eos, args, merge="none", greedy=True)
    with baseline_kernels(lm, args.baseline_kernels):
        batched = _time_generate_batch(lm, prompt, args)
        sequential = _time_generate_sequential(lm, prompt, args)
    load_after = os.getloadavg()

    print(_environment(lm, args, len(prompt), load_before, load_after))
    print()
    print(_speed_table([reencode_timing, attend_timing, greedy_timing, batched, sequential], reference=reencode_timing))
    print()
    print(_merge_table([reencode_cost, attend_cost], args))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.think", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--paths", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--conclusion-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline-kernels", choices=BASELINE_KERNELS, default="stock", help=BASELINE_KERNELS_HELP)
    return parser.parse_args(argv)


def _job(args, *, merge: str, greedy: bool = False):
    sampling = SamplingParams() if greedy else SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=SEED)
    return Think(
        question=QUESTION,
        paths=args.paths,
        merge=merge,
        sampling=sampling,
        max_new_tokens=args.new_tokens,
        conclusion_tokens=args.conclusion_tokens,
    )


def _path_prompt(lm) -> list[int]:
    """The prompt every path reads (no per-path instructions): what HF generate gets too."""
    return _job(argparse.Namespace(paths=1, new_tokens=1, conclusion_tokens=1), merge="none").path_prompt_ids(
        lm.tokenizer, 0
    )


def _warm_up(lm, prompt: list[int]) -> None:
    with torch.inference_mode():
        float32_twin(lm).model.generate(torch.tensor([prompt[:32]]), max_new_tokens=2, do_sample=False)


def _time_think(lm, args, *, merge: str, greedy: bool = False) -> tuple[Timing, MergeCost | None]:
    """One think run; the paths stage ends when the last path finishes."""
    job = _job(args, merge=merge, greedy=greedy)
    job.validate()
    started = time.perf_counter()
    paths_done = first_conclusion = conclusion_done = None
    path_tokens = conclusion_tokens = fed = 0
    conclusion_id = None
    for event in run_think(lm, job):
        now = time.perf_counter()
        if isinstance(event, Fork) and event.branch.label.startswith("conclusion"):
            conclusion_id = event.branch.id
        elif isinstance(event, Token) and event.branch == conclusion_id and first_conclusion is None:
            first_conclusion = now
        elif isinstance(event, Finish) and event.branch == conclusion_id:
            conclusion_done, conclusion_tokens = now, len(event.token_ids)
        elif isinstance(event, Finish):
            paths_done, path_tokens = now, path_tokens + len(event.token_ids)
        elif isinstance(event, Note) and "fed_tokens" in event.data:
            fed = event.data["fed_tokens"]
    kind = "greedy" if greedy else "sampled"
    label = f"mdcli think, paths stage ({kind}; run with --merge {merge})"
    timing = Timing(label, paths_done - started, path_tokens)
    if conclusion_id is None:
        return timing, None
    cost = MergeCost(merge, fed, first_conclusion - paths_done, conclusion_done - paths_done, conclusion_tokens)
    return timing, cost


def _time_generate_batch(lm, prompt: list[int], args) -> Timing:
    started = time.perf_counter()
    torch.manual_seed(SEED)
    out = _generate_sampled(lm, prompt, args, num_return_sequences=args.paths)
    seconds = time.perf_counter() - started
    return Timing(f"HF generate(num_return_sequences={args.paths})", seconds, out[:, len(prompt):].numel())


def _time_generate_sequential(lm, prompt: list[int], args) -> Timing:
    started = time.perf_counter()
    tokens = 0
    torch.manual_seed(SEED)
    for _ in range(args.paths):
        out = _generate_sampled(lm, prompt, args)
        tokens += out.shape[1] - len(prompt)
    return Timing(f"HF generate, {args.paths} sequential calls", time.perf_counter() - started, tokens)


def _generate_sampled(lm, prompt: list[int], args, **extra):
    """HF `generate` with the bench's sampling settings and exactly `args.new_tokens` new tokens."""
    with torch.inference_mode():
        return float32_twin(lm).model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            min_new_tokens=args.new_tokens,
            max_new_tokens=args.new_tokens,
            **extra,
        )


def _environment(lm, args, prompt_tokens: int, load_before, load_after) -> str:
    lines = [
        (
            f"- command: `python -m mdcli.bench.think --paths {args.paths} --new-tokens {args.new_tokens} "
            f"--conclusion-tokens {args.conclusion_tokens} --threads {args.threads} "
            f"--baseline-kernels {args.baseline_kernels}`"
        ),
        f"- {kernels_line(lm, args.baseline_kernels)}",
        (
            f"- model: {lm.name}, {str(lm.dtype).removeprefix('torch.')}, {lm.attn}, CPU, "
            f"torch.set_num_threads({args.threads})"
        ),
        f"- machine: {_cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        (
            f"- versions: Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}"
        ),
        (
            f"- question: {prompt_tokens} tokens (chat-templated); {args.paths} paths x {args.new_tokens} tokens, "
            f"temperature {TEMPERATURE}, top-p {TOP_P}, EOS ignored so every method does equal work"
        ),
        (
            f"- load average before / after: {load_before[0]:.1f} / {load_after[0]:.1f} "
            "(other processes share this machine: compare ratios, not absolute times)"
        ),
    ]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _speed_table(rows: list[Timing], *, reference: Timing) -> str:
    lines = [
        "| method | wall time (s) | tokens | tokens/s | time vs mdcli think |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.label} | {row.seconds:.1f} | {row.tokens} | {row.tokens / row.seconds:.1f} | "
            f"{row.seconds / reference.seconds:.2f}x |"
        )
    return "\n".join(lines)


def _merge_table(costs: list[MergeCost | None], args) -> str:
    header = (
        f"| merge ({args.paths} paths x {args.new_tokens} tokens) | new tokens fed | paths done -> first "
        f"conclusion token (s) | paths done -> conclusion of {args.conclusion_tokens} tokens (s) |"
    )
    lines = [header, "|---|---:|---:|---:|"]
    for cost in costs:
        if cost is None:
            continue
        exactness = "exact" if cost.mode == "reencode" else "approximate"
        lines.append(
            f"| {cost.mode} ({exactness}) | {cost.fed_tokens} | {cost.merge_seconds:.2f} | "
            f"{cost.conclusion_seconds:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
