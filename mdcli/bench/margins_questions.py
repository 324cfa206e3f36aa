"""Benchmark: `mdcli margins` with several questions in one forest against one run per question.

    python -m mdcli.bench.margins --questions 4     # the ~4,000-token report, 8 segments
    python -m mdcli.bench.margins --questions 8 --processes   # + whole `mdcli margins` processes
    python -m mdcli.bench.margins --questions 4 --rules-first # experiment: classifier rules shared

Both sides run the whole stage (prefill, margins, classification, answers) with the same model,
prompts and limits, greedy, fp32, `torch.set_num_threads(1)`:

* together: ONE run_margins with N questions: each phase is one set of forwards over one cache
  (the document's segments cached once, every question's margins hanging off them).
* one run per question, in process: run_margins N times with one question each, the same
  function `mdcli margins -q Q` runs (model loaded once, so the model load is not counted).
* with --processes, also N whole `python -m mdcli margins DOC -q Q --jsonl` processes, each
  loading the model (what a user who runs the command once per question waits for).

Every question's branches (margins, classifications, answer) must be identical token for token
on both sides; the script says so and exits 1 if not. Per-phase wall times come from the event
stream: margins (prefill included) end at the first classification fork, classification at the
first answer fork, answers at Done.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mdcli.events import Done, Finish, Fork, Start
from mdcli.strategies.margins import Margins, MarginsPrompts, run_margins
from mdcli.strategies.margins.job import CLASSIFICATION_RULES

QUESTIONS = [
    "Which projects went over budget, and why?",
    "Which projects finished on time and under budget?",
    "What changed in the cafeteria?",
    "What did the human resources team organise?",
    "Which project installed solar panels on the roof?",
    "What does the new parking policy say?",
    "How were the suppliers selected?",
    "What did the library add?",
]
WARMUP_QUESTION = "Who wrote the report?"
"""Asked once, untimed, before either side: the process's first stage pays for its kernels' first
calls and its first large allocations (measured: 4 questions together 79.9 s first in the
process, 71.7 s after), which would otherwise fall on whichever side runs first."""
PHASES = ("margins", "classification", "answers")
RULES_FIRST_CLASSIFICATION = (
    "I ask an LLM assistant whether a piece of document is related to a query, and show you its answer. "
    + CLASSIFICATION_RULES + '\n\nThe query: "$query"\nThe answer:\n```text\n$margin\n```'
)
"""--rules-first (an experiment, not mdcli's default): the paper's classifier prompt with its fixed
rules moved before the query and the margin, so every classification branch shares them in the
cache; only the query and the margin are each branch's own."""


@dataclass
class StageResult:
    tokens: dict[str, list[list[int]]]  # question -> its branches' token ids, in announcement order
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per phase
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    generated: int = 0

    def add(self, other: StageResult) -> None:
        self.tokens.update(other.tokens)
        for name, value in other.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + value
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.prefill_tokens += other.prefill_tokens
        self.generated += other.generated


def run_stage(
    lm, document: str, questions: list[str], segment_tokens: int, limits: dict[str, int], rules_first: bool = False,
    speculate: str = "off",
) -> StageResult:
    """One run_margins over `questions`, timed phase by phase from its events."""
    prompts = MarginsPrompts(classification=RULES_FIRST_CLASSIFICATION) if rules_first else MarginsPrompts()
    job = Margins(
        documents=[document], questions=list(questions), segment_tokens=segment_tokens, prompts=prompts, **limits
    )
    group: dict[int, str] = {}
    finishes: dict[int, list[int]] = {}
    marks = {"start": time.perf_counter()}
    done = None
    for event in run_margins(lm, job, speculate=speculate):
        if isinstance(event, Start):
            group.update({b.id: b.group for b in event.branches})
        elif isinstance(event, Fork):
            group[event.branch.id] = event.branch.group
            phase = "answers" if event.branch.label in questions or event.branch.label == "answer" else "classification"
            marks.setdefault(phase, time.perf_counter())
        elif isinstance(event, Finish):
            finishes[event.branch] = event.token_ids
        elif isinstance(event, Done):
            done = event
    marks["end"] = time.perf_counter()
    result = StageResult(tokens={})
    for branch, tokens in finishes.items():
        result.tokens.setdefault(group[branch], []).append(tokens)
    order = ["start", *(p for p in ("classification", "answers") if p in marks), "end"]
    names = ["margins", *(p for p in ("classification", "answers") if p in marks)]
    result.phases = {name: marks[b] - marks[a] for name, a, b in zip(names, order, order[1:])}
    result.seconds = marks["end"] - marks["start"]
    result.prefill_seconds, result.prefill_tokens = done.stats.prefill_seconds, done.stats.prefill_tokens
    result.generated = done.stats.generated_tokens
    return result


def run_processes(document: str, questions: list[str], segment_tokens: int, limits: dict[str, int], model,
                  speculate: str = "off"):
    """N whole `mdcli margins` processes (model load included), one per question: seconds, tokens."""
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "report.txt"
        path.write_text(document, encoding="utf-8")
        started = time.perf_counter()
        for question in questions:
            command = [sys.executable, "-m", "mdcli", "margins", str(path), "-q", question, "--jsonl", "--quiet",
                       "--segment-tokens", str(segment_tokens), "-n", str(limits["margin_tokens"]),
                       "--classify-tokens", str(limits["classify_tokens"]),
                       "--answer-tokens", str(limits["answer_tokens"]), "--dtype", "float32", "--device", "cpu",
                       "--speculate", speculate]
            if model:
                command += ["-m", model]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            events = [json.loads(line) for line in out.splitlines()]
            tokens[question] = [e["token_ids"] for e in events if e["type"] == "finish"]
        return time.perf_counter() - started, tokens


def compare_questions(lm, document: str, count: int, segment_tokens: int, limits: dict[str, int], *,
                      processes: bool = False, model: str | None = None, rules_first: bool = False,
                      speculate: str = "off", warmup: bool = True) -> bool:
    """speculate: both sides' --speculate setting ("off" by default, as the tables in BENCHMARKS);
    warmup: run WARMUP_QUESTION alone first, untimed."""
    questions = QUESTIONS[:count]
    if rules_first:
        print("classification prompt: --rules-first (the rules before the query and margin; an experiment)\n")
    print(f"--speculate {speculate} on both sides\n")
    if warmup:
        run_stage(lm, document, [WARMUP_QUESTION], segment_tokens, limits, rules_first, speculate)
        print(f"warm-up (untimed): {WARMUP_QUESTION!r} alone\n")
    together = run_stage(lm, document, questions, segment_tokens, limits, rules_first, speculate)
    alone = StageResult(tokens={})
    for question in questions:
        alone.add(run_stage(lm, document, [question], segment_tokens, limits, rules_first, speculate))
    same = sum(together.tokens[q] == alone.tokens[q] for q in questions)
    print(f"{count} question{'s' if count > 1 else ''}: {', '.join(repr(q) for q in questions)}\n")
    print(f"| whole stage, {count} question{'s' if count > 1 else ''} | together (one forest) | "
          f"one run per question (in process) | speedup |")
    print("| --- | ---: | ---: | ---: |")
    rows = [("total, s", together.seconds, alone.seconds)]
    rows += [(f"{name}, s", together.phases.get(name, 0.0), alone.phases.get(name, 0.0)) for name in PHASES]
    rows += [("prefill (all phases), s", together.prefill_seconds, alone.prefill_seconds)]
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |" if a > 0 else f"| {name} | - | - | |")
    print(f"| tokens prefilled | {together.prefill_tokens:,} | {alone.prefill_tokens:,} | |")
    print(f"| tokens generated | {together.generated:,} | {alone.generated:,} | |")
    print(f"| questions with identical tokens (every branch) | {same}/{count} | | |")
    ok = same == count
    if processes and not rules_first:
        seconds, tokens = run_processes(document, questions, segment_tokens, limits, model, speculate)
        same_processes = sum(tokens[q] == together.tokens[q] for q in questions)
        print(f"| {count} whole `mdcli margins` processes, s (model load included) | {together.seconds:.1f} | "
              f"{seconds:.1f} | {seconds / together.seconds:.2f}x |")
        print(f"| questions identical to the processes' tokens | {same_processes}/{count} | | |")
        ok = ok and same_processes == count
    return ok
