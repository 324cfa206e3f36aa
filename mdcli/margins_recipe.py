"""`mdcli margins --save-recipe`: the margins recipe equivalent to a command line.

The document becomes `context: {input: true}`, so `mdcli run FILE --input DOC` runs the same
prompts and gives the same tokens. The segment size and every token limit are written out, so
the recipe does not change meaning if the command's defaults do. A recipe has one context, so a run over
several documents cannot be saved (refused before anything runs, in one line).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mdcli.errors import UsageError

if TYPE_CHECKING:
    from mdcli.strategies.margins_job import Margins


def margins_recipe_data(job: Margins, *, given_layout: bool) -> dict[str, Any]:
    from mdcli.recipes import RECIPE_VERSION, escape_dollars
    from mdcli.strategies.margins_job import MarginsPrompts

    if len(job.documents) != 1:
        raise UsageError(
            f"--save-recipe: a margins recipe reads one document (its context), and {len(job.documents)} were given",
            fix="save the recipe with one document, then run it on each with `mdcli run FILE --input DOC`",
        )
    questions = [escape_dollars(q) for q in job.all_questions()]
    data: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "description": "Saved from mdcli margins.",
        "strategy": "margins",
        "context": {"input": True},
    }
    if job.prompts.system is not None:
        data["system"] = job.prompts.system
    if not job.chat_template:
        data["chat_template"] = False
    sampling = job.sampling
    data["sampling"] = {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "min_p": sampling.min_p, "max_new_tokens": job.margin_tokens,
    }
    if sampling.seed is not None:
        data["sampling"]["seed"] = sampling.seed
    if len(questions) == 1:
        data["query"] = questions[0]
    else:
        data["questions"] = questions
    if given_layout:
        data["layout"] = job.resolved_layout()
    data.update(
        segment_tokens=job.segment_tokens, keep=job.keep, classify=job.classify, with_segments=job.with_segments,
    )
    defaults = MarginsPrompts()
    for name in ("margin", "classification", "answer"):
        if getattr(job.prompts, name) != getattr(defaults, name):
            data[f"{name}_template"] = getattr(job.prompts, name)
    data.update(classify_tokens=job.classify_tokens, answer_tokens=job.answer_tokens)
    return data


def margins_recipe_text(job: Margins, *, given_layout: bool) -> str:
    """The recipe's YAML, checked by the same validator `mdcli run` uses."""
    from mdcli.recipes import dump_recipe, validate_recipe_data

    recipe = validate_recipe_data(margins_recipe_data(job, given_layout=given_layout), source="margins flags")
    return dump_recipe(recipe)


def write_recipe(path: Path, text: str) -> None:
    from mdcli.commands.ask_many import _write_recipe

    _write_recipe(path, text)
