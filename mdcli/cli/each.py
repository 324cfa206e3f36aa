"""`mdcli ask-many --each` and `mdcli margins --each`: the same questions about every document on its own.

Answers go to stdout per (document, question); `--output FILE.jsonl` also appends each finished
document there, and a rerun with the same file skips what it holds. `--workers N` / `--ray-address`
spread the documents over Ray actors (mdcli/distributed/, the optional `ray` extra).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import Output, _is_terminal, header, load, read_stdin_bytes
from mdcli.cli.groups import Group
from mdcli.cli.options import LoadFlags, OutputFlags
from mdcli.errors import UsageError

OUTPUT_MODES = tuple(mode.value for mode in Output)
RAY_EXTRA = 'pip install "mdcli[ray]"'

EachOutputOpt = Annotated[
    str,
    typer.Option(
        "--output", "-o",
        help="auto (live panels on a terminal, plain text otherwise) | live | plain | jsonl | json; with --each, "
        "a FILE.jsonl each finished document is appended to (a rerun skips what it holds).",
    ),
]
EachOpt = Annotated[
    bool,
    typer.Option("--each", help="Ask the questions of every document on its own (its answers those of the command "
                 "on that file alone), not of all documents as one context."),
]
BudgetTokensOpt = Annotated[
    Optional[int],
    typer.Option("--budget-tokens", min=1, show_default=False,
                 help="With --each: most cache tokens in one forest of documents (default: 2048 on a CPU, a "
                 "few documents; on a GPU what a quarter of its free memory holds)."),
]
WorkersOpt = Annotated[
    Optional[int],
    typer.Option("--workers", show_default=False,
                 help=f"With --each: N Ray actors on a local Ray cluster, each loading the model once ({RAY_EXTRA})."),
]
RayAddressOpt = Annotated[
    Optional[str],
    typer.Option("--ray-address", show_default=False,
                 help="With --each: join this Ray cluster (e.g. auto, or ray://host:10001) instead of starting one; "
                 "an actor per CPU of it unless --workers."),
]


@dataclass(frozen=True)
class EachFlags:
    """--each and the options that go with it (--output is each command's own: it stands in for
    OutputFlags' field, mdcli/cli/groups.py): one group (mdcli/cli/groups.py) for every command
    that asks its questions of each document (ask-many, margins, run)."""

    each: EachOpt = False
    budget_tokens: BudgetTokensOpt = None
    workers: WorkersOpt = None
    ray_address: RayAddressOpt = None

    def destination(self, output: str) -> tuple[Output, Path | None]:
        """--output (the command's own option, EachOutputOpt, standing in for OutputFlags'): the output
        mode, and with --each the .jsonl file results are appended to; --budget-tokens, --workers and
        --ray-address refused without --each."""
        found = split_output(output, self.each)
        if not self.each and (self.budget_tokens is not None or self.workers is not None or self.ray_address is not None):
            raise UsageError("--budget-tokens, --workers and --ray-address go with --each", fix="add --each")
        return found


EACH = Group(EachFlags)


def split_output(value: str, each: bool) -> tuple[Output, Path | None]:
    """--output: a mode name, or (with --each) the .jsonl file results are appended to."""
    if value in OUTPUT_MODES:
        return Output(value), None
    if not each:
        raise UsageError(f"--output {value} is no output mode ({' | '.join(OUTPUT_MODES)})",
                         fix="give a mode, or add --each to append results to that file")
    return Output.auto, Path(value)


def answer(ctx: typer.Context, sources: list[str], job, mode: Output, results: Path | None, announced: bool, ask, *,
           loading: LoadFlags, options, out: OutputFlags, each_run: EachFlags, **shown) -> None:
    """A command's job answered: with --each over every document on its own (`run_each`), else
    once: the model loaded, `ask(model, job, options=options)`'s events rendered in `mode` (with
    `shown`, the command's own rendering flags)."""
    mode = out.mode(mode)
    if each_run.each:
        run_each(ctx, sources, job, mode, results, announced, loading=loading, options=options, out=out,
                 each_run=each_run)
        return
    lm = load(loading.options(out, announced=announced))
    out.render(ask(lm, job, options=options), mode, lm, **shown)


def run_each(ctx: typer.Context, sources: list[str], job, mode: Output, results: Path | None, announced: bool, *,
             loading: LoadFlags, options, out: OutputFlags, each_run: EachFlags, base: Path | None = None,
             prompt_cache: str = "off") -> None:
    """Read every document (bad files become error records), skip those `results` already holds,
    answer the rest here or on Ray, and write them; exit 1 when some document failed. `options`:
    the run's api.RunOptions; `base`: the folder relative sources start from (a recipe's).

    The prompt cache is `prompt_cache` (off, or a recipe's) unless --prompt-cache is typed: kept per document it would write each
    one's keys and values (about 30 MB for a 500-token file on the embedded model), and a folder
    of a few hundred would push every other entry out of its 2 GiB."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
    # lazy: the --each writer is needed only here
    from mdcli.render.each import EachWriter, ResultsFile, answered_keys

    workers, ray_address, budget_tokens = each_run.workers, each_run.ray_address, each_run.budget_tokens
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1 (got {workers})", fix="use a positive number")
    inputs = api.read_inputs(sources, read_stdin=read_stdin_bytes, base=base, lenient=True)
    questions = len(set(job.questions)) or 1  # margins with one --query and no questions list
    answered = answered_keys(results, questions) if results is not None else set()
    kind = "plain" if mode in (Output.auto, Output.live, Output.plain) else mode.value
    terminal = _is_terminal(sys.stderr)
    on_ray = workers is not None or ray_address is not None
    if on_ray:
        # lazy: Ray (an optional extra) is imported only for --workers / --ray-address
        from mdcli.distributed import ray_each

        if not ray_each.available():
            raise UsageError("--workers and --ray-address need Ray, which is not installed", fix=RAY_EXTRA)
    results_file = ResultsFile(results) if results is not None else None  # unwritable: said before the model loads
    typed = ctx.get_parameter_source("prompt_cache")
    cache = loading.prompt_cache if typed is not None and typed.name not in ("DEFAULT", "DEFAULT_MAP") else prompt_cache
    load_options = loading.options(out, announced=announced, prompt_cache=cache)
    writer_header = None
    if on_ray:
        events = ray_each.ask_each_on_ray(
            load_options.model_copy(update={"progress": None}), job, inputs, answered=answered, workers=workers,
            address=ray_address, budget_tokens=budget_tokens, run_options=options,
        )
    else:
        lm = load(load_options)
        writer_header = header(lm, out.verbose)
        events = api.ask_each(lm, inputs, job, answered=answered, budget_tokens=budget_tokens, options=options)
    writer = EachWriter(kind, sys.stdout, sys.stderr, quiet=out.quiet, progress=out.progress,
                        header=writer_header, results=results_file,
                        terminal=terminal)
    interrupted = False
    try:
        for event in events:
            writer.handle(event)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        writer.close(interrupted)
    if writer.failed:
        raise typer.Exit(1)
