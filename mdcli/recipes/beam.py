"""The beam recipe: exact beam search (generate(num_beams=width)), run by api.beam_search."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from mdcli import api
from mdcli.errors import RecipeError
from mdcli.recipes.checks import check_questions, question_sites
from mdcli.recipes.errors import Problem, short
from mdcli.recipes.schema import RecipeBase, TemplateSite
from mdcli.recipes.templates import ask_many_default_template, escape_dollars, fill
from mdcli.strategies.beam import BeamOptions, BeamParams
from mdcli.strategies.beam.search import REFUSES

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.speculative.planner import Speculate
    from mdcli.strategies.job import RunOptions


class BeamRecipe(RecipeBase, BeamOptions):
    """beam: exact beam search (generate(num_beams=width)). `prompt` is the whole prompt (it may
    use $context and $vars); or `questions` (+ optional `template`), one beam set per question
    over the context. Greedy by nature: of `sampling`, only max_new_tokens applies (default 64)."""

    strategy: Literal["beam"]
    prompt: str | None = None
    questions: list[str] | None = None
    template: str | None = None
    # width, num_return, length_penalty: beam's own parameters, with their defaults and bounds (BeamOptions)
    early_stopping: Any = BeamOptions.model_fields["early_stopping"].default  # checked in check(): one clear message

    field_fixes: ClassVar[dict[str, str]] = {
        "width": "use a whole number of at least 1 (the number of beams)",
        "num_return": "use a whole number of at least 1 (and at most width)",
    }

    def check(self, var_names: set[str]) -> None:
        if self.prompt is None and self.questions is None:
            raise Problem(("prompt",), "missing", "add `prompt:` (the prompt text), or `questions:` (a list)")
        if self.prompt is not None and self.questions is not None:
            raise Problem(("questions",), "prompt and questions are both given", "keep one of them")
        if self.template is not None and self.questions is None:
            raise Problem(("template",), "only applies to `questions:`", "remove it, or use questions instead of prompt")
        if self.prompt is not None and not self.prompt.strip():
            raise Problem(("prompt",), "is empty", "write the prompt text")
        if self.questions is not None:
            check_questions(self.questions)
            if self.context is None:
                raise Problem(
                    ("context",), "beam questions are asked about a context, but the recipe has none",
                    "add `context: {input: true}` (or text: / file:), or use `prompt:` instead",
                )
        if self.num_return > self.width:
            raise Problem(
                ("num_return",), f"{self.num_return} is more than width {self.width}",
                "use num_return <= width (beam search keeps width hypotheses)",
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise Problem(("early_stopping",), f"{short(self.early_stopping)} is not allowed", "use true, false or never")

    def template_sites(self) -> Iterator[TemplateSite]:
        if self.prompt is not None:
            yield TemplateSite(("prompt",), self.prompt, "root")
        yield from question_sites(self.questions, self.template, ask_many_default_template())

    def speculation(self, flag: str | None) -> Speculate | None:
        """Never: the candidates are ranked across beams at every step."""
        if flag is not None or self.speculate is not None:
            raise RecipeError(
                f"{self.source}: speculate: beam search does not speculate ({REFUSES['speculate']})", fix="remove speculate from the recipe and --speculate from the command")
        return None

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        fields = {name: getattr(self, name) for name in BeamOptions.model_fields}
        fields |= {
            "max_new_tokens": self.sampling.new_tokens(BeamParams.model_fields["max_new_tokens"].default),
            "system": self.system, "chat_template": self.chat_template, "options": options,
        }
        if self.questions is None:
            return api.beam_search(model, fill(self.prompt, values), **fields)
        # the API's template is in ask-many form ($document, $question): fill the recipe's own
        # variables now (escaped, so a `$` in a value stays literal) and leave those two to the API
        escaped = {name: escape_dollars(value) for name, value in values.items()}
        template = fill(self.template or ask_many_default_template(),
                        {**escaped, "context": "$document", "question": "$question"})
        questions = [fill(question, values) for question in self.questions]
        return api.beam_search(model, context, questions, template=template, **fields)
