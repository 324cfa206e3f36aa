#!/usr/bin/env python3
"""ask-many --each against what users run instead, on a folder of short files this script writes.

    OMP_NUM_THREADS=1 python benchmarks/each.py --files 200 --sample 8 --out benchmarks/results/each

Approaches, all on the embedded model, greedy, `--new-tokens` each, the same questions:
  each         one process: `mdcli ask-many DIR --each -q ... -n N --output FILE.jsonl`
  shell-loop   `mdcli ask-many FILE -q ... -n N --jsonl` once per file (one process each), timed on the
               first `--sample` files and scaled to all of them
  generate     one Python process loads transformers' model once and calls generate() once per
               (file, question) on ask-many's own prompt, timed on the same sample and scaled
  workers-K    `--each --workers K` on Ray (with --workers 1,2), the whole folder
Every approach's tokens are compared with --each's on the files it ran: "same tokens" or the count
that differ. Whole processes (imports and load included), one thread per process, each timed two
ways: wall seconds, and the CPU seconds (user + system) the process and its children used, which a
busy shared host inflates far less than the wall. `--rounds R` runs the three approaches R times,
in turns of alternating order (each, shell loop, generate; then generate, shell loop, each; ...),
so a load that comes and goes falls on each alike; the table gives each approach's median round.
Writes <out>.md (the CPU named) and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTIONS = ["Who is the supplier?", "What is the total amount due?", "When is the payment due?"]
WORDS = ("paper ink chairs desks lamps cables screens toner folders pens boxes tape shelves printers keyboards "
         "mice cups kettles filters batteries").split()
CITIES = "Paris Oslo Lima Rome Kyiv Bern Riga Doha Quito Accra Hanoi Perth".split()
NAMES = "Ana Bo Cy Dee Eli Fay Gus Hal Ivo Jun Kai Lea".split()


def write_corpus(folder: Path, files: int, seed: int = 0) -> None:
    """`files` invoices of 200-600 tokens each in the embedded model's tokenizer (the head and foot
    are about 63 tokens, a line item 22-24: 6-21 items; `document_tokens` reports the range), and
    nothing else in `folder`: files of an earlier, larger run are removed."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("invoice*.txt"):
        old.unlink()
    for n in range(files):
        lines = [f"INVOICE {1000 + n}", f"Supplier: {rng.choice(NAMES)} {rng.choice(NAMES)}son Trading Ltd, "
                 f"{rng.choice(CITIES)}", f"Issued: {rng.randint(1, 28)} May 2026. Payment due: {rng.randint(1, 28)} "
                 f"June 2026.", ""]
        for item in range(rng.randint(6, 21)):
            lines.append(f"Line {item + 1}: {rng.randint(1, 40)} x {rng.choice(WORDS)} at {rng.randint(2, 90)}.{rng.randint(0, 99):02d} "
                         f"euros each, delivered to {rng.choice(CITIES)}.")
        lines += ["", f"Total amount due: {rng.randint(300, 9000)}.{rng.randint(0, 99):02d} euros."]
        (folder / f"invoice{n:04d}.txt").write_text("\n".join(lines) + "\n")


def document_tokens(files: list[Path]) -> tuple[int, float, int]:
    """The fewest, mean and most tokens of the files' texts in the embedded model's tokenizer."""
    from mdcli.api import load_tokenizer

    tokenizer = load_tokenizer(quiet=True)
    counts = [len(tokenizer(path.read_text(encoding="utf-8"))["input_ids"]) for path in files]
    return min(counts), statistics.mean(counts), max(counts)


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def children_cpu() -> float:
    """CPU seconds (user + system) of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def questions_args(questions: list[str]) -> list[str]:
    return [arg for q in questions for arg in ("-q", q)]


def run_each(folder: Path, out: Path, questions: list[str], new_tokens: int, extra: list[str]) -> tuple[float, float, dict]:
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "mdcli", "ask-many", str(folder), "--each", *questions_args(questions), "-n",
               str(new_tokens), "--output", str(out), "--quiet", "--prompt-cache", "off", *extra]
    started, cpu = time.perf_counter(), children_cpu()
    subprocess.run(command, check=True, env=env(), stdout=subprocess.DEVNULL)
    seconds, cpu = time.perf_counter() - started, children_cpu() - cpu
    tokens = {(r["document"]["path"], r["question"]): r["token_ids"]
              for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "answer"}
    return seconds, cpu, tokens


def run_shell_loop(files: list[Path], questions: list[str], new_tokens: int) -> tuple[float, float, dict]:
    tokens, started, cpu = {}, time.perf_counter(), children_cpu()
    for path in files:
        command = [sys.executable, "-m", "mdcli", "ask-many", str(path), *questions_args(questions), "-n", str(new_tokens),
                   "--jsonl", "--quiet", "--prompt-cache", "off"]
        result = subprocess.run(command, check=True, env=env(), capture_output=True, text=True)
        for line in result.stdout.splitlines():
            record = json.loads(line)
            if record["type"] == "finish":
                tokens[str(path), record["label"]] = record["token_ids"]
    return time.perf_counter() - started, children_cpu() - cpu, tokens


GENERATE_LOOP = r"""
import json, sys, time
started = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from mdcli.api import AskMany, Document
model_dir, new_tokens, questions, files = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
eos = {tokenizer.eos_token_id} | set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
out = {}
with torch.inference_mode():
    for path in files:
        text = open(path, encoding="utf-8").read()
        specs = AskMany(documents=[Document(path, text)], questions=questions).branches(tokenizer)
        for spec in specs:  # ask-many's own prompt for that question, generate() once
            ids = torch.tensor([spec.prompt_ids])
            new = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, len(spec.prompt_ids):].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            out[path + "\t" + spec.label] = new[:cut]
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": out}))
"""


def run_generate_loop(files: list[Path], questions: list[str], new_tokens: int) -> tuple[float, float, dict]:
    from mdcli.models.embedded import embedded_model_dir

    command = [sys.executable, "-c", GENERATE_LOOP, str(embedded_model_dir()), str(new_tokens), json.dumps(questions),
               *map(str, files)]
    started, cpu = time.perf_counter(), children_cpu()
    result = subprocess.run(command, check=True, env=env(), capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - started, children_cpu() - cpu
    body = json.loads(result.stdout.splitlines()[-1])
    return seconds, cpu, {tuple(key.split("\t")): value for key, value in body["tokens"].items()}


def differing(reference: dict, other: dict) -> int:
    return sum(1 for key, value in other.items() if reference.get(key) != value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--sample", type=int, default=8, help="files the shell loop and the generate loop run")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", default="", help="e.g. 1,2: also --each on Ray with these worker counts")
    parser.add_argument("--budget-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=1, help="turns of the three approaches, order alternating")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mdcli-each-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = args.workdir / "docs"
    write_corpus(folder, args.files)
    files = sorted(folder.glob("*.txt"))
    fewest, mean, most = document_tokens(files)
    sample = files[: args.sample]
    scale = args.files / len(sample)
    extra = [] if args.budget_tokens is None else ["--budget-tokens", str(args.budget_tokens)]
    approaches = {
        "each (one process)": lambda: run_each(folder, args.workdir / "each.jsonl", QUESTIONS, args.new_tokens, extra),
        "shell loop of ask-many": lambda: run_shell_loop(sample, QUESTIONS, args.new_tokens),
        "Python loop of generate()": lambda: run_generate_loop(sample, QUESTIONS, args.new_tokens),
    }
    scaled = {"each (one process)": 1.0, "shell loop of ask-many": scale, "Python loop of generate()": scale}
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in approaches}
    tokens: dict[str, dict] = {}
    for turn in range(args.rounds):
        for name in (list(approaches) if turn % 2 == 0 else list(reversed(approaches))):
            seconds, cpu, got = approaches[name]()
            rounds[name].append((seconds * scaled[name], cpu * scaled[name]))
            tokens[name] = got
            print(f"round {turn + 1}: {name}: {seconds:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr, flush=True)
    reference = tokens["each (one process)"]
    base_wall = statistics.median(w for w, _ in rounds["each (one process)"])
    base_cpu = statistics.median(c for _, c in rounds["each (one process)"])
    report = {"files": args.files, "sample": args.sample, "new_tokens": args.new_tokens, "questions": QUESTIONS,
              "cpu": cpu_name(), "rounds": args.rounds, "document_tokens": [fewest, round(mean, 1), most],
              "runs": {}}
    lines = [f"# ask-many --each: {args.files} files, {len(QUESTIONS)} questions, {args.new_tokens} new tokens", "",
             f"Documents of {fewest}-{most} tokens (mean {mean:.0f}). "
             f"CPU: {report['cpu']}; one thread per process (OMP_NUM_THREADS=1); whole processes; {args.rounds} "
             "round(s), order alternating; each cell the median round (every round in the JSON).", "",
             "| approach | wall s | vs --each | CPU s | vs --each | how | tokens |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, measured in rounds.items():
        wall, cpu = statistics.median(w for w, _ in measured), statistics.median(c for _, c in measured)
        how = "measured" if scaled[name] == 1.0 else f"{len(sample)} files a round, scaled to {args.files}"
        same = "reference" if name == "each (one process)" else (
            f"{differing(reference, tokens[name])} of {len(tokens[name])} answers differ")
        lines.append(f"| {name} | {wall:.1f} | {wall / base_wall:.2f}x | {cpu:.1f} | {cpu / base_cpu:.2f}x | {how} | {same} |")
        report["runs"][name] = {"wall_seconds": [w for w, _ in measured], "cpu_seconds": [c for _, c in measured],
                                "how": how, "tokens": same}
    for workers in [int(w) for w in args.workers.split(",") if w]:
        seconds, _, got = run_each(folder, args.workdir / f"workers{workers}.jsonl", QUESTIONS, args.new_tokens,
                                   [*extra, "--workers", str(workers)])  # Ray's actors are not our children: wall only
        same = f"{differing(reference, got)} of {len(got)} answers differ"
        lines.append(f"| each --workers {workers} | {seconds:.1f} | {seconds / base_wall:.2f}x | | | measured once | {same} |")
        report["runs"][f"each --workers {workers}"] = {"wall_seconds": [seconds], "how": "measured once", "tokens": same}
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = {k.strip(): v for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
        return (f"{fields['model name'].strip()}, family {fields['cpu family'].strip()}, model {fields['model'].strip()}, "
                f"{os.cpu_count()} cores")
    except (OSError, KeyError):
        return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
