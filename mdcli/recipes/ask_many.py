"""The ask-many recipe: independent branches over one context.

`questions` + `template` is shorthand for a flat `branches` list: each question becomes a branch
labelled by the question, its prompt the template with $question filled in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from mdcli.constraints import compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.strategies.prompts import prompt_token_ids
from mdcli.recipes.branches import BranchesRecipe, branch_spec
from mdcli.recipes.checks import check_branch_list, check_questions, question_sites
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import Branch, TemplateSite
from mdcli.recipes.templates import ask_many_default_template, fill


class AskManyRecipe(BranchesRecipe):
    """ask-many: independent branches over one context. `questions` + `template` is shorthand for
    a flat `branches` list: each question becomes a branch labelled by the question."""

    strategy: Literal["ask-many"]
    questions: list[str] | None = None
    template: str | None = None
    branches: list[Branch] | None = None

    def check(self, var_names: set[str]) -> None:
        if self.questions is None and self.branches is None:
            raise Problem(("questions",), "missing", "add `questions:` (a list), or `branches:`")
        if self.questions is not None and self.branches is not None:
            raise Problem(("branches",), "questions and branches are both given", "keep one of them")
        if self.template is not None and self.questions is None:
            raise Problem(("template",), "only applies to `questions:`", "remove it, or use questions instead of branches")
        if self.questions is not None:
            check_questions(self.questions)
        for index, branch in enumerate(self.branches or []):
            if branch.children:
                raise Problem(
                    ("branches", index, "children"), "ask-many branches cannot have children",
                    "use `strategy: tree` for follow-up questions",
                )
        if self.branches is not None:
            check_branch_list(self.branches, ("branches",), nested=False)

    def template_sites(self) -> Iterator[TemplateSite]:
        yield from question_sites(self.questions, self.template, ask_many_default_template())
        yield from super().template_sites()

    def specs(self, tokenizer, values: dict[str, str]) -> list[BranchSpec]:
        if self.questions is None:
            return super().specs(tokenizer, values)
        settings, template = self.sampling, self.template or ask_many_default_template()
        specs, constraint = [], compile_for(self.constraint, tokenizer)
        for question in self.questions:
            label = fill(question, values)
            text = fill(template, {**values, "question": label})
            ids = prompt_token_ids(tokenizer, text, system=self.system, chat_template=self.chat_template)
            specs.append(branch_spec(label, ids, settings, [], constraint))
        return specs
