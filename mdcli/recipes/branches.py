"""Recipes that are a list of branches (ask-many, tree): compiled to BranchSpecs, run by run_specs.

Roots are whole prompts (prompts.prompt_token_ids: chat template, system, the context through
$context); children are continuation turns after their parent's answer
(prompts.continuation_token_ids). Each branch's sampling is its parent's with its own layer on top.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from mdcli import api
from mdcli.constraints import Constraint, compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.strategies.prompts import continuation_token_ids, prompt_token_ids
from mdcli.recipes.checks import branch_sites
from mdcli.recipes.compile import values_and_context
from mdcli.recipes.schema import Branch, RecipeBase, Sampling, TemplateSite
from mdcli.recipes.templates import fill

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.strategies.job import RunOptions


class BranchesRecipe(RecipeBase):
    """What ask-many and tree share: `branches:` (a subclass declares the field) and their run.
    `constraint:` is every branch's (children included) unless the branch states its own."""

    constraint: Constraint | None = None

    def branch_tree(self) -> list[Branch]:
        return self.branches or []

    def template_sites(self) -> Iterator[TemplateSite]:
        for index, branch in enumerate(self.branch_tree()):
            yield from branch_sites(branch, ("branches", index))

    def branch_specs(self, tokenizer, *, input_text: str | None, vars: dict[str, str] | None) -> list[BranchSpec]:
        values, _ = values_and_context(self, input_text, vars)
        return self.specs(tokenizer, values)

    def specs(self, tokenizer, values: dict[str, str]) -> list[BranchSpec]:
        """The root specs, with the variables' values known."""
        return [root_spec(branch, self, tokenizer, values, self.sampling) for branch in self.branch_tree()]

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        return api.run_specs(
            model, self.specs(model.tokenizer, values), strategy=self.strategy_name(), seed=self.sampling.seed,
            options=options,
        )


def root_spec(branch: Branch, recipe: RecipeBase, tokenizer, values: dict[str, str], parent: Sampling) -> BranchSpec:
    settings = parent.then(branch.sampling)
    text = fill(branch.prompt, values)
    ids = prompt_token_ids(tokenizer, text, system=recipe.system, chat_template=recipe.chat_template)
    children = [_child_spec(child, recipe, tokenizer, values, settings) for child in branch.children]
    return branch_spec(branch.label, ids, settings, children, _constraint(branch, recipe, tokenizer))


def _constraint(branch: Branch, recipe: RecipeBase, tokenizer):
    given: Constraint | None = branch.constraint or getattr(recipe, "constraint", None)
    return compile_for(given, tokenizer)


def _child_spec(branch: Branch, recipe: RecipeBase, tokenizer, values: dict[str, str], parent: Sampling) -> BranchSpec:
    """A follow-up inherits its parent's sampling, then applies its own overrides."""
    settings = parent.then(branch.sampling)
    ids = continuation_token_ids(tokenizer, fill(branch.prompt, values), chat_template=recipe.chat_template)
    children = [_child_spec(child, recipe, tokenizer, values, settings) for child in branch.children]
    return branch_spec(branch.label, ids, settings, children, _constraint(branch, recipe, tokenizer))


def branch_spec(label: str, ids: list[int], settings: Sampling, children: list[BranchSpec], constraint=None) -> BranchSpec:
    return BranchSpec(
        label=label, prompt_ids=ids, sampling=settings.params(), max_new_tokens=settings.new_tokens(),
        stop=settings.stop_strings(), children=children, constraint=constraint,
    )
