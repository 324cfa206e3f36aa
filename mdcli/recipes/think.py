"""The think recipe: parallel chains of thought over one question, run by api.think."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from mdcli import api
from mdcli.core.decoding import BranchSpec
from mdcli.recipes.compile import values_and_context
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import RecipeBase, TemplateSite
from mdcli.recipes.templates import fill
from mdcli.strategies.think import Think, ThinkOptions

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.strategies.job import RunOptions


class ThinkRecipe(RecipeBase, ThinkOptions):
    """think: parallel chains of thought over one question (which may use $context), then a
    merged conclusion and/or a vote."""

    strategy: Literal["think"]
    question: str
    # the rest of the fields are think's own parameters, with their defaults and bounds: ThinkOptions

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

    def job(self, values: dict[str, str]) -> Think:
        settings = self.sampling
        job = Think(
            question=fill(self.question, values), system=self.system, chat_template=self.chat_template,
            sampling=None, max_new_tokens=settings.new_tokens(Think.model_fields["max_new_tokens"].default),
            stop=settings.stop_strings(), **{name: getattr(self, name) for name in ThinkOptions.model_fields},
        )
        # the job's default sampling for these paths (as `mdcli think`), with what the recipe states on top
        stated = {name: value for name, value in settings.stated().items() if name in type(job.sampling).model_fields}
        job = job.model_copy(update={"sampling": job.sampling.model_copy(update=stated)})
        return job

    def branch_specs(self, tokenizer, *, input_text: str | None, vars: dict[str, str] | None) -> list[BranchSpec]:
        """For `mdcli explain`: the first phase's branches, the plan, or the paths (each under the
        constraint it decodes with: the vote's answer pattern, or the answer's shape with merge none)."""
        values, _ = values_and_context(self, input_text, vars)
        job = self.job(values)
        job.validate()
        return [job.plan_spec(tokenizer)] if job.plan else [job.path_spec(tokenizer, i) for i in range(job.paths)]

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        return api.think(model, self.job(values), options=options)
