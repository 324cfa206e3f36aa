"""From a checked recipe to a run: its variable values, its context text, then its events.

    check_run_inputs   the variables and the context source, before the slow model load
    each_plan          `mdcli run RECIPE --each`: the job asked of every document, and where they are
    compile_recipe     a recipe with a branch list -> [BranchSpec] (tokenized; `mdcli explain`)
    recipe_events      any recipe -> its events (the strategy's own `events` method)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mdcli.documents.inputs import Document, joined_text
from mdcli.recipes.checks import context_documents
from mdcli.recipes.errors import Problem, recipe_error
from mdcli.recipes.schema import RecipeBase
from mdcli.recipes.templates import RESERVED_VARIABLES, template_variables
from mdcli.strategies.job import RunOptions, run_options

if TYPE_CHECKING:
    from mdcli.core.decoding import BranchSpec
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel


def resolved_seed(recipe: RecipeBase) -> int | None:
    """The run's seed as reported in the Start event: the recipe-wide one."""
    return recipe.sampling.seed


def compile_recipe(
    recipe: RecipeBase, tokenizer, *, input_text: str | Sequence[Document] | None = None, vars: dict[str, str] | None = None
) -> list[BranchSpec]:
    """The recipe's root branch specs (children nested), tokenized as the engine will see them.

    Roots are whole prompts (prompts.prompt_token_ids: chat template, system, the context through
    $context); children are continuation turns after their parent's answer
    (prompts.continuation_token_ids). Raises RecipeError (also for a recipe with no branch list)."""
    return recipe.branch_specs(tokenizer, input_text=input_text, vars=vars)


def recipe_events(
    recipe: RecipeBase, model: LoadedModel, *, input_text: str | Sequence[Document] | None = None, vars: dict[str, str] | None = None,
    options: RunOptions | None = None, **engine,
) -> Iterator[Event]:
    """The events of running `recipe` (sampling overrides already applied with with_sampling).
    `options` (RunOptions, or its fields as keywords): how the engine runs; a `speculate` set there
    wins over the recipe's, which is auto when it has none. Arguments are checked here, before the
    first event is asked for. Raises RecipeError/UsageError."""
    options = recipe.run_options(run_options(options, engine, every=True))
    values, context = values_and_context(recipe, input_text, vars)
    return recipe.events(model, values, context, options=options)


def check_run_inputs(
    recipe: RecipeBase, *, input_text: str | Sequence[Document] | None = None, vars: dict[str, str] | None = None
) -> None:
    """What compile_recipe checks before it needs a tokenizer: variables and the context source.
    Commands call it before loading the model, so a missing --input fails in a blink."""
    values_and_context(recipe, input_text, vars)


def each_plan(
    recipe: RecipeBase, sources: Sequence[str] | None, vars: dict[str, str] | None
) -> tuple[Any, list[str], Path | None]:
    """What `mdcli run RECIPE --each` runs: the job asked of every document on its own (the
    strategy's `each_job`: ask-many and margins recipes), the documents' sources, and the folder
    relative ones start from: the --input sources (`context: {input: true}`, from the current
    folder), or `context: {file:}` / `{files:}` (from the recipe's). Raises RecipeError."""
    context = recipe.context
    try:
        if not recipe.runs_each:
            raise Problem(("strategy",), f"--each runs ask-many and margins recipes, not a {recipe.strategy_name()} "
                          "recipe", "run it without --each")
        if sources and not (context is not None and context.input):
            raise Problem(("context",), "this recipe does not read --input", "drop --input, or set `context: {input: true}`")
        if context is None or context.text is not None:
            raise Problem(("context",), "--each asks every document on its own, and this recipe has none",
                          "set `context: {input: true}` and give --input FOLDER, or `context: {files: [...]}`")
        if context.input and not sources:
            raise Problem(("context", "input"), "the recipe reads its documents from --input",
                          "give --input FOLDER (files and globs too)")
        job = recipe.each_job(_variable_values(recipe, vars or {}))
    except Problem as problem:
        raise recipe_error(recipe.source, problem.path, problem.problem, problem.fix) from None
    if context.input:
        return job, list(sources or ()), None
    return job, list(context.files or [context.file]), recipe.base_dir


def values_and_context(
    recipe: RecipeBase, input_text: str | Sequence[Document] | None, vars: dict[str, str] | None
) -> tuple[dict[str, str], str | None]:
    """The recipe's variable values (with $context set when it has one) and its context text.
    Raises RecipeError naming the field."""
    try:
        values = _variable_values(recipe, vars or {})
        context = _context_text(recipe, input_text)
    except Problem as problem:
        raise recipe_error(recipe.source, problem.path, problem.problem, problem.fix) from None
    if context is not None:
        values["context"] = context
    return values, context


def _variable_values(recipe: RecipeBase, given: dict[str, str]) -> dict[str, str]:
    sites = list(recipe.template_sites())
    used = {name for site in sites for name in template_variables(site.text, site.path)}
    for name in given:
        if name not in used:
            known = ", ".join(sorted(used - set(RESERVED_VARIABLES))) or "none"
            raise Problem((f"--var {name}",), f"no prompt uses ${name}", f"drop it; this recipe's variables: {known}")
    values = {name: value for name, value in recipe.vars.items() if value is not None}
    values.update(given)
    for site in sites:
        for name in template_variables(site.text):
            if name not in values and name not in RESERVED_VARIABLES:
                raise Problem(site.path, f"uses ${name}, which has no value", f"pass --var {name}=VALUE")
    return values


class ContextText(str):
    """The context as prompts read it ($context), remembering the documents it joins
    (documents.inputs.joined_text), for a strategy that retrieves from them."""

    documents: tuple[Document, ...]

    def __new__(cls, documents: Sequence[Document]) -> ContextText:
        text = super().__new__(cls, joined_text(documents))
        text.documents = tuple(documents)
        return text


def _context_text(recipe: RecipeBase, input_text: str | Sequence[Document] | None) -> ContextText | None:
    """The context: `input_text` is what --input gave, a text or the documents read from it."""
    documents = _context_documents(recipe, input_text)
    return None if documents is None else ContextText(documents)


def _context_documents(recipe: RecipeBase, input_text: str | Sequence[Document] | None) -> list[Document] | None:
    context = recipe.context
    takes_input = context is not None and bool(context.input)
    if input_text is not None and not takes_input:
        raise Problem(
            ("context",), "this recipe does not read --input", "drop --input, or set `context: {input: true}`"
        )
    if context is None:
        return None
    if context.input:
        if input_text is None:
            raise Problem(
                ("context", "input"), "the recipe reads its context from --input",
                "give --input FILE, or pipe text to stdin",
            )
        return [Document("input", input_text)] if isinstance(input_text, str) else list(input_text)
    if context.text is not None:
        return [Document("context", context.text)]
    if context.files is not None:
        return context_documents(context.files, recipe.base_dir).documents
    return [Document(context.file, _read_context_file(recipe.base_dir / context.file))]


def _read_context_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise Problem(
            ("context", "file"), f"cannot read {path}: {error.strerror}", "check the path and its permissions"
        ) from None
    except UnicodeDecodeError:
        raise Problem(
            ("context", "file"), f"{path} is not UTF-8 text", "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None
