"""`mdcli recipes list | show NAME | validate FILE...`: the built-in recipes, and checking files."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mdcli.cli.common import command_group, errors
from mdcli.cli.options import DebugOpt
from mdcli.errors import RecipeError

app = command_group("recipes", "Built-in recipes and recipe checking (see docs/recipes.md for the format).")


@app.command("list")
def list_recipes(debug: DebugOpt = False) -> None:
    """List the built-in recipes: name and what it does. Run one with `mdcli run NAME`."""
    with errors(debug):
        # the recipes package is imported here, not at the top: building its schema (pydantic)
        # costs about a second, which `mdcli --help` would pay
        from mdcli.recipes import builtin_descriptions

        rows = builtin_descriptions()
        width = max((len(name) for name, _ in rows), default=0)
        for name, description in rows:
            typer.echo(f"{name.ljust(width)}  {description}")


@app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A built-in recipe name (or a recipe file).", show_default=False)],
    debug: DebugOpt = False,
) -> None:
    """Print a recipe's YAML, e.g. to copy a built-in and change it."""
    with errors(debug):
        from mdcli.recipes import read_recipe_source  # not at the top: see list_recipes

        text, _, _ = read_recipe_source(name)
        typer.echo(text, nl=not text.endswith("\n"))


@app.command("validate")
def validate(
    files: Annotated[list[str], typer.Argument(help="Recipe files (or built-in names).", show_default=False)],
    debug: DebugOpt = False,
) -> None:
    """Check recipes without running them: exit 0 if all are valid, else 2 with one line per bad file.

    Variables that the command line would give (--var) must be declared under `vars:` (a null value
    means "required at run time") for a file to validate on its own.
    """
    with errors(debug):
        from mdcli.recipes import load_recipe  # not at the top: see list_recipes

        bad = 0
        for file in files:
            try:
                recipe = load_recipe(file)
            except RecipeError as error:
                bad += 1
                message = error.line()
                print(f"mdcli: error: {message}", file=sys.stderr)
                continue
            typer.echo(f"ok: {recipe.source} ({recipe.strategy})")
        if bad:
            raise typer.Exit(2)
