"""`mdcli think`: parallel chains of thought (Map / Process / Reduce) on an unmodified model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import (
    Output, announce_loading, errors, load, read_document, read_inputs, sampling_params, stderr_line,
)
from mdcli.cli.flags import in_flags
from mdcli.cli.groups import takes
from mdcli.cli.options import DECODE, LOAD, OUTPUT, DecodeFlags, LoadFlags, OutputFlags
from mdcli.errors import UsageError

_QUESTION_FILE_SUFFIXES = (".txt", ".md", ".text")


class MergeMode(str, Enum):
    reencode = "reencode"
    attend = "attend"
    none = "none"


@takes(loading=LOAD, decoding=DECODE, out=OUTPUT)
def think(
    question: Annotated[str, typer.Argument(help="The question: text, a file holding it, or - for stdin.")],
    paths: Annotated[Optional[int], typer.Option(
        "--paths", help="Independent paths (default 4, or one per --path-instruction). With --plan: how many plain "
        "paths to run if the outline cannot be parsed.")] = None,
    context: Annotated[Optional[list[str]], typer.Option(
        "--context", "-c", help="Documents the question is about, read before it: files, folders (text files, "
        "sorted), globs, or - for stdin (repeatable; several each under a '# path' line).")] = None,
    plan: Annotated[bool, typer.Option(
        "--plan", help="The model first writes a numbered outline; one path per item.")] = False,
    max_paths: Annotated[int, typer.Option("--max-paths", help="Most outline items used as paths (--plan).")] = 8,
    merge: Annotated[Optional[MergeMode], typer.Option(
        "--merge", help="How the conclusion reads the paths. reencode (default, exact): their texts go into one prompt "
        "after the cached question. attend (approximate): it attends to every path's cache directly, Multiverse-style. "
        "none: no conclusion (the default with --vote).")] = None,
    vote: Annotated[bool, typer.Option(
        "--vote", help="Self-consistency: extract each path's final answer and report the majority.")] = False,
    answer_pattern: Annotated[Optional[str], typer.Option(
        "--answer-pattern", help="Regex for a path's answer with --vote (last match; group 'answer', else group 1, "
        "else the match). Default: the text after the last 'Answer:' / 'answer is', else the last number. With --vote "
        "each path decodes under it: any text that ends in a match.")] = None,
    path_instruction: Annotated[Optional[list[str]], typer.Option(
        "--path-instruction", help="An instruction for one path, e.g. 'Work backwards.' (repeatable; dealt out to the "
        "paths in turn).")] = None,
    plan_tokens: Annotated[Optional[int], typer.Option(
        "--plan-tokens", min=1, help="Most tokens for the outline (--plan). Default: 128, at most -n.")] = None,
    conclusion_tokens: Annotated[Optional[int], typer.Option(
        "--conclusion-tokens", min=1, help="Most tokens for the conclusion. Default: -n.")] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Most tokens per branch in every phase: each path, the outline (at most "
        "128) and the conclusion, unless --plan-tokens or --conclusion-tokens is given.")] = 256,
    temperature: Annotated[Optional[float], typer.Option(
        "--temperature", "-t", min=0.0, help="Sampling temperature of the paths. Default: 0.7 with --seed 0 when "
        "several paths share one prompt (no --plan, no --path-instruction), since greedy paths would be copies of "
        "one; else 0 (greedy, exact).")] = None,
    greedy: Annotated[bool, typer.Option(
        "--greedy", help="Greedy paths, as -t 0: exact, each path model.generate's answer.")] = False,
    save_recipe: Annotated[Optional[Path], typer.Option(
        "--save-recipe", help="Write these settings as a recipe YAML (not with --context), then run as usual.")] = None,
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags,
) -> None:
    """Think along several paths at once, then conclude.

    Map: --paths K independent paths from the question, sampled by default (temperature 0.7,
    seed 0: diverse, and the same on every run; --greedy or -t 0 for exact greedy paths, which
    --path-instruction makes differ), or --plan: the model writes a numbered outline and each item
    becomes a path. Process: every path decodes together over the question's shared cache. Reduce: a
    conclusion that reads every path (--merge reencode, exact; --merge attend, approximate), and/or
    --vote: each path's final answer is extracted (from what the path wrote, never from the
    question) and counted; the result goes to stdout after the paths ("## vote": the answer and
    "2 of 3 paths"; a majority only when more than half agree, else "no majority").

    -n bounds every phase unless --plan-tokens or --conclusion-tokens is given. With greedy
    decoding every path, and the reencode conclusion, is token for token what the model writes
    for that prompt alone; seeded sampling is reproducible path by path. A --vote that finds no
    answer says so and still exits 0: the paths were produced; there was just nothing to count.
    --save-recipe FILE writes the equivalent recipe; `mdcli run FILE` gives the same tokens.
    """
    with errors(out.debug), in_flags():
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        options = decoding.run_options()
        instructions = list(path_instruction or ())
        if question == "-" and "-" in (context or []):
            raise UsageError("the question and --context both read stdin (-)", fix="give one of them as a file")
        job = api.Think(
            question=read_question(question),
            documents=read_inputs(context) if context else [],
            paths=paths if paths is not None else (len(instructions) or api.Think.model_fields["paths"].default),
            plan=plan,
            max_paths=max_paths,
            merge=None if merge is None else merge.value,
            vote=vote,
            answer_pattern=answer_pattern,
            path_instructions=instructions,
            system=decoding.system,
            chat_template=not decoding.no_chat_template,
            sampling=None,  # the job's default for these paths; the flags given go on top below
            max_new_tokens=max_new_tokens,
            plan_tokens=plan_tokens,
            conclusion_tokens=conclusion_tokens,
            stop=decoding.stops(),
            constraint=decoding.constraint(),
        )
        job = job.model_copy(update={"sampling": paths_sampling(job.sampling, greedy, decoding)})
        job.validate()  # before the model loads
        if save_recipe is not None:
            # lazy: the recipe code costs `mdcli --help` ~150 ms (pydantic, yaml)
            from mdcli.cli.ask_many import write_recipe
            from mdcli.recipes import think_recipe_text

            write_recipe(save_recipe, think_recipe_text(job, speculate=options.speculate.recipe_value()))
        mode = out.mode()
        lm = load(loading.options(out, announced=announced))
        events = api.think(lm, job, options=options)
        if mode == Output.jsonl:
            events = say_when_no_vote(events)
        out.render(events, mode, lm)


def paths_sampling(default, greedy: bool, decoding: DecodeFlags):
    """The paths' sampling: the job's default (`default`) with the flags given on top; --greedy is -t 0."""
    temperature, seed = decoding.temperature, decoding.seed
    if greedy and temperature not in (None, 0.0):
        raise UsageError(f"--greedy and -t {temperature} contradict each other", fix="give one of them")
    if greedy:
        temperature = 0.0
    return sampling_params(
        default.temperature if temperature is None else temperature, decoding.top_p, decoding.top_k, decoding.min_p,
        default.seed if seed is None else seed,
    )


def read_question(source: str) -> str:
    """The question: '-' reads stdin, an existing file is read, anything else is the question itself.

    A lone word ending in .txt/.md that names no file is refused rather than asked: it is far more
    likely a mistyped path than a question.
    """
    if source == "-":
        return read_document("-")
    path = Path(source)
    looks_like_a_path = "\n" not in source and len(source) < 4096
    if looks_like_a_path and path.is_file():
        return read_document(source)
    if looks_like_a_path and " " not in source and path.suffix.lower() in _QUESTION_FILE_SUFFIXES:
        raise UsageError(f"question file '{source}' does not exist", fix="check the path, or quote the question text")
    if not source.strip():
        raise UsageError("the question is empty", fix="give the question as text, a file, or - for stdin")
    return source


def say_when_no_vote(events: Iterable) -> Iterator:
    """JSONL keeps stdout for events, so a vote that found no answer is also said on stderr
    (the plain and live renderers already print every note there)."""
    for event in events:
        if getattr(event, "kind", None) == "vote" and event.data.get("winner") is None:
            stderr_line(f"vote: {event.message.splitlines()[0]}")
        yield event
