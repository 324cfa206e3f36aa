"""Moved to mdcli.recipes (MarginsRecipe, margins_recipe_data, margins_recipe_text).

Kept only because commands/margins.py imports these names from here and that file belongs to
another change (issue 12's command layer): delete this module once it imports from mdcli.recipes.
"""

from __future__ import annotations

from mdcli.commands.ask_many import _write_recipe as write_recipe
from mdcli.recipes import margins_recipe_data, margins_recipe_text

__all__ = ["margins_recipe_data", "margins_recipe_text", "write_recipe"]
