"""The strategies a recipe can name: one line each in STRATEGY_MODELS.

A new strategy is a model module (mdcli/recipes/<strategy>.py: a RecipeBase subclass with its
`strategy: Literal[...]`, fields and methods) and its line here. The discriminated union, the
"unknown strategy" message and the "that key belongs to strategy X" message follow from the list.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter

from mdcli.recipes.ask_many import AskManyRecipe
from mdcli.recipes.beam import BeamRecipe
from mdcli.recipes.explore import ExploreRecipe
from mdcli.recipes.margins import MarginsRecipe
from mdcli.recipes.schema import RecipeBase
from mdcli.recipes.think import ThinkRecipe
from mdcli.recipes.tree import TreeRecipe

STRATEGY_MODELS: tuple[type[RecipeBase], ...] = (
    AskManyRecipe,
    TreeRecipe,
    BeamRecipe,
    MarginsRecipe,
    ThinkRecipe,
    ExploreRecipe,
)

Recipe = Union[STRATEGY_MODELS]  # noqa: UP007 - built from a tuple
RECIPE_ADAPTER: TypeAdapter = TypeAdapter(Annotated[Recipe, Field(discriminator="strategy")])


def strategy_names() -> list[str]:
    return [model.strategy_name() for model in STRATEGY_MODELS]
