"""`mdcli ask-many`: many questions about one document."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import announce_loading, errors, load, read_inputs, read_questions_file
from mdcli.cli.each import EACH, EachFlags, EachOutputOpt, answer, split_output
from mdcli.cli.flags import in_flags
from mdcli.cli.groups import takes
from mdcli.cli.options import (
    DECODE, LOAD, OUTPUT, ChunkTokensOpt, DecodeFlags, DocumentsArg, LoadFlags, OutputFlags, QuestionsFileOpt,
    RetrieveOpt, SaveRecipeOpt,
)
from mdcli.errors import UsageError


@takes(loading=LOAD, decoding=DECODE, out=OUTPUT, each_run=EACH)
def ask_many(
    ctx: typer.Context,
    document: DocumentsArg,
    question: Annotated[
        Optional[list[str]], typer.Option("--question", "-q", help="A question (repeatable).", show_default=False)
    ] = None,
    questions_file: QuestionsFileOpt = None,
    template: Annotated[
        Optional[str],
        typer.Option("--template", help="User-turn template with $document and $question.", show_default=False),
    ] = None,
    retrieve: RetrieveOpt = None,
    chunk_tokens: ChunkTokensOpt = 256,
    recipe: Annotated[
        Optional[str],
        typer.Option(
            "--recipe", help="Start from an ask-many recipe (file or built-in name); flags you give win.",
            show_default=False,
        ),
    ] = None,
    save_recipe: SaveRecipeOpt = None,
    output: EachOutputOpt = "auto",
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags, each_run: EachFlags,
) -> None:
    """Ask many questions about one document or many: every answer decodes at once over the shared cache.

    Several documents (files, folders, globs) are read in order as one context, each under a
    "# path" line; a context longer than the model's is refused (use --retrieve K, or mdcli margins --context independent).
    --retrieve K gives each question its K best passages (BM25, --chunk-tokens each), in corpus
    order, each tagged "[n] path:first-last"; the answer lists them as its Sources.

    The user turn for each question is the template (default: the document, then "Answer this
    question about the text above." and "Question: <question>"), chat-templated when the model has
    one. Exact: with greedy decoding each answer is token for token what the model gives for that
    question alone.

    --each asks the questions of every document on its own instead: one tree per document, many
    documents' trees decoding in one forest, each document's answers exactly those of ask-many on that
    file alone; output `## path :: question` (jsonl: each record names its document and sha256);
    --output FILE.jsonl appends each finished document (a rerun skips those already there); a file
    that is not text is one error record and the exit code is 1. --workers N runs on Ray actors.

    --save-recipe FILE writes the equivalent recipe (the document becomes `context: {input: true}`)
    and still runs; `mdcli run FILE --input DOC` then gives the same tokens. --recipe FILE starts
    from a saved or built-in ask-many recipe.
    """
    with errors(out.debug), in_flags():
        mode, results = each_run.destination(output)
        each = each_run.each
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        if each and (recipe is not None or save_recipe is not None):
            raise UsageError("--each does not take --recipe or --save-recipe", fix="give the questions with -q")
        if recipe is not None or save_recipe is not None:
            own = _Own(document=document, question=question, questions_file=questions_file, template=template,
                       retrieve=retrieve, chunk_tokens=chunk_tokens, output=output)
            _run_with_recipe(ctx, recipe, save_recipe, announced, own, loading, decoding, out)
            return

        options = decoding.run_options()
        questions = list(question or []) + read_questions_file(questions_file)
        job = api.AskMany(
            document="(each)" if each else "",  # --each: every document is read on its own, below
            documents=[] if each else read_inputs(document),
            retrieve=retrieve,
            chunk_tokens=chunk_tokens,
            questions=questions,
            system=decoding.system,
            template=template or api.ASK_MANY_TEMPLATE,
            chat_template=not decoding.no_chat_template,
            sampling=decoding.sampling(),
            max_new_tokens=decoding.max_new_tokens,
            stop=decoding.stops(),
            constraint=decoding.constraint(),
        )
        job.validate()  # before the model loads
        answer(ctx, document, job, mode, results, announced, api.ask_many, loading=loading, options=options, out=out,
               each_run=each_run)


# -- --recipe and --save-recipe --------------------------------------------------------------------

_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_new_tokens", "stop")  # DecodeFlags fields


@dataclass(frozen=True)
class _Own:
    """ask-many's own options as typed (the groups carry the shared ones)."""

    document: list[str]
    question: list[str] | None
    questions_file: Path | None
    template: str | None
    retrieve: int | None
    chunk_tokens: int
    output: str


def _run_with_recipe(ctx: typer.Context, recipe_name: str | None, save_to: Path | None, announced: bool,
                     own: _Own, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags) -> None:
    """ask-many through a recipe: the --recipe file (if any) with the flags you typed on top.

    Without --recipe every flag counts, defaults included, so the saved file pins them all. With
    --recipe only flags given on the command line override the file. The recipe is written before
    anything runs, and the run uses exactly the recipe that was written."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
    # lazy: pydantic and yaml cost `mdcli --help` ~150 ms
    from mdcli.recipes import ask_many_recipe, dump_recipe, sampling_from_flags

    typed_speculation = decoding.run_options().speculate  # a bad --speculate fails before anything else
    base = _base_recipe(recipe_name) if recipe_name is not None else None

    def flag(value, name: str):
        """The flag's value if it counts (see above; `name`: the option's parameter, which click
        says was typed or not), else None (keep the recipe's)."""
        return value if base is None or _given(ctx, name) else None

    documents = read_inputs(own.document)
    questions = list(own.question or []) + read_questions_file(own.questions_file)
    if base is None:  # the same checks and messages as a plain ask-many
        template = own.template or api.ASK_MANY_TEMPLATE
        api.AskMany(documents=documents, questions=questions, template=template, retrieve=own.retrieve,
                    chunk_tokens=own.chunk_tokens).validate()
    plan = ask_many_recipe(
        base,
        questions=questions or None,
        template=flag(own.template, "template") or (None if base is not None else api.ASK_MANY_TEMPLATE),
        system=flag(decoding.system, "system"),
        chat_template=None if flag(decoding.no_chat_template, "no_chat_template") is None
        else not decoding.no_chat_template,
        sampling=sampling_from_flags(**{name: flag(getattr(decoding, name), name) for name in _SAMPLING_FLAGS}),
        speculate=None if flag(decoding.speculate, "speculate") is None else typed_speculation.recipe_value(),
        prompt_cache=flag(loading.prompt_cache, "prompt_cache"),
        retrieve=flag(own.retrieve, "retrieve"),
        chunk_tokens=flag(own.chunk_tokens, "chunk_tokens"),
        constraint=decoding.constraint(),
        source=recipe_name or "ask-many flags",
    )
    options = decoding.run_options(speculate=plan.speculation(None))  # --speculate is in the plan, over the --recipe file's
    if save_to is not None:
        write_recipe(save_to, dump_recipe(plan))
    mode = out.mode(split_output(own.output, False)[0])
    lm = load(loading.options(out, announced=announced, prompt_cache=plan.prompt_cache or "auto"))  # --prompt-cache is in the plan

    from mdcli.recipes import compile_recipe, resolved_seed  # lazy: as above

    specs = compile_recipe(plan, lm.tokenizer, input_text=documents)
    events = api.run_specs(
        lm, specs, strategy="ask-many", seed=resolved_seed(plan), options=options,
        notes=api.unretrieved_notes(specs) if plan.retrieve is not None else (),
    )
    out.render(events, mode, lm)


def _base_recipe(name: str):
    # lazy: pydantic and yaml cost `mdcli --help` ~150 ms
    from mdcli.recipes import AskManyRecipe, load_recipe

    base = load_recipe(name)
    if not isinstance(base, AskManyRecipe):
        raise UsageError(f"--recipe {name} is a '{base.strategy}' recipe", fix=f"run it with: mdcli run {name}")
    return base


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user typed this option (or set its environment variable), not its default.

    Compared by name: typer may carry its own copy of click's ParameterSource enum."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def write_recipe(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise UsageError(
            f"cannot write the recipe to '{path}': {error.strerror}", fix="check the folder exists and is writable"
        ) from error
