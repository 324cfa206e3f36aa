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
that differ. Whole-process wall times (imports and load included), one thread per process.
Writes <out>.md (the CPU named) and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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
    """`files` invoices of about 200-600 tokens each (a line item is ~14 tokens)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(files):
        lines = [f"INVOICE {1000 + n}", f"Supplier: {rng.choice(NAMES)} {rng.choice(NAMES)}son Trading Ltd, "
                 f"{rng.choice(CITIES)}", f"Issued: {rng.randint(1, 28)} May 2026. Payment due: {rng.randint(1, 28)} "
                 f"June 2026.", ""]
        for item in range(rng.randint(12, 40)):
            lines.append(f"Line {item + 1}: {rng.randint(1, 40)} x {rng.choice(WORDS)} at {rng.randint(2, 90)}.{rng.randint(0, 99):02d} "
                         f"euros each, delivered to {rng.choice(CITIES)}.")
        lines += ["", f"Total amount due: {rng.randint(300, 9000)}.{rng.randint(0, 99):02d} euros."]
        (folder / f"invoice{n:04d}.txt").write_text("\n".join(lines) + "\n")


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def questions_args(questions: list[str]) -> list[str]:
    return [arg for q in questions for arg in ("-q", q)]


def run_each(folder: Path, out: Path, questions: list[str], new_tokens: int, extra: list[str]) -> tuple[float, dict]:
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "mdcli", "ask-many", str(folder), "--each", *questions_args(questions), "-n",
               str(new_tokens), "--output", str(out), "--quiet", "--prompt-cache", "off", *extra]
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env(), stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    tokens = {(r["document"]["path"], r["question"]): r["token_ids"]
              for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "answer"}
    return seconds, tokens


def run_shell_loop(files: list[Path], questions: list[str], new_tokens: int) -> tuple[float, dict]:
    tokens, started = {}, time.perf_counter()
    for path in files:
        command = [sys.executable, "-m", "mdcli", "ask-many", str(path), *questions_args(questions), "-n", str(new_tokens),
                   "--jsonl", "--quiet", "--prompt-cache", "off"]
        result = subprocess.run(command, check=True, env=env(), capture_output=True, text=True)
        for line in result.stdout.splitlines():
            record = json.loads(line)
            if record["type"] == "finish":
                tokens[str(path), record["label"]] = record["token_ids"]
    return time.perf_counter() - started, tokens


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


def run_generate_loop(files: list[Path], questions: list[str], new_tokens: int) -> tuple[float, dict]:
    from mdcli.models.embedded import embedded_model_dir

    command = [sys.executable, "-c", GENERATE_LOOP, str(embedded_model_dir()), str(new_tokens), json.dumps(questions),
               *map(str, files)]
    started = time.perf_counter()
    result = subprocess.run(command, check=True, env=env(), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    body = json.loads(result.stdout.splitlines()[-1])
    return seconds, {tuple(key.split("\t")): value for key, value in body["tokens"].items()}


def differing(reference: dict, other: dict) -> int:
    return sum(1 for key, value in other.items() if reference.get(key) != value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--sample", type=int, default=8, help="files the shell loop and the generate loop run")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workers", default="", help="e.g. 1,2: also --each on Ray with these worker counts")
    parser.add_argument("--budget-tokens", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mdcli-each-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    folder = args.workdir / "docs"
    write_corpus(folder, args.files)
    files = sorted(folder.glob("*.txt"))
    sample = files[: args.sample]
    extra = [] if args.budget_tokens is None else ["--budget-tokens", str(args.budget_tokens)]
    rows, report = [], {"files": args.files, "sample": args.sample, "new_tokens": args.new_tokens,
                        "questions": QUESTIONS, "cpu": cpu_name(), "runs": {}}

    each_seconds, each_tokens = run_each(folder, args.workdir / "each.jsonl", QUESTIONS, args.new_tokens, extra)
    rows.append(("each (one process)", each_seconds, "measured", "reference"))
    loop_seconds, loop_tokens = run_shell_loop(sample, QUESTIONS, args.new_tokens)
    scaled = loop_seconds * args.files / len(sample)
    rows.append(("shell loop of ask-many", scaled, f"{loop_seconds:.1f} s for {len(sample)} files, scaled",
                 f"{differing(each_tokens, loop_tokens)} of {len(loop_tokens)} answers differ"))
    gen_seconds, gen_tokens = run_generate_loop(sample, QUESTIONS, args.new_tokens)
    scaled_gen = gen_seconds * args.files / len(sample)
    rows.append(("Python loop of generate()", scaled_gen, f"{gen_seconds:.1f} s for {len(sample)} files, scaled",
                 f"{differing(each_tokens, gen_tokens)} of {len(gen_tokens)} answers differ"))
    for workers in [int(w) for w in args.workers.split(",") if w]:
        seconds, tokens = run_each(folder, args.workdir / f"workers{workers}.jsonl", QUESTIONS, args.new_tokens,
                                   [*extra, "--workers", str(workers)])
        rows.append((f"each --workers {workers}", seconds, "measured", f"{differing(each_tokens, tokens)} of {len(tokens)} answers differ"))
    lines = [f"# ask-many --each: {args.files} files, {len(QUESTIONS)} questions, {args.new_tokens} new tokens",
             "", f"CPU: {report['cpu']}; one thread per process (OMP_NUM_THREADS=1); whole-process wall times.", "",
             "| approach | seconds | vs --each | how | tokens |", "| --- | ---: | ---: | --- | --- |"]
    for name, seconds, how, tokens in rows:
        lines.append(f"| {name} | {seconds:.1f} | {seconds / each_seconds:.2f}x | {how} | {tokens} |")
        report["runs"][name] = {"seconds": seconds, "how": how, "tokens": tokens}
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
