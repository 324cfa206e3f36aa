"""Loading a recipe: YAML (or plain data) -> the strategy's checked recipe model, or one RecipeError.

    load_recipe           a file, or a built-in recipe by name
    load_recipe_text      YAML text
    validate_recipe_data  plain data (what YAML gives, or what a command line builds)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mdcli.errors import RecipeError
from mdcli.recipes.checks import check_recipe
from mdcli.recipes.errors import Problem, problem_from_pydantic, recipe_error
from mdcli.recipes.files import builtin_names, check_shape, parse_yaml, read_recipe_source
from mdcli.recipes.registry import RECIPE_ADAPTER, STRATEGY_MODELS, Recipe


def load_recipe(name_or_path: str | Path, *, var_names: Iterable[str] = ()) -> Recipe:
    """Load a recipe file, or a built-in recipe by name (`interview`, `follow-ups`, ...)."""
    text, source, base_dir = read_recipe_source(name_or_path)
    return load_recipe_text(text, source=source, base_dir=base_dir, var_names=var_names)


def load_recipe_text(
    text: str, *, source: str = "recipe", base_dir: Path | None = None, var_names: Iterable[str] = ()
) -> Recipe:
    """Parse and check a recipe. `var_names` are the variables the command line will give (--var),
    which the file need not declare. Raises RecipeError (and nothing else) on any problem."""
    data = parse_yaml(text, source)
    return validate_recipe_data(data, source=source, base_dir=base_dir, var_names=var_names)


def validate_recipe_data(
    data: Any, *, source: str = "recipe", base_dir: Path | None = None, var_names: Iterable[str] = ()
) -> Recipe:
    """Check plain data (what YAML gives) against the schema and the cross-field rules."""
    try:
        check_shape(data)
        recipe = _validate_schema(data)
        recipe._source, recipe._base_dir = source, base_dir
        check_recipe(recipe, set(var_names))
    except Problem as problem:
        raise recipe_error(source, problem.path, problem.problem, problem.fix) from None
    except RecursionError:
        raise recipe_error(source, "(top level)", "nested too deeply", "flatten the recipe") from None
    return recipe


def _validate_schema(data: dict) -> Recipe:
    try:
        return RECIPE_ADAPTER.validate_python(data)
    except ValidationError as error:
        raise problem_from_pydantic(error.errors()[0], data, STRATEGY_MODELS) from None
    except RecursionError:
        raise Problem((), "nested too deeply", "flatten the recipe") from None


def builtin_descriptions() -> list[tuple[str, str]]:
    """(name, one-line description) for `mdcli recipes list`."""
    rows = []
    for name in builtin_names():
        try:
            description = load_recipe(name).description or ""
        except RecipeError as error:
            description = f"(invalid: {error.problem})"
        rows.append((name, " ".join(description.split())))
    return rows
