"""Whole processes, as a user runs them: import, load, prefill, decode, print.

`mdcli bench --whole-process` (or ``python -m mdcli.bench.whole_process``) times complete commands
on one report and N questions, each in a fresh process with one thread:

  mdcli           ``mdcli ask-many REPORT -q ... -n N --jsonl``
  mdcli, 1 q      the same with only the question whose answer was longest: the branching overhead
                  (N questions / that one question, whole process) is what asking more costs
  mdcli, slowest  (--slowest-reference) the same with only the question that takes the most forwards
                  alone (each asked alone once first, untimed): with speculation that need not be the
                  longest answer, and N questions cannot decode in fewer forwards than it does
  sequential      a plain-transformers script, generate() once per question
  batched         the same script, one generate() over the left-padded prompts
  prefill-once    the same script, the shared prefix prefilled once and deep-copied per question

(the script is mdcli/bench/plain_transformers.py, run as a file so its process imports only torch and
transformers). Every approach must produce mdcli's tokens; the table says whether it did. The
model-loaded benchmarks (`mdcli bench`) leave out import and load time; this one does not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from transformers import AutoTokenizer

from mdcli.backends.host import cpu_line
from mdcli.bench.ask import QUESTIONS
from mdcli.bench.margins import bench_document
from mdcli.errors import UsageError
from mdcli.models.embedded import embedded_model_dir
from mdcli.settings import child_environment

PLAIN_SCRIPT = Path(__file__).with_name("plain_transformers.py")
# The script runs as __main__ without its folder first on sys.path: the benchmarks beside it would
# shadow packages transformers looks for (this folder's kernels.py is not Hugging Face's `kernels`).
RUN_AS_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
PLAIN_MODES = ("sequential", "batched", "prefill-once")


@dataclass
class ProcessRun:
    approach: str
    seconds: list[float] = field(default_factory=list)  # wall clock of the whole process, per repeat
    token_ids: list[list[int]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # what the process reported of itself (last repeat)

    @property
    def median(self) -> float:
        return median(self.seconds)


def one_thread_env() -> dict[str, str]:
    """The environment every timed process gets: one thread, no network, no colour."""
    return child_environment(**{"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
                         "TOKENIZERS_PARALLELISM": "false"})


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=one_thread_env(), check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds, done.stdout


def mdcli_command(report: Path, questions: list[str], new_tokens: int) -> list[str]:
    asks = [part for q in questions for part in ("-q", q)]
    return [sys.executable, "-m", "mdcli", "ask-many", str(report), *asks, "-n", str(new_tokens), "--jsonl"]


def run_mdcli_once(run: ProcessRun, report: Path, questions: list[str], new_tokens: int) -> None:
    """One whole `mdcli ask-many` process, its time, tokens and what its `done` event says."""
    seconds, stdout = timed(mdcli_command(report, questions, new_tokens))
    run.seconds.append(seconds)
    events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    finishes = {e["label"]: e["token_ids"] for e in events if e["type"] == "finish"}
    run.token_ids = [finishes[q] for q in questions]
    stats = events[-1]["stats"]
    run.phases = {"prefill": stats["prefill_seconds"], "decode": stats["decode_seconds"],
                  "steps": stats["steps"], "step_ms": round(1000 * stats["decode_seconds"] / max(1, stats["steps"]), 1)}


def run_plain(mode: str, model_dir: Path, report: Path, questions_file: Path, new_tokens: int,
              repeats: int) -> ProcessRun:
    run = ProcessRun(mode)
    command = [sys.executable, "-c", RUN_AS_SCRIPT, str(PLAIN_SCRIPT), str(model_dir), str(report), str(questions_file), "--mode", mode,
               "--max-new-tokens", str(new_tokens)]
    for _ in range(repeats):
        seconds, stdout = timed(command)
        run.seconds.append(seconds)
        result = json.loads(stdout.strip().splitlines()[-1])
        run.token_ids = result["token_ids"]
        run.phases = {k.removesuffix("_seconds"): v for k, v in result.items() if k.endswith("_seconds")}
    return run


def report_text(tokenizer, tokens: int) -> str:
    return bench_document(tokenizer, tokens)


def forwards_alone(report: Path, questions: list[str], new_tokens: int) -> list[int]:
    """The forwards each question takes asked alone, one untimed process each."""
    counts = []
    for question in questions:
        probe = ProcessRun("alone")
        run_mdcli_once(probe, report, [question], new_tokens)
        counts.append(probe.phases["steps"])
    return counts


def measure(report_tokens: int, questions: list[str], new_tokens: int, repeats: int, workdir: Path,
            approaches: tuple[str, ...] = PLAIN_MODES, slowest_reference: bool = False) -> list[ProcessRun]:
    """Every approach in turn, mdcli first (an untimed run's answers pick the longest question; with
    `slowest_reference`, each question alone picks the one that takes the most forwards)."""
    model_dir = embedded_model_dir()  # converted once, outside the timings
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report = workdir / "report.txt"
    report.write_text(report_text(tokenizer, report_tokens))
    questions_file = workdir / "questions.txt"
    questions_file.write_text("\n".join(questions) + "\n")

    # One untimed process picks the longest-answering question. It is also the one that finds the
    # files cold and writes the prompt cache's entry: timed, it took 29.9 s against the next's 17.8 s
    # on a Zen 3 core (2026-11-27), which two repeats' median would have kept.
    picker = ProcessRun("mdcli, picking the longest question")
    run_mdcli_once(picker, report, questions, new_tokens)
    longest = max(range(len(questions)), key=lambda i: len(picker.token_ids[i]))
    # the mdcli rows alternate (all questions, then the longest alone, then the slowest alone, repeat)
    # so that a drift in the machine's speed falls on all, not on one: their ratio is the branching overhead
    together = ProcessRun(f"mdcli, {len(questions)} questions")
    alone = ProcessRun("mdcli, longest question alone")
    references = [(alone, longest)]
    if slowest_reference:
        counts = forwards_alone(report, questions, new_tokens)
        slowest = max(range(len(questions)), key=counts.__getitem__)
        references.append((ProcessRun("mdcli, slowest question alone"), slowest))
    for _ in range(repeats):
        run_mdcli_once(together, report, questions, new_tokens)
        for reference, index in references:
            run_mdcli_once(reference, report, [questions[index]], new_tokens)
    for reference, index in references:
        reference.phases["question"] = questions[index]
        reference.phases["index"] = index
    if slowest_reference:
        references[1][0].phases["forwards alone"] = counts
    runs = [together] + [reference for reference, _ in references]
    runs.extend(run_plain(mode, model_dir, report, questions_file, new_tokens, repeats) for mode in approaches)
    return runs


def markdown(runs: list[ProcessRun], questions: int, new_tokens: int, report_tokens: int, repeats: int) -> str:
    mdcli, alone = runs[0], runs[1]
    references = [run for run in runs[1:] if "index" in run.phases]
    lines = [
        f"CPU: {cpu_line()}; one thread per process; {report_tokens:,}-token report, {questions} questions, "
        f"up to {new_tokens} greedy tokens each; median of {repeats} whole process(es) per row.",
        "",
        "| approach | seconds | mdcli is x faster | same tokens as mdcli | phases (s) |",
        "|---|---:|---:|---|---|",
    ]
    for run in runs:
        expected = [mdcli.token_ids[run.phases["index"]]] if run in references else mdcli.token_ids
        same = "yes" if run.token_ids == expected else "**NO**"
        phases = ", ".join(f"{k} {v}" for k, v in run.phases.items() if k not in ("question", "index", "forwards alone"))
        lines.append(f"| {run.approach} | {run.median:.1f} | {run.median / mdcli.median:.2f} | {same} | {phases} |")
    lines.append("")
    for reference in references:
        which = ("the longest-answering one alone" if reference is alone else
                 f"the one that takes the most forwards alone (each alone: {reference.phases['forwards alone']})")
        in_process = ((mdcli.phases["prefill"] + mdcli.phases["decode"])
                      / (reference.phases["prefill"] + reference.phases["decode"]))
        lines.append(f"Branching overhead (whole process, {questions} questions / {which}, "
                     f"\"{reference.phases['question']}\"): **{mdcli.median / reference.median:.2f}x** "
                     f"(prefill + decode alone, from the last runs' `done` stats: {in_process:.2f}x)")
    return "\n".join(lines) + "\n"


def run(report_tokens: int, questions: int, new_tokens: int, repeats: int, approaches: tuple[str, ...] = PLAIN_MODES,
        json_path: Path | None = None, slowest_reference: bool = False) -> str:
    """Measure and return the Markdown report (also written as JSON to `json_path`)."""
    unknown = [a for a in approaches if a not in PLAIN_MODES]
    if unknown:
        raise UsageError(f"unknown whole-process approach {unknown[0]!r}", fix=f"choose from {', '.join(PLAIN_MODES)}")
    if not 1 <= questions <= len(QUESTIONS):
        raise UsageError(f"the whole-process benchmark asks 1 to {len(QUESTIONS)} questions, not {questions}",
                         fix=f"e.g. --branches {len(QUESTIONS)}")
    chosen = QUESTIONS[:questions]
    with tempfile.TemporaryDirectory() as folder:
        runs = measure(report_tokens, chosen, new_tokens, repeats, Path(folder), approaches, slowest_reference)
    if json_path is not None:
        json_path.write_text(json.dumps({"cpu": cpu_line(), "report_tokens": report_tokens, "new_tokens": new_tokens,
                                         "runs": [vars(r) for r in runs]}, indent=2) + "\n")
    return markdown(runs, questions, new_tokens, report_tokens, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.whole_process", description=__doc__.splitlines()[0])
    parser.add_argument("--report-tokens", type=int, default=1700)
    parser.add_argument("--questions", type=int, default=8, help=f"how many of the {len(QUESTIONS)} built-in questions")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--approaches", default=",".join(PLAIN_MODES), help="plain-transformers modes to run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--slowest-reference", action="store_true",
                        help="also time the question that takes the most forwards alone (each asked alone once first)")
    args = parser.parse_args(argv)
    approaches = tuple(a for a in args.approaches.split(",") if a)
    print(run(args.report_tokens, args.questions, args.new_tokens, args.repeats, approaches, args.json,
              args.slowest_reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
