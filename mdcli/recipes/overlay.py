"""Command-line layers: flags over a recipe, `--var` values, and the recipe a command line saves.

    with_flags           --system, --no-chat-template and the sampling flags over a recipe
    with_sampling        sampling flags win over the recipe everywhere, per-branch layers included
    sampling_from_flags  the sampling flags as a `sampling:` layer (flag names in any error)
    parse_vars           `--var name=value` flags
    ask_many_recipe      the recipe equivalent to `mdcli ask-many` flags (--save-recipe, --recipe)
    margins_recipe_text  the recipe equivalent to a `mdcli margins` job (--save-recipe)
    explore_recipe_text  the recipe equivalent to a `mdcli explore` job (--save-recipe)
    think_recipe_text    the recipe equivalent to a `mdcli think` job without documents (--save-recipe)
    beam_recipe_text     the recipe equivalent to a `mdcli beam` job (--save-recipe)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import ValidationError

from mdcli.constraints import Constraint
from mdcli.errors import UsageError
from mdcli.recipes.ask_many import AskManyRecipe
from mdcli.recipes.errors import RANGE_FIXES, bound, short
from mdcli.recipes.files import dump_recipe
from mdcli.recipes.load import validate_recipe_data
from mdcli.recipes.margins import margins_recipe_data
from mdcli.recipes.registry import Recipe
from mdcli.recipes.schema import RECIPE_VERSION, Branch, Sampling, stated_sampling
from mdcli.recipes.templates import (
    RESERVED_VARIABLES,
    document_template_to_recipe,
    escape_dollars,
    is_identifier,
    names_or_none,
)
from mdcli.strategies.beam.job import Beam, BeamOptions
from mdcli.strategies.explore import Explore
from mdcli.strategies.think import Think, ThinkOptions
from mdcli.strategies.margins.job import Margins


def with_flags(
    recipe: Recipe, *, system: str | None = None, chat_template: bool | None = None, sampling: Sampling | None = None
) -> Recipe:
    """The recipe with the command line's explicit settings on top (None: not given, the
    recipe's value stands). The result is the same strategy's model, as if the file said so."""
    updates = {name: value for name, value in (("system", system), ("chat_template", chat_template)) if value is not None}
    if updates:
        recipe = recipe.model_copy(update=updates)
    return with_sampling(recipe, sampling) if sampling is not None else recipe


def with_sampling(recipe: Recipe, overrides: Sampling) -> Recipe:
    """The recipe with `overrides` (flags given on the command line) winning everywhere: set at
    the top and cleared from every branch, so the result also reads right when saved."""
    given = overrides.stated()
    if not given:
        return recipe
    copy = recipe.model_copy(deep=True)
    copy.sampling = copy.sampling.then(overrides)
    for branch in _all_branches(copy.branch_tree()):
        if branch.sampling is not None:
            branch.sampling = branch.sampling.without(given)
    return copy


def with_constraint(recipe: Recipe, constraint: Constraint | None) -> Recipe:
    """The recipe with the command line's constraint (--choices / --regex / --schema) winning
    everywhere: its top-level `constraint:`, and cleared from every branch. A strategy with no
    constraint (beam, margins) refuses it rather than dropping it."""
    if constraint is None:
        return recipe
    if "constraint" not in type(recipe).model_fields:
        raise UsageError(
            f"--choices, --regex and --schema do not apply to a {recipe.strategy} recipe",
            fix="use them with ask-many, tree, think or explore recipes",
        )
    copy = recipe.model_copy(deep=True, update={"constraint": constraint})
    for branch in _all_branches(copy.branch_tree()):
        branch.constraint = None
    return copy


def _all_branches(branches: list[Branch]) -> Iterator[Branch]:
    for branch in branches:
        yield branch
        yield from _all_branches(branch.children)


_FLAG_NAMES = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
               "seed": "--seed", "max_new_tokens": "--max-new-tokens", "stop": "--stop"}


def sampling_from_flags(**flags: Any) -> Sampling:
    """Sampling from command-line values (None = not given), with flag names in any error.

    A repeatable flag that was not given arrives as an empty tuple: that is "not given" too."""
    stop = flags.get("stop")
    flags["stop"] = list(stop) if stop else None
    try:
        return Sampling.model_validate(flags)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0])
        raise UsageError(f"{_FLAG_NAMES.get(field, field)} {short(first.get('input'))} is out of range "
                         f"(must be {bound(first)})", fix=RANGE_FIXES.get(field, "see mdcli --help")) from None


def parse_vars(assignments: Iterable[str]) -> dict[str, str]:
    """`--var name=value` flags -> {name: value}."""
    values: dict[str, str] = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        name = name.strip()
        if not equals or not is_identifier(name):
            raise UsageError(
                f"--var '{assignment}' is not name=value", fix="write --var name=value, e.g. --var topic=cats"
            )
        if name in RESERVED_VARIABLES:
            raise UsageError(f"--var {name}: ${name} is filled by mdcli", fix="use --input for the context")
        values[name] = value
    return values


# -- the recipe a command line saves ------------------------------------------------------------


def ask_many_recipe(
    base: AskManyRecipe | None,
    *,
    questions: list[str] | None = None,
    template: str | None = None,
    system: str | None = None,
    chat_template: bool | None = None,
    sampling: Sampling | None = None,
    speculate: str | int | None = None,
    prompt_cache: str | None = None,
    retrieve: int | None = None,
    chunk_tokens: int | None = None,
    constraint: Constraint | None = None,
    source: str = "ask-many flags",
) -> AskManyRecipe:
    """The recipe equivalent to `mdcli ask-many` flags, on top of `base` (from --recipe) if any.

    None means "not given": the base's value stays. The document argument becomes
    `context: {input: true}`, so the recipe runs again with `mdcli run FILE --input DOC`.
    `template` is in ask-many form ($document); questions are literal text (`$` is escaped);
    `speculate` is the recipe's form of --speculate ("auto", "off" or N)."""
    data: dict[str, Any] = base.model_dump(exclude_none=True, exclude_defaults=True, by_alias=True, mode="json") if base else {}
    data.update(version=RECIPE_VERSION, strategy="ask-many", context={"input": True})
    data.setdefault("description", "Saved from mdcli ask-many.")
    if questions is not None:
        data["questions"] = [escape_dollars(question) for question in questions]
        data.pop("branches", None)
        _drop_vars_nothing_uses(data)
    if template is not None:
        data["template"] = document_template_to_recipe(template)
    if system is not None:
        data["system"] = system
    if chat_template is not None:
        data["chat_template"] = chat_template
    if speculate is not None:
        data["speculate"] = speculate
    if prompt_cache is not None:
        data["prompt_cache"] = prompt_cache
    if retrieve is not None:
        data["retrieve"] = retrieve
    if chunk_tokens is not None and data.get("retrieve") is not None:
        data["chunk_tokens"] = chunk_tokens
    if constraint is not None:
        data["constraint"] = constraint.recipe_value()
    base_dir = base.base_dir if base else None
    recipe = validate_recipe_data(data, source=source, base_dir=base_dir)
    return with_sampling(recipe, sampling) if sampling is not None else recipe


def _drop_vars_nothing_uses(data: dict[str, Any]) -> None:
    """Questions from flags replace the recipe's: its variables for the old questions go too."""
    texts = [*data.get("questions", []), data.get("template") or ""]
    used = {name for text in texts for name in names_or_none(text)}
    data["vars"] = {name: value for name, value in data.get("vars", {}).items() if name in used}


def margins_recipe_text(job: Margins, *, given_layout: bool, speculate: str | int | None = None) -> str:
    """The recipe's YAML, checked by the same validator `mdcli run` uses; `speculate` as in
    ask_many_recipe (None: not given, the recipe leaves it to `mdcli run`)."""
    data = margins_recipe_data(job, given_layout=given_layout)
    if speculate is not None:
        data["speculate"] = speculate
    recipe = validate_recipe_data(data, source="margins flags")
    return dump_recipe(recipe)


def explore_recipe_text(job: Explore) -> str:
    """The recipe's YAML for a `mdcli explore` job: the prompt as literal text (`$` escaped), every
    setting stated, so `mdcli run FILE` gives the same tokens; checked by `mdcli run`'s validator."""
    data: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "description": "Saved from mdcli explore.",
        "strategy": "explore",
        "prompt": escape_dollars(job.prompt),
        "sampling": stated_sampling(job.sampling, job.max_new_tokens),
        "k": job.k, "keep": job.keep, "score": job.score,
    }
    if job.chunk_tokens is not None:
        data["chunk_tokens"] = job.chunk_tokens
    if job.system is not None:
        data["system"] = job.system
    if not job.chat_template:
        data["chat_template"] = False
    if job.constraint is not None:
        data["constraint"] = job.constraint.recipe_value()
    return dump_recipe(validate_recipe_data(data, source="explore flags"))


def think_recipe_text(job: Think, *, speculate: str | int | None = None) -> str:
    """The recipe's YAML for a `mdcli think` job: the question as literal text (`$` escaped), the
    paths' sampling and every setting stated (each phase limit as the job resolved it), so
    `mdcli run FILE` gives the same tokens. A think recipe reads no documents: a job with some
    (--context) is refused."""
    if job.documents:
        raise UsageError("--save-recipe: a think recipe reads no documents, and --context gave "
                         f"{len(job.documents)}", fix="drop --context to save the recipe, or --save-recipe to run with it")
    data: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "description": "Saved from mdcli think.",
        "strategy": "think",
        "question": escape_dollars(job.question),
        "sampling": stated_sampling(job.sampling, job.max_new_tokens),
    }
    if job.stop:
        data["sampling"]["stop"] = list(job.stop)
    if job.system is not None:
        data["system"] = job.system
    if not job.chat_template:
        data["chat_template"] = False
    if speculate is not None:
        data["speculate"] = speculate
    options = job.model_dump(include=set(ThinkOptions.model_fields), exclude={"constraint"}, exclude_none=True, mode="json")
    data.update(options)  # path instructions are literal in a recipe: no $ to escape
    if job.constraint is not None:
        data["constraint"] = job.constraint.recipe_value()
    return dump_recipe(validate_recipe_data(data, source="think flags"))


def beam_recipe_text(job: Beam) -> str:
    """The recipe's YAML for a `mdcli beam` job: the prompt as literal text, or, with questions, the
    document as `context: {input: true}` and the questions literal (the template in recipe form),
    so `mdcli run FILE` (`--input DOC` with questions) gives the same hypotheses."""
    data: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "description": "Saved from mdcli beam.",
        "strategy": "beam",
        "sampling": {"max_new_tokens": job.max_new_tokens},
        **job.model_dump(include=set(BeamOptions.model_fields), mode="json"),
    }
    if job.questions:
        data["context"] = {"input": True}
        data["questions"] = [escape_dollars(question) for question in job.questions]
        if job.template is not None:
            data["template"] = document_template_to_recipe(job.template)
    else:
        data["prompt"] = escape_dollars(job.prompt)
    if job.system is not None:
        data["system"] = job.system
    if not job.chat_template:
        data["chat_template"] = False
    return dump_recipe(validate_recipe_data(data, source="beam flags"))
