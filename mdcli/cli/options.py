"""The shared options, declared once: the three groups commands take, and the few options that
commands declare for themselves, outside a group.

`LoadFlags` (which model, where, how), `DecodeFlags` (what is decoded and how: sampling,
budgets, constraint, prompt, the engine's options) and `OutputFlags` (what is shown) are option
groups (mdcli/cli/groups.py): a command takes a group with `takes(...)` and is handed one object,
filled once from the flags. A new shared option is one field of one of these dataclasses: its
type, its Typer option and its default in one declaration. Options that a single command has
stay in that command's module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from mdcli.cli.common import (
    Output, _is_terminal, check_progress, constraint_from_flags, header, output_mode, render, sampling_params,
    stderr_line,
)
from mdcli.cli.groups import UNSET, Group, offered

# -- options that commands declare for themselves -------------------------------------------------

DocumentsArg = Annotated[list[str], typer.Argument(
    help="Documents: files, folders (read recursively, text files only, sorted), globs, or - for stdin.",
    metavar="DOCUMENTS")]
QuestionsFileOpt = Annotated[Optional[Path], typer.Option(
    "--questions-file", help="More questions, one per line (blank lines skipped).")]
RetrieveOpt = Annotated[Optional[int], typer.Option(
    "--retrieve", min=1, help="Give each question only its K best passages (BM25), tagged [n] path:lines and listed "
    "as its Sources. Default: every question reads every document.")]
ChunkTokensOpt = Annotated[int, typer.Option(
    "--chunk-tokens", min=16, help="With --retrieve: most tokens in one passage (cut on paragraphs, then lines).")]
SaveRecipeOpt = Annotated[Optional[Path], typer.Option(
    "--save-recipe", help="Write these settings as a recipe YAML, then run as usual.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


# -- the groups ----------------------------------------------------------------------------------


class CudaGraphs(str, Enum):
    auto = "auto"
    off = "off"
    static = "static"


@dataclass(frozen=True)
class LoadFlags:
    """Model loading: the fields of api.LoadOptions that the command line sets."""

    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", envvar="MDCLI_MODEL",
        help="Hugging Face id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")] = None
    device: Annotated[str, typer.Option(
        "--device", help="auto | cpu | cuda | cuda:N (auto: $MDCLI_DEVICE if set, else CUDA when present).")] = "auto"
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto | float32 | bfloat16 | float16 (auto: bf16 on capable CUDA, fp32 on CPU).")] = "auto"
    attn: Annotated[str, typer.Option("--attn", help="Attention kernel: sdpa | eager.")] = "sdpa"
    load_in_4bit: Annotated[bool, typer.Option(
        "--load-in-4bit", help="bitsandbytes 4-bit weights (CUDA only).")] = False
    load_in_8bit: Annotated[bool, typer.Option(
        "--load-in-8bit", help="bitsandbytes 8-bit weights (CUDA only).")] = False
    cpu_weights: Annotated[str, typer.Option(
        "--cpu-weights", help="float32 | int8: int8 quantizes the projections for CPU decoding (a quarter of the "
        "bytes per step; exact up to near-ties, as bf16).")] = "float32"
    prompt_cache: Annotated[str, typer.Option(
        "--prompt-cache", help="auto | off | DIR: keep the keys and values of the prompts' shared start (the "
        "document) on disk and reuse them in a later run over the same start, for the same model, dtype and kernels; "
        "the tokens never change. auto: mdcli's cache folder (MDCLI_PROMPT_CACHE_DIR), capped at "
        "MDCLI_PROMPT_CACHE_MB.")] = "auto"
    device_map: Annotated[Optional[str], typer.Option(
        "--device-map", help="Passed to from_pretrained, e.g. 'auto' (accelerate).")] = None
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Allow a hub model's own Python code to run. Off by default.")] = False
    cuda_graphs: Annotated[Optional[CudaGraphs], typer.Option(
        "--cuda-graphs", case_sensitive=False, help="auto: decode steps of up to 64 tokens on CUDA replayed as CUDA "
        "graphs; off: launched one by one; static: the same buffers, never captured (default: MDCLI_CUDA_GRAPHS, "
        "else auto).")] = None

    def options(self, out: OutputFlags | None = None, *, announced: bool = False, **overrides: Any):
        """These flags as api.LoadOptions, with `overrides` on top (a field the command does not
        offer keeps the API's default). Progress lines on stderr unless --quiet; the loading line
        only on a terminal or with --progress (docs/cli.md), and not when `announced`
        (announce_loading said it); the loader's other lines (the embedded model's one-time
        conversion) always show."""
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        quiet = overrides.pop("quiet", _flag(out, "quiet"))
        says_loading = not announced and (_flag(out, "progress") or _is_terminal(sys.stderr))
        progress = stderr_line if says_loading else _without_loading_line
        given = {name: value.value if isinstance(value, Enum) else value for name, value in offered(self).items()}
        return api.LoadOptions(**{**given, **overrides}, progress=None if quiet else progress)


@dataclass(frozen=True)
class DecodeFlags:
    """What is decoded and how: budget, sampling, stops, constraint, prompt, and the engine's
    options (api.RunOptions' fields, by the same names)."""

    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Most tokens generated per branch, in every phase.")] = 256
    temperature: Annotated[float, typer.Option(
        "--temperature", "-t", min=0.0, help="0 = greedy (exact, default).")] = 0.0
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (1 = off).")] = 1.0
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Keep the k most likely tokens (0 = off).")] = 0
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below min-p x top prob.")] = 0.0
    seed: Annotated[Optional[int], typer.Option(
        "--seed", help="Sampling seed; each branch gets its own stream from it.")] = None
    stop: Annotated[Optional[list[str]], typer.Option(
        "--stop", help="Stop a branch at this text, cut from the answer with the whitespace before it "
        "(repeatable).")] = None
    choices: Annotated[Optional[list[str]], typer.Option(
        "--choices", help="The answer is exactly one of these (repeatable: --choices A --choices B).")] = None
    regex: Annotated[Optional[str], typer.Option(
        "--regex", help="The answer matches this regular expression in full.")] = None
    schema: Annotated[Optional[str], typer.Option(
        "--schema", help="The answer is JSON valid under this schema: a file, JSON, or llm's concise form "
        "'name, age int'. Plain output is the JSON alone, one document per line.")] = None
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Feed plain text even if the model has a chat template.")] = False
    max_forward_tokens: Annotated[int, typer.Option(
        "--max-forward-tokens", min=16, help="Largest number of new tokens fed in one forward pass.")] = 1024
    speculate: Annotated[str, typer.Option(
        "--speculate", help="Speculative decoding: auto | off | N (most draft tokens per branch per step). Drafts "
        "come from the text each branch reads; the model verifies them, so the tokens never change, only the "
        "forwards. auto guesses only where its measured costs say a guess saves time: on one CPU core it pays for "
        "long answers that quote their sources; on a GPU, where a wider forward costs about what a plain one does, "
        "every branch guesses; elsewhere it stays within a few percent of off.")] = "auto"

    def sampling(self):
        """--temperature, --top-p, --top-k, --min-p, --seed as api.SamplingParams."""
        return sampling_params(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)

    def constraint(self):
        """--choices / --regex / --schema as an api.Constraint, or None."""
        return constraint_from_flags(self.choices, self.regex, self.schema)

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def run_options(self, **fields: Any):
        """The engine's options as api.RunOptions: every RunOptions field this command offers (a
        --speculate left None, `mdcli run`'s "not given", is the recipe's, else auto), `fields` on
        top. A bad value is a usage error, here, before the model loads."""
        from mdcli.api import RunOptions  # lazy: pydantic costs `mdcli --help` ~150 ms

        given = {name: value for name, value in offered(self).items()
                 if name in RunOptions.model_fields and value is not None}
        return RunOptions(**{**given, **fields})


@dataclass(frozen=True)
class OutputFlags:
    """What is shown, and where."""

    output: Annotated[Output, typer.Option(
        "--output", "-o", help="auto (live panels on a terminal, plain text otherwise) | live | plain | jsonl | json. "
        "Every mode prints the same answers: live and plain the same text on stdout; jsonl and json the same "
        "records.")] = Output.auto
    jsonl: Annotated[bool, typer.Option(
        "--jsonl", help="Same as --output jsonl: one JSON event per line, then an `answers` line.")] = False
    as_json: Annotated[bool, typer.Option(
        "--json", help="Same as --output json: one JSON document at the end, every answer in question "
        "order.")] = False
    plain: Annotated[bool, typer.Option(
        "--plain", help="Same as --output plain: plain text even on a terminal.")] = False
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress or summary on stderr.")] = False
    progress: Annotated[bool, typer.Option(
        "--progress", help="Progress lines on stderr (prefill tokens, finished branches) every few seconds even when "
        "it is not a terminal, e.g. a log file (a terminal always shows a status line).")] = False
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="Also name the kernel plan chosen at load in the header (all of it: mdcli info).")] = False
    debug: DebugOpt = False

    def mode(self, output: Output | None = None) -> Output:
        """The output mode: --output (or `output`, what the command made of it) or one of its short
        spellings; and --progress checked against --quiet."""
        mode = output_mode(self.output if output is None else output, jsonl=self.jsonl, plain=self.plain,
                           json=self.as_json)
        check_progress(self.quiet, self.progress)
        return mode

    def render(self, events, mode: Output, lm, *, show_margins: bool = False) -> None:
        render(events, mode, self.quiet, header=header(lm, self.verbose), progress=self.progress,
               show_margins=show_margins)


def _flag(out: OutputFlags | None, name: str) -> bool:
    value = False if out is None else getattr(out, name)
    return False if value is UNSET else bool(value)


def _without_loading_line(message: str) -> None:
    if not message.startswith("loading "):
        stderr_line(message)


# What the commands take. A command offers part of a group with .only / .without, other defaults
# with .defaults, or declares a field as its own option (mdcli/cli/groups.py).
LOAD = Group(LoadFlags)
DECODE = Group(DecodeFlags)
OUTPUT = Group(OutputFlags)
# beam search and explain: the prompt and the forward budget; no sampling, stop, constraint or
# speculation (beam has its own -n; explain its own --speculate N, one step drawn)
UNSAMPLED = DECODE.without("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "choices",
                           "regex", "schema", "speculate")
