"""Options and plumbing shared by every command: loading, rendering, errors, input files.

Shared options are `Annotated` aliases declared on each command (Typer options on the app callback
would have to come before the subcommand name).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.errors import MdcliError, UsageError


class Output(str, Enum):
    auto = "auto"
    live = "live"
    plain = "plain"
    jsonl = "jsonl"
    json = "json"


# -- options shared by every generating command (declared per command: see architecture notes) --

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        envvar="MDCLI_MODEL",
        help="Hugging Face id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
        show_default=False,
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto | cpu | cuda | cuda:N (auto: $MDCLI_DEVICE if set, else CUDA when present)."),
]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="auto | float32 | bfloat16 | float16 (auto: bf16 on capable CUDA, fp32 on CPU).")
]
AttnOpt = Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa | eager.")]
FourBitOpt = Annotated[bool, typer.Option("--load-in-4bit", help="bitsandbytes 4-bit weights (CUDA only).")]
EightBitOpt = Annotated[bool, typer.Option("--load-in-8bit", help="bitsandbytes 8-bit weights (CUDA only).")]
CpuWeightsOpt = Annotated[
    str,
    typer.Option("--cpu-weights", help="float32 | int8: int8 quantizes the projections for CPU decoding (a quarter "
                 "of the bytes per step; exact up to near-ties, as bf16)."),
]
DeviceMapOpt = Annotated[
    Optional[str], typer.Option("--device-map", help="Passed to from_pretrained, e.g. 'auto' (accelerate).")
]
RemoteCodeOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow a hub model's own Python code to run. Off by default.")
]
MaxNewOpt = Annotated[
    int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens generated per branch, in every phase.")
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy (exact, default).")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (1 = off).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Keep the k most likely tokens (0 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below min-p x top prob.")]
SeedOpt = Annotated[
    Optional[int], typer.Option("--seed", help="Sampling seed; each branch gets its own stream from it.")
]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop a branch at this text, cut from the answer with the whitespace before it (repeatable).")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="System prompt.")]
NoChatOpt = Annotated[
    bool, typer.Option("--no-chat-template", help="Feed plain text even if the model has a chat template.")
]
OutputOpt = Annotated[
    Output,
    typer.Option(
        "--output", "-o",
        help="auto (live panels on a terminal, plain text otherwise) | live | plain | jsonl | json. Every mode "
        "prints the same answers: live and plain the same text on stdout; jsonl and json the same records.",
    ),
]
JsonlOpt = Annotated[
    bool, typer.Option("--jsonl", help="Same as --output jsonl: one JSON event per line, then an `answers` line.")
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Same as --output json: one JSON document at the end, every answer in question order."),
]
PlainOpt = Annotated[bool, typer.Option("--plain", help="Same as --output plain: plain text even on a terminal.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress or summary on stderr.")]
ProgressOpt = Annotated[
    bool,
    typer.Option(
        "--progress",
        help="Progress lines on stderr (prefill tokens, finished branches) every few seconds even when it is not "
        "a terminal, e.g. a log file (a terminal always shows a status line).",
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", help="Also name the kernel plan chosen at load in the header (all of it: mdcli info).")
]
SpeculateOpt = Annotated[
    str,
    typer.Option(
        "--speculate",
        help="Speculative decoding: auto | off | N (most draft tokens per branch per step). Drafts come from "
        "the text each branch reads; the model verifies them, so the tokens never change, only the forwards. "
        "auto guesses only where its measured costs say a guess saves time: on one CPU core it pays for long "
        "answers that quote their sources; on a GPU, where a wider forward costs about what a plain one does, "
        "every branch guesses; elsewhere it stays within a few percent of off.",
    ),
]
PromptCacheOpt = Annotated[
    str,
    typer.Option(
        "--prompt-cache",
        help="auto | off | DIR: keep the keys and values of the prompts' shared start (the document) on disk and "
        "reuse them in a later run over the same start, for the same model, dtype and kernels; the tokens never "
        "change. auto: mdcli's cache folder (MDCLI_PROMPT_CACHE_DIR), capped at MDCLI_PROMPT_CACHE_MB.",
    ),
]
DocumentsArg = Annotated[
    list[str],
    typer.Argument(
        help="Documents: files, folders (read recursively, text files only, sorted), globs, or - for stdin.",
        show_default=False, metavar="DOCUMENTS",
    ),
]
RetrieveOpt = Annotated[
    Optional[int],
    typer.Option(
        "--retrieve", min=1, show_default=False,
        help="Give each question only its K best passages (BM25), tagged [n] path:lines and listed as its Sources. "
        "Default: every question reads every document.",
    ),
]
ChunkTokensOpt = Annotated[
    int,
    typer.Option("--chunk-tokens", min=16, help="With --retrieve: most tokens in one passage (cut on paragraphs, then lines)."),
]
ChunkOpt = Annotated[
    int, typer.Option("--max-forward-tokens", min=16, help="Largest number of new tokens fed in one forward pass.")
]


# -- helpers ------------------------------------------------------------------------------

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"  # models.embedded.EMBEDDED_NAME (a test checks they agree)


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
    terminal or with --progress only. `load_options(..., announced=True)` drops the loader's own
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


ChoicesOpt = Annotated[
    Optional[list[str]],
    typer.Option("--choices", help="The answer is exactly one of these (repeatable: --choices A --choices B).",
                 show_default=False),
]
RegexOpt = Annotated[
    Optional[str], typer.Option("--regex", help="The answer matches this regular expression in full.", show_default=False)
]
SchemaOpt = Annotated[
    Optional[str],
    typer.Option("--schema", help="The answer is JSON valid under this schema: a file, JSON, or llm's concise form "
                 "'name, age int'. Plain output is the JSON alone, one document per line.", show_default=False),
]


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


def load_options(params: dict, **overrides):
    """A command's loading flags (its `ctx.params` or locals, by name) as api.LoadOptions, with
    `overrides` on top. `quiet`: progress lines on stderr unless it is set."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    names = ("model", "device", "dtype", "attn", "load_in_4bit", "load_in_8bit", "device_map", "trust_remote_code",
             "cpu_weights", "prompt_cache")
    fields = {name: params[name] for name in names if name in params}
    quiet = overrides.pop("quiet", params.get("quiet", False))
    announced = overrides.pop("announced", False)  # announce_loading said it: drop the loader's own line
    # the loading line is progress: on a terminal or with --progress only (docs/cli.md); the loader's
    # other lines (the embedded model's one-time conversion) always show
    says_loading = not announced and (params.get("progress", False) or _is_terminal(sys.stderr))
    progress = stderr_line if says_loading else _without_loading_line
    return api.LoadOptions(**{**fields, **overrides}, progress=None if quiet else progress)


def _without_loading_line(message: str) -> None:
    if not message.startswith("loading "):
        stderr_line(message)


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
