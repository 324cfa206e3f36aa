#!/usr/bin/env python3
"""The files users run, mdcli against llama.cpp side by side: decode steps, jobs and peak memory.

    python benchmarks/files_side_by_side.py --llama-bin DIR --file smol-Q4_K_M.gguf --file r1b-Q4_K_M.gguf:512:32 \\
        [--threads 1,2] [--rounds 1] [--out benchmarks/results/files-side-by-side-zen5]

For each file (FILE or FILE:CONTEXT:NEW_TOKENS; default 1,819 and 64 tokens, the embedded model's
report) and each thread count, in one run, `--rounds` times, alternating which goes first (with
more than one round each cell is the median of the rounds, and its ratio the median of each
round's ratio: a neighbour's load that slows one round moves both sides of it):

  mdcli       mdcli bench -m FILE --branches 1,8 --context C --new-tokens N --approaches forest --threads T --json
              (model loaded: the forest's median decode step at 1 and 8 branches, and its whole job:
              prefill of the shared document and N tokens on each branch)
  llama.cpp   llama-batched-bench -m FILE -npp P -ntg N -npl B -pps -kvu -t T -fa off, once for B = 1
              and once for B = 8 (the prompt prefilled once and shared, as the forest shares it: its
              decode step is T_TG / N, its job T), P the token count of mdcli's longest prompt at B
              branches: the bench's document of about C tokens with the question template around
              it (C + 55 on the embedded model), so both prefill the same number of tokens at one
              branch, and at eight mdcli prefills its eight questions' own tokens besides

and once per file, at two threads, the peak resident set of the 8-question job as whole processes
(benchmarks/memory.py: `mdcli ask-many` over the report against llama-batched-bench with its cache
sized to the job), with the interpreter's floor beside it: the peak of `python -c "import torch,
transformers, mdcli.api"`. A folder (bf16/f16 safetensors) runs mdcli alone in the step rows and is
paired with a .gguf for llama.cpp by `--file FOLDER=GGUF` (its F16 conversion). Targets (issue 50):
the 1-branch step at most 1.1x llama.cpp's, the 8-branch step at most 0.8x, the jobs faster, and
peak RSS less the floor at most 1.3x llama.cpp's.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one
sys.path.insert(0, str(REPO / "benchmarks"))

import memory  # noqa: E402  (benchmarks/memory.py: whole processes' peaks, llama.cpp's job command)

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.settings import child_environment  # noqa: E402

BRANCHES = (1, 8)
CONTEXT, NEW_TOKENS = 1819, 64  # the embedded model's 8-question job: its longest prompt, 64 new tokens


def mdcli_bench(model: str, context: int, new_tokens: int, threads: int, workdir: Path) -> dict:
    """Steps (ms) and jobs (s) of the forest at 1 and 8 branches, from `mdcli bench --json`."""
    out = workdir / "bench.json"
    command = [sys.executable, "-m", "mdcli", "bench", "-m", model, "--branches", ",".join(map(str, BRANCHES)),
               "--context", str(context), "--new-tokens", str(new_tokens), "--approaches", "forest",
               "--threads", str(threads), "--json", str(out)]
    memory.measured_child(command, workdir, child_environment(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO)))
    rows = json.loads(out.read_text())["results"]
    return {"command": command, **{f"step_ms_{r['branches']}": r["step_ms"] for r in rows},
            **{f"job_s_{r['branches']}": r["seconds"] for r in rows}}


def llama_bench(binary: Path, model: str, prompt_tokens: dict[int, int], new_tokens: int, threads: int,
                workdir: Path) -> dict:
    """The same from llama-batched-bench's tables (step = T_TG / N, job = T), one run per branch
    count b with a prompt of prompt_tokens[b] tokens."""
    found, commands = {}, []
    for branches in BRANCHES:
        command = [str(binary), "-m", model, "-npp", str(prompt_tokens[branches]), "-ntg", str(new_tokens), "-npl",
                   str(branches), "-pps", "-kvu", "-t", str(threads), "-fa", "off"]
        commands.append(command)
        for line in memory.measured_child(command, workdir)["stdout"].splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == branches:
                tg_seconds, total = float(cells[6]), float(cells[8])
                found[f"step_ms_{branches}"] = round(tg_seconds / new_tokens * 1000, 2)
                found[f"job_s_{branches}"] = total
    return {"commands": commands, **found}


def mdcli_prompt_tokens(model: str, context: int, workdir: Path) -> dict[int, int]:
    """Tokens of mdcli bench's longest prompt at each branch count (its document of about `context`
    tokens in the question template), counted by the model's own tokenizer in a child process."""
    code = ("import json, sys, types; from mdcli.api import load_tokenizer; from mdcli.bench.ask import Case, prompts_for; "
            "lm = types.SimpleNamespace(tokenizer=load_tokenizer(sys.argv[1], quiet=True)); "
            "print(json.dumps({b: max(map(len, prompts_for(lm, Case(b, int(sys.argv[2]), 1)))) for b in map(int, sys.argv[3:])}))")
    command = [sys.executable, "-c", code, model, str(context), *map(str, BRANCHES)]
    text = memory.measured_child(command, workdir, child_environment(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO)))["stdout"]
    return {int(b): n for b, n in json.loads(text.strip().splitlines()[-1]).items()}


def floor_peak(workdir: Path) -> int:
    """The interpreter's floor: the peak of a process that only imports what mdcli runs on."""
    command = [sys.executable, "-c", "import torch, transformers, mdcli.api"]
    return memory.measured_child(command, workdir, child_environment(PYTHONPATH=str(REPO)))["peak_rss_bytes"]


def parse_file(spec: str) -> tuple[str, str, int, int]:
    """FILE[=GGUF][:CONTEXT:NEW] -> (mdcli's file, llama.cpp's file, context, new tokens)."""
    parts = spec.split(":")
    context, new = (int(parts[1]), int(parts[2])) if len(parts) == 3 else (CONTEXT, NEW_TOKENS)
    ours, _, theirs = parts[0].partition("=")
    return ours, theirs or ours, context, new


KEYS = ("step_ms_1", "step_ms_8", "job_s_1", "job_s_8")


def measure(files: list[str], threads: list[int], llama: Path, workdir: Path, memory_runs: bool,
            rounds: int = 1) -> dict:
    rows = []
    flip = False
    for spec in files:
        ours, theirs, context, new = parse_file(spec)
        prompt_tokens = mdcli_prompt_tokens(ours, context, workdir)
        for count in threads:
            each = []
            for _ in range(rounds):
                order = ["llama.cpp", "mdcli"] if flip else ["mdcli", "llama.cpp"]
                flip = not flip
                measured = {"order": order}
                for name in order:
                    measured[name] = (mdcli_bench(ours, context, new, count, workdir) if name == "mdcli"
                                      else llama_bench(llama / "llama-batched-bench", theirs, prompt_tokens, new, count,
                                                       workdir))
                each.append(measured)
                print(json.dumps(measured), flush=True)
            rows.append({"file": ours, "llama_file": theirs, "context": context, "prompt_tokens": prompt_tokens,
                         "new_tokens": new, "threads": count, "rounds": each, **medians(each)})
    peaks = []
    if memory_runs:
        floor = floor_peak(workdir)
        for spec in files:
            ours, theirs, _, _ = parse_file(spec)
            runs, commands = memory.measure(str(llama / "llama-batched-bench"), 1, workdir, Path(ours), Path(theirs))
            peaks.append({"file": ours, "llama_file": theirs, "mdcli": runs["mdcli"][0]["peak_rss_bytes"],
                          "llama.cpp": runs["llama.cpp"][0]["peak_rss_bytes"], "floor": floor, "commands": commands})
            print(json.dumps(peaks[-1]), flush=True)
    return {"cpu": cpu_line(), "date": _dt.date.today().isoformat(), "rounds": rounds, "steps": rows, "peaks": peaks}


def medians(rounds: list[dict]) -> dict:
    """Each side's median of each key over the rounds, and the median of each round's ratio (mdcli / llama.cpp)."""
    sides = {name: {key: statistics.median(r[name][key] for r in rounds) for key in KEYS
                    if all(r[name].get(key) for r in rounds)} for name in ("mdcli", "llama.cpp")}
    ratios = {key: statistics.median(r["mdcli"][key] / r["llama.cpp"][key] for r in rounds)
              for key in KEYS if key in sides["mdcli"] and key in sides["llama.cpp"]}
    return {**sides, "ratio": ratios}


def markdown(result: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "", f"{result['date']}, {result['cpu']}; model loaded, greedy; "
             "step = median decode step (llama.cpp: T_TG / N), job = prefill of the shared prompt + N tokens "
             "on each branch, both prefilling mdcli's longest prompt's token count (prompt column: at 1 / 8 "
             f"branches). Ratios are mdcli / llama.cpp; {result.get('rounds', 1)} round(s), alternating (cells: "
             "medians; ratios: the median of each round's).", "",
             "| file | threads | prompt | step, 1 branch ms (llama.cpp / mdcli, ratio) | step, 8 branches ms | "
             "job, 1 question s | job, 8 questions s |", "|---|---:|---:|---|---|---|---|"]
    for row in result["steps"]:
        cells = []
        for key in KEYS:
            theirs, ours, ratio = row["llama.cpp"].get(key), row["mdcli"].get(key), row["ratio"].get(key)
            cells.append(f"{theirs:.4g} / {ours:.4g} ({ratio:.2f}x)" if ratio else "-")
        name = Path(row["file"]).name + (f" ({row['context']} + {row['new_tokens']} tokens)" if row["context"] != CONTEXT else "")
        prompt = " / ".join(str(row["prompt_tokens"][b]) for b in BRANCHES)
        lines.append(f"| {name} | {row['threads']} | {prompt} | " + " | ".join(cells) + " |")
    if result["peaks"]:
        mib = 2**20
        lines += ["", "Peak RSS of the 8-question job, two threads (benchmarks/memory.py's processes), the floor "
                  "being `python -c \"import torch, transformers, mdcli.api\"`:", "",
                  "| file | mdcli MiB | llama.cpp MiB | floor MiB | (mdcli - floor) / llama.cpp |",
                  "|---|---:|---:|---:|---:|"]
        for peak in result["peaks"]:
            ours, theirs, floor = peak["mdcli"] / mib, peak["llama.cpp"] / mib, peak["floor"] / mib
            lines.append(f"| {Path(peak['file']).name} (llama.cpp: {Path(peak['llama_file']).name}) | {ours:,.0f} | "
                         f"{theirs:,.0f} | {floor:,.0f} | {(ours - floor) / theirs:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin folder")
    parser.add_argument("--file", action="append", required=True, help="FILE[=GGUF][:CONTEXT:NEW_TOKENS]")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs per file and thread count")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        result = measure(args.file, [int(t) for t in args.threads.split(",")], args.llama_bin, Path(folder),
                         not args.no_memory, args.rounds)
    text = markdown(result, "python benchmarks/files_side_by_side.py " + " ".join(sys.argv[1:]))
    print(text, end="")
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
