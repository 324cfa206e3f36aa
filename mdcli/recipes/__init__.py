"""Recipes: a forest of branches, its shared context and its sampling, written down as YAML.

A recipe is data, never code. It is parsed by PyYAML's SafeLoader (so `!!python/...` tags are
refused) and checked by pydantic models that forbid unknown keys, then by cross-field checks that
a schema cannot express (unique labels, defined variables, a context that every root reads).
Every problem becomes ONE line, `<file>: <field path>: <problem>; <fix>` (a RecipeError, exit 2):
the reader has to find the spot in their file and know what to type there.

Three stages, each usable alone:

    load_recipe / load_recipe_text   YAML -> Recipe          (no model needed: `recipes validate`)
    with_sampling                    Recipe -> Recipe        (command-line flags win over the file)
    recipe_events / compile_recipe   Recipe -> events / [BranchSpec] (fills variables, tokenizes)

The modules, one job each (imports go down this list, never up):

    errors      a problem at a field path -> one line; pydantic's errors in recipe words
    templates   `$variables`: finding, filling, the ask-many template in recipe form
    schema      the shared models (Sampling, Context, Branch) and RecipeBase, the strategy's methods
    checks      the cross-field rules common to all strategies, and pieces their checks share
    compile     variable values and the context text; recipe_events (the strategy's `events`)
    branches    recipes that are a list of branches (ask-many, tree): BranchSpecs, run_specs
    ask_many, tree, beam, margins, think    one model per strategy: fields, checks, template
                sites and events as methods
    registry    the strategies, one line each
    files       safe YAML, cycles, built-in recipes, writing YAML
    load        YAML or data -> the checked model
    overlay     flags over a recipe, --var, the recipe a command line saves

Adding a strategy is one model module and one line in registry.STRATEGY_MODELS: no code
elsewhere asks which strategy a recipe is.
"""

from __future__ import annotations

from mdcli.recipes.ask_many import AskManyRecipe
from mdcli.recipes.beam import BeamRecipe
from mdcli.recipes.checks import check_recipe
from mdcli.recipes.compile import (
    check_run_inputs, compile_recipe, each_plan, recipe_events, resolved_seed, values_and_context,
)
from mdcli.recipes.errors import format_path
from mdcli.recipes.files import (
    BUILTIN_PACKAGE,
    builtin_names,
    builtin_text,
    dump_recipe,
    parse_yaml,
    read_recipe_source,
)
from mdcli.recipes.load import builtin_descriptions, load_recipe, load_recipe_text, validate_recipe_data
from mdcli.recipes.margins import MarginsRecipe, margins_job, margins_recipe_data
from mdcli.recipes.overlay import (
    ask_many_recipe,
    margins_recipe_text,
    explore_recipe_text,
    think_recipe_text,
    beam_recipe_text,
    parse_vars,
    sampling_from_flags,
    with_constraint,
    with_flags,
    with_sampling,
)
from mdcli.recipes.registry import STRATEGY_MODELS, Recipe, strategy_names
from mdcli.recipes.schema import RECIPE_VERSION, Branch, Context, RecipeBase, Sampling, TemplateSite
from mdcli.recipes.templates import (
    RESERVED_VARIABLES,
    ask_many_default_template,
    document_template_to_recipe,
    escape_dollars,
    fill,
    template_variables,
)
from mdcli.recipes.think import ThinkRecipe
from mdcli.recipes.tree import TreeRecipe

__all__ = [
    "BUILTIN_PACKAGE", "RECIPE_VERSION", "RESERVED_VARIABLES", "STRATEGY_MODELS",
    "AskManyRecipe", "BeamRecipe", "Branch", "Context", "MarginsRecipe", "Recipe", "RecipeBase", "Sampling",
    "TemplateSite", "ThinkRecipe", "TreeRecipe",
    "ask_many_default_template", "ask_many_recipe", "builtin_descriptions", "builtin_names", "builtin_text",
    "check_recipe", "check_run_inputs", "compile_recipe", "each_plan", "document_template_to_recipe", "dump_recipe",
    "escape_dollars", "fill", "format_path", "load_recipe", "load_recipe_text", "margins_job", "margins_recipe_data",
    "margins_recipe_text", "explore_recipe_text", "think_recipe_text", "beam_recipe_text", "parse_vars", "parse_yaml", "read_recipe_source", "recipe_events", "resolved_seed",
    "sampling_from_flags", "strategy_names", "template_variables", "validate_recipe_data", "values_and_context",
    "with_constraint", "with_flags", "with_sampling",
]
