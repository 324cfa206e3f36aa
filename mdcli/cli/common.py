"""Options and plumbing shared by every command: loading, rendering, errors, input files.

The shared options themselves are declared once, in mdcli/cli/options.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from enum import Enum
from pathlib import Path

import typer

from mdcli.errors import MdcliError, UsageError


class Output(str, Enum):
    auto = "auto"
    live = "live"
    plain = "plain"
    jsonl = "jsonl"
    json = "json"


# -- helpers ------------------------------------------------------------------------------

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"  # models.embedded.EMBEDDED_NAME (a test checks they agree)


def command_group(name: str, help: str, **settings) -> typer.Typer:
    """A Typer app for `mdcli` or one of its groups of subcommands (`mdcli cache ...`), with the
    settings every one shares: help when called bare, no shell completion, no rich tracebacks
    (errors are one line: `errors`), plain help text."""
    return typer.Typer(name=name, help=help, no_args_is_help=True, add_completion=False,
                       pretty_exceptions_enable=False, rich_markup_mode=None, **settings)


def output_mode(output: Output, *, jsonl: bool = False, plain: bool = False, json: bool = False) -> Output:
    """--output, or one of its short spellings (--jsonl, --json, --plain); two different ones are refused."""
    chosen = {mode for mode, given in ((Output.jsonl, jsonl), (Output.json, json), (Output.plain, plain)) if given}
    if output != Output.auto:
        chosen.add(output)
    if len(chosen) > 1:
        names = " and ".join(sorted(mode.value for mode in chosen))
        raise UsageError(f"two output modes were given ({names})", fix="give one of --output, --jsonl, --json, --plain")
    return chosen.pop() if chosen else Output.auto


def announce_loading(model: str | None, quiet: bool, progress: bool = False) -> bool:
    """On a terminal (or with --progress), say which model loads before torch and transformers are
    imported (about 3 s on a CPU host: docs/performance.md#start-up), so the first seconds are not
    silent; returns whether it did. A command that does not call this has the loader say it, on a
    terminal or with --progress only. `LoadFlags.options(..., announced=True)` drops the loader's own
    line about the same model."""
    if quiet or not (progress or _is_terminal(sys.stderr)):
        return False
    stderr_line(f"loading {model or EMBEDDED_NAME}...")
    return True


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def constraint_from_flags(choices: list[str] | None, regex: str | None, schema: str | None):
    """--choices / --regex / --schema as an api.Constraint (None when none is given), checked here,
    before any model loads. --schema names a file when one exists at that path."""
    choices = list(choices) if choices else None  # typer hands an option never given as an empty list
    if choices is None and regex is None and schema is None:
        return None
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    given = {name: value for name, value in (("choices", choices), ("regex", regex), ("schema", schema)) if value is not None}
    if len(given) > 1:
        flags = ", ".join(f"--{name}" for name in given)
        raise UsageError(f"{flags} were given together; an answer takes one constraint", fix="keep one of them")
    if schema is not None and not schema.lstrip().startswith("{"):
        if Path(schema).is_file():
            given["schema"] = Path(schema).read_text(encoding="utf-8")
        elif schema.endswith(".json") or "/" in schema:
            raise UsageError(f"the schema file '{schema}' does not exist", fix="give an existing file, JSON, or 'name, age int'")
    return api.Constraint(**given)


def read_document(source: str) -> str:
    """Read a document file (or stdin for '-') as UTF-8, with a usable message on any failure."""
    if source == "-":
        data, name = read_stdin_bytes(), "stdin"
    else:
        path = Path(source)
        if not path.exists():
            raise UsageError(f"document '{source}' does not exist", fix="check the path, or use - for stdin")
        if path.is_dir():
            raise UsageError(f"document '{source}' is a folder", fix="give a text file")
        try:
            data = path.read_bytes()
        except OSError as error:
            raise UsageError(f"cannot read '{source}': {error.strerror}", fix="check its permissions") from error
        name = f"'{source}'"
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    return api.named_text(data, name)  # one decoding rule for every document (mdcli/documents)


def read_stdin_bytes() -> bytes:
    """What is piped to stdin, for a document given as '-'."""
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("the document is '-' but nothing is piped to stdin", fix="pipe a file in or give a path")
    return sys.stdin.buffer.read()


def read_inputs(sources: list[str], base: Path | None = None) -> list:
    """Files, folders, globs and '-' as documents (api.Document: path + text); one line on
    stderr for each file a folder or glob held that is not text."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    inputs = api.read_inputs(sources, read_stdin=read_stdin_bytes, base=base)
    for skipped in inputs.skipped:
        stderr_line(skipped.line())
    return inputs.documents


def read_questions_file(path: Path | None) -> list[str]:
    if path is None:
        return []
    return [line.strip() for line in read_document(str(path)).splitlines() if line.strip()]


def speculate_setting(value: str | None):
    """--speculate checked before the model loads (None: not given, auto)."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    return api.parse_speculate(value)


def sampling_params(temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None):
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    try:
        return api.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    except ValueError as error:
        raise UsageError(str(error), fix="see mdcli --help") from error


def load(options):
    """Load the model `options` (api.LoadOptions) name; transformers' own bars and warnings are
    always silenced: they are noise next to our one-line progress."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    return api.load_model(options.model_copy(update={"quiet": True}))


def stderr_line(message: str) -> None:
    print(f"mdcli: {message}", file=sys.stderr, flush=True)


def header(lm, verbose: bool = False) -> str:
    """The run's header line: model, device, dtype (and why). With `verbose`, the kernel plan
    chosen at load and its reasons too (all of it: `mdcli info`)."""
    dtype = str(lm.dtype).removeprefix("torch.")
    line = f"{lm.name} · {lm.device} · {dtype} ({lm.dtype_reason})"
    if not verbose:
        return line
    if lm.cpu_weights == "int8":  # the products run on torch's int8 kernel whatever the float32 routing
        return f"{line} · {lm.attn} · kernels torch int8 weight-only (bf16 activations)"
    return f"{line} · {lm.attn} · kernels {lm.forward.describe()}"


def check_progress(quiet: bool, progress: bool) -> None:
    """--progress asks for lines that --quiet forbids: refuse rather than drop one of them."""
    if quiet and progress:
        raise UsageError("--progress and --quiet contradict each other", fix="give one of them")


def render(events: Iterable, mode: Output, quiet: bool, header: str, progress: bool = False, *,
           show_margins: bool = False) -> None:
    """Feed events to the renderer; on Ctrl-C flush what was generated and exit 130."""
    from mdcli.render import choose_renderer  # lazy: rich costs `mdcli --help` ~50 ms

    renderer = choose_renderer(
        mode.value,
        stdout=sys.stdout,
        stderr=sys.stderr,
        quiet=quiet,
        no_color=False,  # NO_COLOR itself is read by the renderer, through mdcli.settings
        header=header,
        progress=progress,
        show_margins=show_margins,
    )
    try:
        for event in events:
            renderer.handle(event)
    except KeyboardInterrupt:
        renderer.interrupted()
        raise
    finally:  # also on an error mid-run: a status line or live display must not outlive it
        renderer.close()


class errors:
    """Turn every failure into one line on stderr and the right exit code."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, (typer.Exit, SystemExit)):
            return False
        if isinstance(error, KeyboardInterrupt):
            stderr_line("interrupted")
            raise typer.Exit(130)
        if isinstance(error, BrokenPipeError):
            silence_stdout()
            raise typer.Exit(0)
        if self.debug:
            return False
        if isinstance(error, MdcliError):
            print(f"mdcli: error: {error.line()}", file=sys.stderr)
            raise typer.Exit(error.exit_code)
        print(f"mdcli: error: {type(error).__name__}: {_one_line(error)} (rerun with --debug for details)", file=sys.stderr)
        raise typer.Exit(1)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] + ("…" if len(text) > 300 else "")


def silence_stdout() -> None:
    """After a closed pipe (`| head`), point stdout at /dev/null so the final flush can't fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
