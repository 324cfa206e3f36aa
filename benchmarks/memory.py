#!/usr/bin/env python3
"""Peak resident memory of whole processes: mdcli ask-many against llama.cpp on the same .gguf.

    python benchmarks/memory.py --llama-batched-bench PATH --out benchmarks/results/memory-zen3

Issue 39 asks for mdcli's memory within 2x of llama.cpp's on the same file. The job: the 8
questions of mdcli.bench.ask over the whole-process benchmark's 1,700-token report
(mdcli.bench.whole_process.report_text), 64 new tokens each, on the embedded model's .gguf:

  mdcli                   python -m mdcli ask-many REPORT -q ... (8) --max-new-tokens 64 --jsonl
                          --prompt-cache off (CLI defaults otherwise; the cache off so that every run
                          prefills, as llama.cpp does, instead of reading the report's keys from disk)
  llama.cpp               llama-batched-bench -m GGUF -npp P -ntg 64 -npl 8 -pps -kvu -t 2 -fa off -c C
                          P: the longest of mdcli's 8 prompts, in tokens (its `start` event); -pps the
                          prompt prefilled once and shared, as mdcli's forest shares it; C = P + 8 x 64,
                          the cache cells the job needs
  llama.cpp, model ctx    the same without -c: llama.cpp then sizes its cache for the model's whole
                          context (8,192 tokens for SmolLM2), as a user who gives no -c gets

Each runs as a child of this script and its peak resident set is the kernel's high-water mark for
that child, from os.wait4's rusage (mdcli.core.resident.maxrss_bytes: KiB on Linux, bytes on macOS);
no /usr/bin/time needed. mdcli's own `done` stats say its peak too (`peak_rss_bytes`, taken when the
run ends), beside it in the table. With --repeats N the rows alternate, first to last then last to
first; each cell is the median. Without a llama-batched-bench binary (--llama-batched-bench, or
the LLAMA_BATCHED_BENCH variable) mdcli is measured alone and the report says llama.cpp was not
found. The report names the CPU, the date and every command; notebook/memory.md keeps the numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.bench.ask import QUESTIONS  # noqa: E402
from mdcli.bench.whole_process import report_text  # noqa: E402
from mdcli.core.resident import maxrss_bytes  # noqa: E402
from mdcli.models.embedded import embedded_gguf_path, embedded_model_dir  # noqa: E402
from mdcli.settings import child_environment  # noqa: E402

REPORT_TOKENS = 1700
NEW_TOKENS = 64
LLAMA_THREADS = 2


def measured_child(command: list[str], workdir: Path, env: dict[str, str] | None = None) -> dict:
    """Run `command` to its end as a child; its peak resident bytes (os.wait4), seconds, stdout.
    Output goes to files, not pipes: a child blocked on a full pipe would never be waited for."""
    out, err = workdir / "stdout", workdir / "stderr"
    started = time.perf_counter()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        child = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({child.returncode}): {err.read_text()[-800:]}")
    return {"peak_rss_bytes": maxrss_bytes(usage), "seconds": round(seconds, 2), "stdout": out.read_text()}


def mdcli_command(report: Path, model: Path | None = None) -> list[str]:
    asks = [part for question in QUESTIONS for part in ("-q", question)]
    chosen = ["-m", str(model)] if model else []
    return [sys.executable, "-m", "mdcli", "ask-many", str(report), *asks, *chosen, "--max-new-tokens", str(NEW_TOKENS),
            "--prompt-cache", "off", "--jsonl"]


def run_mdcli(report: Path, workdir: Path, model: Path | None = None) -> dict:
    """One `mdcli ask-many` process: its peak, and what its own `start` and `done` events say."""
    env = child_environment(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    result = measured_child(mdcli_command(report, model), workdir, env)
    events = [json.loads(line) for line in result.pop("stdout").splitlines() if line.strip()]
    result["done_peak_rss_bytes"] = events[-1]["stats"]["peak_rss_bytes"]
    result["longest_prompt_tokens"] = max(len(b["prompt_token_ids"]) for b in events[0]["branches"])
    result["peak_cache_tokens"] = events[-1]["stats"]["peak_cache_tokens"]
    return result


def llama_command(binary: str, prompt_tokens: int, fitted: bool, model: Path | None = None) -> list[str]:
    command = [binary, "-m", str(model or embedded_gguf_path()), "-npp", str(prompt_tokens), "-ntg", str(NEW_TOKENS),
               "-npl", str(len(QUESTIONS)), "-pps", "-kvu", "-t", str(LLAMA_THREADS), "-fa", "off"]
    return command + ["-c", str(prompt_tokens + len(QUESTIONS) * NEW_TOKENS)] if fitted else command


def run_llama(binary: str, prompt_tokens: int, fitted: bool, workdir: Path, model: Path | None = None) -> dict:
    result = measured_child(llama_command(binary, prompt_tokens, fitted, model), workdir)
    result.pop("stdout")
    return result


def measure(binary: str | None, repeats: int, workdir: Path, model: Path | None = None,
            llama_model: Path | None = None) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
    """Every row `repeats` times, alternating the order; mdcli first, so the llama.cpp rows know
    the prompt length mdcli built. llama_model: llama.cpp's file where mdcli's is not one (a bf16
    folder against its F16 .gguf); default `model`."""
    llama_model = llama_model or model
    report = workdir / "report.txt"
    report.write_text(report_text(AutoTokenizer.from_pretrained(embedded_model_dir()), REPORT_TOKENS))
    names = ["mdcli"] + (["llama.cpp", "llama.cpp, model ctx"] if binary else [])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    prompt_tokens = 0
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        if not prompt_tokens:
            order = names  # the first round must start with mdcli
        for name in order:
            if name == "mdcli":
                runs[name].append(run_mdcli(report, workdir, model))
                prompt_tokens = runs[name][-1]["longest_prompt_tokens"]
            else:
                runs[name].append(run_llama(binary, prompt_tokens, name == "llama.cpp", workdir, llama_model))
    commands = {"mdcli": mdcli_command(Path("REPORT"), model)}
    if binary:
        commands["llama.cpp"] = llama_command(binary, prompt_tokens, True, llama_model)
        commands["llama.cpp, model ctx"] = llama_command(binary, prompt_tokens, False, llama_model)
    return runs, commands


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def markdown(runs: dict[str, list[dict]], commands: dict[str, list[str]], binary: str | None, repeats: int,
             model: Path | None = None) -> str:
    mib = 2**20
    mdcli = median_of(runs["mdcli"], "peak_rss_bytes")
    lines = [
        f"CPU: {cpu_line()}; {_dt.date.today().isoformat()}; {len(QUESTIONS)} questions over a "
        f"{REPORT_TOKENS:,}-token report (longest prompt {runs['mdcli'][0]['longest_prompt_tokens']:,} tokens), "
        f"{NEW_TOKENS} new tokens each; " + (f"{model.name} ({model.stat().st_size / mib:,.0f} MiB)" if model else
                                              f"the embedded model's .gguf ({embedded_gguf_path().name})") + "; "
        f"peak resident set of each whole process (os.wait4), median of {repeats}. Seconds are not a "
        f"speed comparison: llama.cpp runs {LLAMA_THREADS} threads on random prompt tokens, mdcli its defaults.",
        "",
        "| process | peak RSS MiB | mdcli / this | seconds | mdcli's own done.stats peak MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, measured in runs.items():
        peak = median_of(measured, "peak_rss_bytes")
        own = f"{median_of(measured, 'done_peak_rss_bytes') / mib:,.0f}" if name == "mdcli" else ""
        ratio = "" if name == "mdcli" else f"{mdcli / peak:.2f}x"
        lines.append(f"| {name} | {peak / mib:,.0f} | {ratio} | {median_of(measured, 'seconds'):.1f} | {own} |")
    if not binary:
        lines += ["", "llama.cpp: not found (no llama-batched-bench given by --llama-batched-bench or "
                      "LLAMA_BATCHED_BENCH, or not a file); mdcli measured alone."]
    lines += ["", "Commands (REPORT: the report this script writes; GGUF paths as run):", ""]
    lines += [f"- {name}: `{shlex.join(command)}`" for name, command in commands.items()]
    return "\n".join(lines) + "\n"


def bound_line(model: Path, peak: float, cache_tokens: int) -> str:
    """Issue 39's bound for a model: twice the file plus the KV cache the job filled (float32)."""
    config = AutoConfig.from_pretrained(model.parent, gguf_file=model.name)
    head_dim = config.hidden_size // config.num_attention_heads
    kv = cache_tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    bound = 2 * model.stat().st_size + kv
    mib = 2**20
    return (f"\nBound: 2 x {model.stat().st_size / mib:,.0f} MiB (the file) + {kv / mib:,.0f} MiB (KV cache, "
            f"{cache_tokens:,} tokens, float32) = {bound / mib:,.0f} MiB; mdcli's peak {peak / mib:,.0f} MiB is "
            f"{peak / bound:.2f} of it.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-batched-bench", default=os.environ.get("LLAMA_BATCHED_BENCH"),
                        help="path of llama.cpp's llama-batched-bench (default: $LLAMA_BATCHED_BENCH)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None,
                        help="a .gguf to run instead of the embedded one (e.g. from benchmarks/random_gguf.py)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    binary = args.llama_batched_bench if args.llama_batched_bench and Path(args.llama_batched_bench).is_file() else None
    with tempfile.TemporaryDirectory() as folder:
        runs, commands = measure(binary, args.repeats, Path(folder), args.model)
    text = markdown(runs, commands, binary, args.repeats, args.model)
    if args.model:
        text += bound_line(args.model, median_of(runs["mdcli"], "peak_rss_bytes"), runs["mdcli"][0]["peak_cache_tokens"])
    print(text, end="")
    if args.out:
        args.out.with_suffix(".md").write_text(f"Command: `python benchmarks/memory.py {' '.join(sys.argv[1:])}`\n\n{text}")
        args.out.with_suffix(".json").write_text(json.dumps(
            {"cpu": cpu_line(), "date": _dt.date.today().isoformat(), "repeats": args.repeats, "runs": runs,
             "commands": commands, "llama_cpp_found": binary is not None}, indent=2) + "\n")


if __name__ == "__main__":
    main()
