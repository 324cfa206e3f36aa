"""The think recipe: parallel chains of thought over one question, run by api.think."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from mdcli import api
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import RecipeBase, TemplateSite
from mdcli.recipes.templates import fill

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.speculative.planner import Speculate


class ThinkRecipe(RecipeBase):
    """think: parallel chains of thought over one question (which may use $context), then a
    merged conclusion and/or a vote."""

    strategy: Literal["think"]
    question: str
    paths: int = Field(4, ge=1)
    plan: bool = False
    max_paths: int = Field(8, ge=1)
    merge: Literal["reencode", "attend", "none"] | None = None
    vote: bool = False
    answer_pattern: str | None = None
    path_instructions: list[str] = Field(default_factory=list)
    plan_tokens: int = Field(128, ge=1)
    conclusion_tokens: int = Field(256, ge=1)

    def check(self, var_names: set[str]) -> None:
        if not self.question.strip():
            raise Problem(("question",), "is empty", "write the question to think about")
        for index, instruction in enumerate(self.path_instructions):
            if not instruction.strip():
                raise Problem(("path_instructions", index), "is empty", "write the instruction or remove it")
        if self.answer_pattern is not None:
            try:
                re.compile(self.answer_pattern)
            except re.error as error:
                raise Problem(("answer_pattern",), f"is not a valid regular expression: {error}", "fix the pattern") from None

    def template_sites(self) -> Iterator[TemplateSite]:
        yield TemplateSite(("question",), self.question, "root")

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        max_forward_tokens: int, speculation: Speculate | None,
    ) -> Iterator[Event]:
        settings = self.sampling
        return api.think(
            model, fill(self.question, values), paths=self.paths, plan=self.plan, max_paths=self.max_paths,
            merge=self.merge, vote=self.vote, answer_pattern=self.answer_pattern,
            path_instructions=list(self.path_instructions),
            system=self.system, chat_template=self.chat_template, sampling=settings.params(),
            max_new_tokens=settings.new_tokens(), plan_tokens=self.plan_tokens,
            conclusion_tokens=self.conclusion_tokens, stop=settings.stop_strings(), max_forward_tokens=max_forward_tokens,
            speculate=speculation,
        )
