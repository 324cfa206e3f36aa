"""ask-many: many questions about one document, each a branch sharing the document's cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from mdcli.core.decoding import BranchSpec
from mdcli.errors import UsageError
from mdcli.strategies.prompts import fill_template, prompt_token_ids
from mdcli.core.sampling import SamplingParams

DEFAULT_TEMPLATE = "$document\n\nAnswer this question about the text above.\nQuestion: $question"
"""The user turn for every question: the document first, so all questions share its tokens."""


@dataclass
class AskMany:
    document: str
    questions: list[str]
    system: str | None = None
    template: str = DEFAULT_TEMPLATE
    chat_template: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.document.strip():
            raise UsageError("the document is empty", fix="give a file or stdin with some text")
        if not self.questions:
            raise UsageError("no questions given", fix="add -q \"...\" or --questions-file FILE")
        for number, question in enumerate(self.questions, 1):
            if not question.strip():
                raise UsageError(f"question {number} is empty", fix="remove it or write the question")
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1", fix="use a positive number")
        fill_template(self.template, "question", document="", question="")  # fails before any model loads

    def branches(self, tokenizer) -> list[BranchSpec]:
        self.validate()
        specs = []
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
                )
            )
        return specs
