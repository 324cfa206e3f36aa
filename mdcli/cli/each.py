"""`mdcli ask-many --each`: the same questions about every document, one tree per document.

Answers go to stdout per (document, question); `--output FILE.jsonl` also appends each finished
document there, and a rerun with the same file skips what it holds. `--workers N` / `--ray-address`
spread the documents over Ray actors (mdcli/distributed/, the optional `ray` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mdcli.cli.common import Output, _is_terminal, header, load, load_options, read_stdin_bytes
from mdcli.errors import UsageError

OUTPUT_MODES = tuple(mode.value for mode in Output)
RAY_EXTRA = 'pip install "mdcli[ray]"'


def split_output(value: str, each: bool) -> tuple[Output, Path | None]:
    """--output: a mode name, or (with --each) the .jsonl file results are appended to."""
    if value in OUTPUT_MODES:
        return Output(value), None
    if not each:
        raise UsageError(f"--output {value} is no output mode ({' | '.join(OUTPUT_MODES)})",
                         fix="give a mode, or add --each to append results to that file")
    return Output.auto, Path(value)


def run_each(params: dict, job, mode: Output, results: Path | None, announced: bool) -> None:
    """Read every document (bad files become error records), skip those `results` already holds,
    answer the rest here or on Ray, and write them; exit 1 when some document failed."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
    # lazy: the --each writer is needed only here
    from mdcli.render.each import EachWriter, ResultsFile, answered_keys

    workers, address = params["workers"], params["ray_address"]
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1 (got {workers})", fix="use a positive number")
    inputs = api.read_inputs(params["document"], read_stdin=read_stdin_bytes, lenient=True)
    answered = answered_keys(results, len(set(job.questions))) if results is not None else set()
    kind = "plain" if mode in (Output.auto, Output.live, Output.plain) else mode.value
    terminal = _is_terminal(sys.stderr)
    on_ray = workers is not None or address is not None
    if on_ray:
        # lazy: Ray (an optional extra) is imported only for --workers / --ray-address
        from mdcli.distributed import ray_each

        if not ray_each.available():
            raise UsageError("--workers and --ray-address need Ray, which is not installed", fix=RAY_EXTRA)
    results_file = ResultsFile(results) if results is not None else None  # unwritable: said before the model loads
    options = load_options(params, announced=announced)
    writer_header = None
    if on_ray:
        events = ray_each.ask_each_on_ray(
            options.model_copy(update={"progress": None}), job, inputs, answered=answered, workers=workers,
            address=address, budget_tokens=params["budget_tokens"], max_forward_tokens=params["max_forward_tokens"],
            speculate=params["speculate"],
        )
    else:
        lm = load(options)
        writer_header = header(lm, params["verbose"])
        events = api.ask_each(lm, inputs, job, answered=answered, budget_tokens=params["budget_tokens"],
                              max_forward_tokens=params["max_forward_tokens"], speculate=params["speculate"])
    writer = EachWriter(kind, sys.stdout, sys.stderr, quiet=params["quiet"], progress=params["progress"],
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
