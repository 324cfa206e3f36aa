"""`mdcli bench`: the forest against the alternatives, side by side, in one run."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.bench import BASELINE_KERNELS, BASELINE_KERNELS_HELP
from mdcli.cli.common import errors, load
from mdcli.cli.groups import takes
from mdcli.cli.options import LOAD, OUTPUT, LoadFlags, OutputFlags
from mdcli.errors import UsageError

APPROACH_HELP = (
    "Comma list of forest, sequential (generate per branch), batched (padded generate), prefix-copy, "
    "forest+speculate (speculative decoding, auto), hf-prompt-lookup (generate(prompt_lookup_num_tokens=10) "
    "per branch), forest-no-blocks (the forest with every forward on the float32 kernels, none on the .gguf's "
    "blocks), forest-no-graphs (the forest with no step replayed as a CUDA graph), forest-int8 (the forest over an int8 copy of the model, as --cpu-weights int8; its tokens are "
    "another model's)."
)


@takes(loading=LOAD.only("model", "device", "dtype", "attn", "cpu_weights"), out=OUTPUT.only("quiet", "debug"))
def bench(
    random_model: Annotated[
        Optional[str],
        typer.Option("--random-model", help="Random weights of a named shape instead: tiny, llama-135m, llama-1b, llama-3b, qwen3-0.6b."),
    ] = None,
    branches: Annotated[str, typer.Option("--branches", help="Comma list of branch counts.")] = "1,8",
    context: Annotated[str, typer.Option("--context", help="Comma list of document lengths in tokens.")] = "1500",
    new_tokens: Annotated[str, typer.Option("--new-tokens", help="Comma list of tokens generated per branch.")] = "64",
    approaches: Annotated[str, typer.Option("--approaches", help=APPROACH_HELP)] = "forest,sequential,batched,prefix-copy",
    baseline_kernels: Annotated[
        str,
        typer.Option("--baseline-kernels", help=BASELINE_KERNELS_HELP + "."),
    ] = "stock",
    threads: Annotated[
        Optional[int], typer.Option("--threads", min=1, help="torch threads (default 1 on CPU: comparable on shared machines).")
    ] = None,
    peak_bandwidth: Annotated[
        Optional[float],
        typer.Option("--peak-bandwidth", min=0.001, help="The device's peak memory bandwidth in GB/s (e.g. 3350 for "
                     "an H100 SXM): the table then says how close a decode step comes to it."),
    ] = None,
    whole_process: Annotated[
        bool,
        typer.Option("--whole-process", help="Time complete commands instead (import, load, prefill, decode): mdcli "
                     "ask-many against a plain-transformers script (sequential, batched, prefill-once) and against "
                     "mdcli with the longest-answering question alone; --branches = questions (largest value), "
                     "--context = report tokens, --new-tokens, --repeats, --json, --markdown apply."),
    ] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per measurement, in alternating order (first to last, then last to first); the median time is reported, and each ratio is the median of the ratios within a repeat.")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One small untimed run first.")] = True,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot (needs matplotlib).")] = None,
    markdown_path: Annotated[
        Optional[Path], typer.Option("--markdown", help="Write the Markdown report (machine, command, table) here.")
    ] = None,
    *, loading: LoadFlags, out: OutputFlags,
) -> None:
    """Compare mdcli's forest with generate per branch, batched generate and a prefix-copy batch.

    Every approach gets the same prompts (one document, N questions) and generates exactly the
    same number of greedy tokens; the table says whether each produced the forest's tokens.
    """
    with errors(out.debug):
        if whole_process:
            _whole_process(branches, context, new_tokens, repeats, json_path, markdown_path)
            return
        # lazy: the harness costs `mdcli --help` ~15 ms
        from mdcli.bench.harness import random_model as make_random
        from mdcli.bench.harness import set_bench_threads
        from mdcli.bench.ask import ALL_APPROACHES, Case, run_case
        from mdcli.bench.report import (
            as_json,
            combine_repeats,
            machine_facts,
            markdown_table,
            memory_note,
            plot,
            process_memory,
            rows,
        )

        chosen = [a.strip() for a in approaches.split(",") if a.strip()]
        unknown = [a for a in chosen if a not in ALL_APPROACHES]
        if unknown:
            raise UsageError(f"unknown approach '{unknown[0]}'", fix=f"choose from {', '.join(ALL_APPROACHES)}")
        if baseline_kernels not in BASELINE_KERNELS:
            raise UsageError(f"unknown --baseline-kernels '{baseline_kernels}'", fix="choose stock or mdcli")
        cases = [Case(b, c, n) for c in _ints(context, "--context") for n in _ints(new_tokens, "--new-tokens")
                 for b in _ints(branches, "--branches")]
        if plot_path is not None:
            _require_matplotlib()
        used_threads = set_bench_threads(threads, loading.device)  # before the load, whose plan reads them
        if random_model:
            if loading.cpu_weights != "float32":
                raise UsageError(f"--cpu-weights {loading.cpu_weights} applies to a loaded model, not --random-model",
                                 fix="drop one of them")
            lm = make_random(random_model, device=loading.device, dtype=loading.dtype, attn=loading.attn)
        else:
            lm = load(loading.options(out))
        facts = machine_facts(used_threads, lm.forward.plan) | {
            "model": lm.name, "dtype": str(lm.dtype).removeprefix("torch."), "cpu_weights": lm.cpu_weights,
            "baseline_kernels": baseline_kernels,
            "peak_bandwidth_gbps": peak_bandwidth}
        measure = functools.partial(run_case, baseline_kernels=baseline_kernels)
        if warmup:
            measure(lm, Case(2, 64, 4), chosen)
        results = _sweep(lm, cases, chosen, repeats, out.quiet, measure, combine_repeats)
        memory = process_memory()  # after every run: the whole process's peak
        table = rows(results, peak_bandwidth)
        command = "mdcli " + " ".join(sys.argv[1:])
        _print_table(table, facts, memory_note(memory))
        if json_path:
            json_path.write_text(json.dumps(as_json(facts, table, command, memory), indent=2) + "\n")
        if plot_path:
            plot(table, str(plot_path))
        if markdown_path:
            markdown_path.write_text(_markdown_report(facts, command, markdown_table(table) + "\n" + memory_note(memory) + "\n"))


def _whole_process(branches: str, context: str, new_tokens: str, repeats: int, json_path, markdown_path) -> None:
    from mdcli.bench.whole_process import run as run_whole_process  # lazy: as above, ~5 ms on every --help

    report = run_whole_process(report_tokens=_ints(context, "--context")[0], questions=max(_ints(branches, "--branches")),
                               new_tokens=_ints(new_tokens, "--new-tokens")[0], repeats=repeats, json_path=json_path)
    if markdown_path:
        markdown_path.write_text(f"Command: `mdcli {' '.join(sys.argv[1:])}`\n\n{report}")
    print(report)


def _sweep(lm, cases, chosen, repeats, quiet, run_case, combine_repeats):
    from rich.console import Console
    from rich.progress import Progress

    results = []
    with Progress(console=Console(stderr=True), disable=quiet, transient=True) as progress:
        task = progress.add_task("benchmark", total=len(cases) * repeats)
        for case in cases:
            runs = []
            for repeat in range(repeats):
                progress.update(task, description=f"{case.branches} branches, {case.context_tokens} ctx, {case.new_tokens} new")
                runs.append(run_case(lm, case, chosen, reverse=repeat % 2 == 1))  # ABBA: drift favours no approach
                progress.advance(task)
            results.extend(combine_repeats(runs))
    return results


def _print_table(table: list[dict], facts: dict, note: str) -> None:
    from rich.console import Console
    from rich.table import Table

    cpu = f"{facts['cpu']}, AVX-512 {'yes' if facts['avx512'] else 'no'}"
    out = Table(title=f"{facts['model']} · {facts['dtype']} · {facts['torch_threads']} thread(s) · load "
                      f"{facts['load_average_1m']}\n{cpu} · kernels {facts['mdcli_kernels']} ({facts['mdcli_kernels_reason']})")
    # forest x: how many times faster the forest was than this row's approach
    # x ref: the forest's step over transformers' own single-sequence step on the same context
    for name in ("B", "ctx", "new", "approach", "s", "tok/s", "KV MiB", "forest x", "step ms", "ref ms", "x ref", "GB/s",
                 "same", "tok/fwd", "accepted"):
        out.add_column(name, justify="left" if name == "approach" else "right")
    for r in table:
        out.add_row(str(r["branches"]), str(r["context_tokens"]), str(r["new_tokens"]), r["approach"], f"{r['seconds']:.2f}",
                    f"{r['tokens_per_second']:.1f}", f"{r['kv_mib']:.1f}",
                    "" if r["forest_speedup"] is None else f"{r['forest_speedup']:.2f}",
                    "" if r["step_ms"] is None else f"{r['step_ms']:.1f}",
                    "" if r["reference_step_ms"] is None else f"{r['reference_step_ms']:.1f}",
                    "" if r["step_vs_reference"] is None else f"{r['step_vs_reference']:.2f}",
                    _bandwidth_cell(r),
                    {True: "yes", False: "NO", None: ""}[r["same_tokens_as_forest"]],
                    "" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}",
                    "" if r["drafts_accepted"] is None else f"{100 * r['drafts_accepted']:.0f}%")
    wide = None if sys.stdout.isatty() else 200  # a pipe or file gets every column, not an 80-column crop
    Console(width=wide).print(out)
    steps = [r for r in table if r["step_vs_reference"] is not None and r["approach"] == "forest"]
    if steps:
        ratios = ", ".join(f"{r['branches']} branch{'es' if r['branches'] > 1 else ''} {r['step_vs_reference']:.2f}x"
                           for r in steps)
        Console(width=wide).print(f"forest step against transformers' own single-sequence step (stock kernels, same context): "
                        f"{ratios}")
    Console(width=wide).print(note)


def _bandwidth_cell(row: dict) -> str:
    """What a decode step reads per second, and the share of the peak bandwidth when known."""
    if row["step_read_gbps"] is None:
        return ""
    share = row["step_bandwidth_fraction"]
    return f"{row['step_read_gbps']:.1f}" + ("" if share is None else f" ({100 * share:.0f}%)")


def _markdown_report(facts: dict, command: str, table: str) -> str:
    machine = ", ".join(f"{k} {v}" for k, v in facts.items())
    return f"Command: `{command}`\n\nMachine: {machine}\n\n{table}"


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise UsageError(f"{option} takes comma-separated whole numbers, not '{text}'", fix=f"e.g. {option} 1,8") from error
    if not values or min(values) < 1:
        raise UsageError(f"{option} needs positive numbers", fix=f"e.g. {option} 1,8")
    return values


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise UsageError("--plot needs matplotlib", fix="pip install matplotlib") from error
