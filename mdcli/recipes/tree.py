"""The tree recipe: branches with follow-ups; a child forks when its parent finishes."""

from __future__ import annotations

from typing import Literal

from mdcli.recipes.branches import BranchesRecipe
from mdcli.recipes.checks import check_branch_list
from mdcli.recipes.schema import Branch


class TreeRecipe(BranchesRecipe):
    """tree: branches with follow-ups; a child forks when its parent finishes."""

    strategy: Literal["tree"]
    branches: list[Branch]

    def check(self, var_names: set[str]) -> None:
        check_branch_list(self.branches, ("branches",), nested=True)
