"""`mdcli margins`: Writing in the Margins, every margin written at once."""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import announce_loading, errors, read_inputs, read_questions_file
from mdcli.cli.each import EACH, EachFlags, EachOutputOpt, answer
from mdcli.cli.flags import in_flags
from mdcli.cli.groups import takes
from mdcli.cli.options import DECODE, LOAD, OUTPUT, DecodeFlags, LoadFlags, OutputFlags, QuestionsFileOpt
from mdcli.errors import UsageError

# The job model's defaults (strategies.margins: DEFAULT_*_TOKENS, for the help text), as literals:
# importing them would load the decoding stack on `mdcli --help`. tests/test_recipes.py and
# tests/test_structure.py check they agree.
_SEGMENT_TOKENS = 512
_MIN_SEGMENT_TOKENS = 16
_MARGIN_TOKENS = 48
_CLASSIFY_TOKENS = 24
_ANSWER_TOKENS = 256


class ContextLayout(str, Enum):
    chain = "chain"
    independent = "independent"


class KeepMargins(str, Enum):
    relevant = "relevant"
    all = "all"


@takes(loading=LOAD, decoding=DECODE.without("stop", "choices", "regex", "schema"), out=OUTPUT, each_run=EACH)
def margins(
    ctx: typer.Context,
    documents: Annotated[list[str], typer.Argument(
        help="Documents, each its own segment group: files, folders (read recursively, text files only, sorted), "
        "globs, or - for stdin.")],
    query: Annotated[Optional[list[str]], typer.Option(
        "--question", "-q", "--query",
        help="A question (repeatable: every question's margins share one cache; --query is its old spelling).")] = None,
    questions_file: QuestionsFileOpt = None,
    show_margins: Annotated[bool, typer.Option(
        "--show-margins", help="Plain output: print each question's margins and which were kept.")] = False,
    save_recipe: Annotated[Optional[Path], typer.Option(
        "--save-recipe", help="Write these settings as a recipe YAML (its context the run's --input), then run as "
        "usual.")] = None,
    context: Annotated[Optional[ContextLayout], typer.Option(
        "--context", help="chain: margin i reads segments 1..i (default for one document); independent: margin i "
        "reads segment i alone (default for several).")] = None,
    segment_tokens: Annotated[int, typer.Option(
        "--segment-tokens", min=_MIN_SEGMENT_TOKENS, help="Most tokens per segment.")] = _SEGMENT_TOKENS,
    keep: Annotated[KeepMargins, typer.Option(
        "--keep", help="Margins the answer reads: those classified relevant, or all.")] = KeepMargins.relevant,
    no_classify: Annotated[bool, typer.Option(
        "--no-classify", help="Skip the YES/NO classification; the answer reads every margin.")] = False,
    no_classify_constraint: Annotated[bool, typer.Option(
        "--no-classify-constraint", help="Let the classifier write freely instead of decoding it under "
        "'(YES|NO)#<one line>' (the default), then read YES/NO out of its reply.")] = False,
    with_segments: Annotated[bool, typer.Option(
        "--with-segments", help="Give the answer each kept margin's source segment too.")] = False,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", "-n", min=1,
        help=f"Most tokens per branch in every phase: each margin, each classification (at most {_CLASSIFY_TOKENS}) "
        f"and the answer, unless --classify-tokens or --answer-tokens is given. Not given: margins {_MARGIN_TOKENS}, "
        f"classifications {_CLASSIFY_TOKENS}, answer {_ANSWER_TOKENS}.")] = None,
    classify_tokens: Annotated[Optional[int], typer.Option(
        "--classify-tokens", min=1,
        help=f"Most tokens per YES/NO classification (default: {_CLASSIFY_TOKENS}, at most -n).")] = None,
    answer_tokens: Annotated[Optional[int], typer.Option(
        "--answer-tokens", min=1,
        help=f"Most tokens in each answer (default: -n if given, else {_ANSWER_TOKENS}).")] = None,
    margin_template: Annotated[Optional[str], typer.Option(
        "--margin-template", help="Margin prompt with $context and $query.")] = None,
    classification_template: Annotated[Optional[str], typer.Option(
        "--classification-template", help="Classifier prompt with $query and $margin.")] = None,
    answer_template: Annotated[Optional[str], typer.Option(
        "--answer-template", help="Answer prompt with $notes and $query.")] = None,
    output: EachOutputOpt = "auto",
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags, each_run: EachFlags,
) -> None:
    """Writing in the Margins: a note ("margin") per segment, all written at once, each classified
    relevant or not (all at once), then one answer from the relevant margins.

    One document: margin i reads segments 1..i, as in the paper (the document enters the cache
    once). Several documents: margin i reads its segment alone. Several questions (-q A -q B, or
    --questions-file): a margin per question and segment, an answer per question, every phase one
    set of forwards over one cache; the segment comes before the question in the margin prompt,
    so all questions share each segment's cached tokens. Exact: with greedy decoding every margin,
    classification and answer is token for token what the model gives that prompt alone.

    -n bounds every phase (margins, classifications, answers) unless a phase's own limit is given.

    Plain and live output print the same: the answer (a "## question" block per question when
    there are several; with --show-margins each block lists the question's margins and which were
    kept). --json gives the answers in question order; JSONL adds the margin and "classification
    N/M" branches, a "classification" note per margin and an "answer-sources" note per answer,
    each naming its question.
    --each answers the questions of every document on its own, each exactly as `mdcli margins FILE`
    would, consecutive documents (as many as --budget-tokens holds of their margins) in one forest:
    `## path :: question` blocks, --output
    FILE.jsonl appended per document and skipped on rerun, bad files as error records (exit 1),
    --workers N on Ray actors (docs/cli.md).
    --save-recipe FILE writes the equivalent recipe; `mdcli run FILE --input DOC...` on the same
    documents gives the same tokens.
    """
    with errors(out.debug), in_flags():
        mode, results = each_run.destination(output)
        each = each_run.each
        if each and save_recipe is not None:
            raise UsageError("--each does not take --save-recipe", fix="save the recipe from a run on one document")
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        questions = list(query or []) + read_questions_file(questions_file)
        options = decoding.run_options()
        # --each: every document is read on its own, by run_each, and run as `margins FILE` would
        texts, names, paths = (["(each)"], ["(each)"], ["(each)"]) if each else read_documents(documents)
        job = api.Margins(
            documents=texts,
            questions=questions,
            names=names,
            layout=context.value if context else None,  # type: ignore[arg-type]
            segment_tokens=segment_tokens,
            keep=keep.value,  # type: ignore[arg-type]
            classify=not no_classify,
            classify_constraint=not no_classify_constraint,
            with_segments=with_segments,
            prompts=prompts_with(
                api.MarginsPrompts(system=decoding.system), margin_template, classification_template, answer_template
            ),
            chat_template=not decoding.no_chat_template,
            sampling=decoding.sampling(),
            margin_tokens=max_new_tokens,
            classify_tokens=classify_tokens,
            answer_tokens=answer_tokens,
        )
        job.validate()  # before the model loads
        if save_recipe is not None:
            if len(texts) > 1 and names != paths:  # a recipe's run names each document by its path
                raise UsageError(
                    "--save-recipe: a saved recipe names several documents by their paths, and here "
                    f"{', '.join(n for n, p in zip(names, paths) if n != p)} would be named by file name only",
                    fix="give the files as a folder or a glob, or from their own folder, then run the recipe on them",
                )
            # lazy: the recipe code costs `mdcli --help` ~150 ms (pydantic, yaml)
            from mdcli.cli.ask_many import write_recipe
            from mdcli.recipes import margins_recipe_text

            write_recipe(save_recipe, margins_recipe_text(
                job, given_layout=context is not None,
                speculate=options.speculate.recipe_value(),
            ))
        answer(ctx, documents, job, mode, results, announced, api.margins, loading=loading, options=options, out=out,
               each_run=each_run, show_margins=show_margins)


def read_documents(sources: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Every document's text, name and path: files, folders, globs and '-' (read once). A file
    named on the command line is called by its file name, one found in a folder or by a glob by
    its path, "stdin" for '-'."""
    documents = read_inputs(sources)
    names = [Path(d.path).name if d.path in sources else d.path for d in documents]
    return [d.text for d in documents], names, [d.path for d in documents]


def prompts_with(prompts, margin: str | None, classification: str | None, answer: str | None):
    """The default prompts with any template given on the command line swapped in."""
    given = {"margin": margin, "classification": classification, "answer": answer}
    changes = {name: value for name, value in given.items() if value}
    return replace(prompts, **changes)
