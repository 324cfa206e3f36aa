"""ask-many: many questions about one document, each a branch sharing the document's cache."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from mdcli.constraints import Constraint, compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.errors import UsageError
from mdcli.strategies.job import FieldError, Job
from mdcli.strategies.prompts import fill_template, prompt_token_ids
from mdcli.core.sampling import SamplingParams

DEFAULT_TEMPLATE = "$document\n\nAnswer this question about the text above.\nQuestion: $question"
"""The user turn for every question: the document first, so all questions share its tokens."""


class AskMany(Job):
    """One ask-many job: every question about one document (checked by `validate`)."""

    document: str
    questions: list[str]
    system: str | None = None
    template: str = DEFAULT_TEMPLATE  # the user turn, with $document and $question
    chat_template: bool = True
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    max_new_tokens: int = Field(256, ge=1)
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # every answer's shape (--choices / --regex / --schema)

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name == "max_new_tokens":
            return FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        return super().problem(name, value, data, message)

    def validate(self) -> None:
        if not self.document.strip():
            raise UsageError("the document is empty", fix="give a file or stdin with some text")
        if not self.questions:
            raise FieldError("no questions given", fix="add {questions}")
        for number, question in enumerate(self.questions, 1):
            if not question.strip():
                raise UsageError(f"question {number} is empty", fix="remove it or write the question")
        if self.max_new_tokens < 1:
            raise FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        fill_template(self.template, "question", document="", question="")  # fails before any model loads

    def branches(self, tokenizer) -> list[BranchSpec]:
        self.validate()
        specs = []
        constraint = compile_for(self.constraint, tokenizer)  # once: each branch starts its own state
        for question in self.questions:
            text = fill_template(self.template, "question", document=self.document, question=question)
            ids = prompt_token_ids(tokenizer, text, system=self.system, chat_template=self.chat_template)
            specs.append(
                BranchSpec(
                    label=question,
                    prompt_ids=ids,
                    sampling=self.sampling,
                    max_new_tokens=self.max_new_tokens,
                    stop=self.stop,
                    constraint=constraint,
                )
            )
        return specs
