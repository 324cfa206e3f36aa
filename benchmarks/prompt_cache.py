#!/usr/bin/env python3
"""The prompt cache, measured as a user meets it: whole `mdcli ask-many` processes, one thread.

    python benchmarks/prompt_cache.py --out benchmarks/results/prompt-cache
    python benchmarks/prompt_cache.py --random-model llama-1b --report-tokens 4096 --new-tokens 16 \\
        --rounds 1 --out benchmarks/results/prompt-cache-llama-1b

A synthetic quarterly report (mdcli.bench.margins.bench_document, a seed no other benchmark uses:
held-out text) and 8 questions, up to `--new-tokens` greedy tokens each. Each round starts from an
empty cache folder and runs, as separate processes of this tree's mdcli (`python -m mdcli`, cwd and
PYTHONPATH this repository):

  off        the 8 questions, --prompt-cache off (what every run cost before)
  first      the 8 questions, an empty cache: the prefill, plus writing the entry
  second     the same 8 questions again: the report comes from the cache
  new        8 other questions: the report comes from the cache
  new, off   those 8 other questions, --prompt-cache off (their tokens must equal `new`'s)

Round 2 runs `new, off` first and `off` last, so a drift of the machine's speed does not fall on
one side only. The report names the CPU; the table gives each run's median wall time, the
`done` stats (prefill seconds, prompt tokens read from the cache) and whether its tokens equal
its cache-off twin's. `first / off` is the write cost; `first / second` the speed-up.
`--random-model SHAPE` saves random weights of that shape (mdcli.bench.harness) to a temporary
folder first, untimed, and runs on them (the embedded model's tokenizer).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.bench.margins import bench_document  # noqa: E402
from mdcli.bench.whole_process import one_thread_env  # noqa: E402

QUESTIONS = [
    "Which projects went over budget?",
    "Why did the first over-budget project overrun?",
    "Who approved the final report?",
    "What is the report about?",
    "Which project finished early?",
    "What news does the office share?",
    "How many projects are mentioned?",
    "Summarize the report in one sentence.",
]
NEW_QUESTIONS = [
    "Which project cost the most?",
    "What caused the delays?",
    "Who wrote the report?",
    "When was the report approved?",
    "Which teams are named?",
    "What risks does the report list?",
    "What happens next quarter?",
    "Give the report a title.",
]
REPORT_SEED = 34  # no other benchmark draws this report
ROUND_ORDERS = (["off", "first", "second", "new", "new, off"], ["new, off", "first", "second", "new", "off"])


def run_once(name: str, report: Path, cache: Path, new_tokens: int, model: str | None) -> dict:
    questions = NEW_QUESTIONS if name.startswith("new") else QUESTIONS
    command = [sys.executable, "-m", "mdcli", "ask-many", str(report), *[p for q in questions for p in ("-q", q)],
               "-n", str(new_tokens), "--jsonl", "--prompt-cache", "off" if name.endswith("off") else str(cache)]
    if model:
        command += ["-m", model]
    env = {**one_thread_env(), "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    stats = events[-1]["stats"]
    return {"run": name, "seconds": round(seconds, 3), "tokens": {e["label"]: e["token_ids"] for e in events
                                                                  if e["type"] == "finish"},
            "prefill_seconds": stats["prefill_seconds"], "decode_seconds": stats["decode_seconds"],
            "prefill_tokens": stats["prefill_tokens"], "cached_tokens": stats.get("cached_tokens", 0),
            "notes": [e["message"] for e in events if e["type"] == "note"]}


def cache_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def saved_random_model(shape: str, folder: Path) -> str:
    from mdcli.bench.harness import random_model  # here: only this mode needs transformers' models

    lm = random_model(shape, device="cpu")
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return str(folder)


def table(runs: list[dict], entry_bytes: list[int]) -> str:
    names = [name for name in ROUND_ORDERS[0] if any(r["run"] == name for r in runs)]
    med = {n: statistics.median(r["seconds"] for r in runs if r["run"] == n) for n in names}
    # whose tokens each run must give: its cache-off twin (first's and second's are off's, or each other's)
    twin = {"first": "off", "second": "off" if "off" in med else "first", "new": "new, off"}
    last = {r["run"]: r for r in runs}
    lines = ["| run | seconds (median) | first / this | prefill s | prompt tokens from the cache | same tokens as |",
             "|---|---:|---:|---:|---:|---|"]
    for name in names:
        other = twin.get(name)
        same = "-" if other not in last else ("yes" if all(r["tokens"] == last[other]["tokens"] for r in runs
                                                           if r["run"] == name) else "**NO**") + f" ({other})"
        lines.append(f"| {name} | {med[name]:.2f} | {med['first'] / med[name]:.2f}x | {last[name]['prefill_seconds']:.2f} | "
                     f"{last[name]['cached_tokens']:,} | {same} |")
    first = last["first"]
    fixed = first["seconds"] - first["prefill_seconds"] - first["decode_seconds"]
    lines += ["", f"Second run, same questions: **{med['first'] / med['second']:.2f}x** faster than the first as a "
                  f"whole process" + (f"; new questions: **{med['first'] / med['new']:.2f}x**" if "new" in med else "")
              + f". Entry {statistics.median(entry_bytes) / 2**20:,.1f} MiB. The first run's own split (last round): "
                f"prefill {first['prefill_seconds']:.2f} s, decode {first['decode_seconds']:.2f} s, the rest of the "
                f"process (imports, load, output) {fixed:.2f} s."]
    if "off" in med:
        lines.append(f"Write cost (first / off): {med['first'] / med['off']:.3f}x ({med['first'] - med['off']:+.2f} s).")
    if "new, off" in med and "new" in med:
        lines.append(f"New questions against their own cache-off run: {med['new, off'] / med['new']:.2f}x.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-tokens", type=int, default=1800)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--random-model", default=None, help="a shape of mdcli.bench.RANDOM_SHAPES, e.g. llama-1b")
    parser.add_argument("--runs", default=",".join(ROUND_ORDERS[0]),
                        help="which runs (first and second always; off, new and 'new, off' optional)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from mdcli.models.embedded import embedded_model_dir

    runs: list[dict] = []
    entry_bytes: list[int] = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        model = saved_random_model(args.random_model, work / "model") if args.random_model else None
        tokenizer = AutoTokenizer.from_pretrained(model or embedded_model_dir())
        report = work / "report.txt"
        report.write_text(bench_document(tokenizer, args.report_tokens, seed=REPORT_SEED))
        warm_up = work / "warm-up.txt"
        warm_up.write_text(bench_document(tokenizer, 100, seed=REPORT_SEED))
        run_once("off", warm_up, work / "warm-up", 2, model)  # bytecode, the weights in the page cache: untimed
        chosen = {name.strip() for name in args.runs.split(",")} | {"first", "second"}
        for index in range(args.rounds):
            cache = work / f"cache-{index}"
            for name in (name for name in ROUND_ORDERS[index % 2] if name in chosen):
                runs.append(run_once(name, report, cache, args.new_tokens, model))
                print(f"round {index + 1}: {name}: {runs[-1]['seconds']:.2f} s, "
                      f"cached {runs[-1]['cached_tokens']}", file=sys.stderr, flush=True)
                if name == "first":
                    entry_bytes.append(cache_bytes(cache))
        report_tokens = len(tokenizer(report.read_text())["input_ids"])
    header = (f"{_dt.date.today()}, CPU: {cpu_line()}; one thread per process; "
              f"{args.random_model or 'embedded SmolLM2-135M'}; a {report_tokens:,}-token report, 8 questions x "
              f"{args.new_tokens} tokens; {args.rounds} round(s); the machine was shared with other jobs "
              f"(load average {os.getloadavg()[0]:.1f} at the end); command: python benchmarks/prompt_cache.py "
              + " ".join(sys.argv[1:]))
    text = header + "\n\n" + table(runs, entry_bytes) + "\n"
    notes = sorted({note for r in runs for note in r["notes"]})
    if notes:
        text += "\nNotes: " + "; ".join(notes) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"header": header, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
