"""ask-many: many questions about one document (or many), each a branch sharing the document's cache.

Several documents without retrieval are read as one shared context, in order, each under a
`# path` header line (documents.inputs.joined_text); a context the model cannot hold is refused
before anything runs. With `retrieve` = K, each question reads only its K best chunks (BM25,
documents.retrieve), laid out in corpus order and tagged `[n] path:first-last`; each branch
announces those chunks as its `sources`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from mdcli.constraints import Constraint, compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.core.sampling import SamplingParams
from mdcli.documents.chunks import DEFAULT_CHUNK_TOKENS, MIN_CHUNK_TOKENS, chunk_documents
from mdcli.documents.inputs import Document, joined_text
from mdcli.documents.retrieve import ChunkIndex, context_text
from mdcli.errors import UsageError
from mdcli.events import Note
from mdcli.strategies.job import FieldError, Job
from mdcli.strategies.prompts import fill_template, prompt_token_ids
from mdcli.strategies.segmenting import token_counter

DEFAULT_TEMPLATE = "$document\n\nAnswer this question about the text above.\nQuestion: $question"
"""The user turn for every question: the document first, so all questions share its tokens."""


class AskMany(Job):
    """One ask-many job: every question about one document or several (checked by `validate`).
    `document` is one text; `documents` (path + text each) replaces it when given."""

    document: str = ""
    documents: list[Document] = Field(default_factory=list)
    questions: list[str]
    system: str | None = None
    template: str = DEFAULT_TEMPLATE  # the user turn, with $document and $question
    chat_template: bool = True
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    max_new_tokens: int = Field(256, ge=1)
    stop: tuple[str, ...] = ()
    retrieve: int | None = Field(None, ge=1)  # None: every question reads every document
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, ge=MIN_CHUNK_TOKENS)  # a retrieved chunk's most tokens
    constraint: Constraint | None = None  # every answer's shape (--choices / --regex / --schema)

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name == "max_new_tokens":
            return FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        if name == "chunk_tokens":
            return FieldError(f"{{chunk_tokens}} must be at least {MIN_CHUNK_TOKENS} (got {value})",
                              fix="use a larger number")
        return super().problem(name, value, data, message)

    def corpus(self) -> list[Document]:
        """The documents read: `documents`, or `document` as one called "document"."""
        return list(self.documents) or [Document("document", self.document)]

    def validate(self) -> None:
        if not self.documents and not self.document.strip():
            raise UsageError("the document is empty", fix="give a file or stdin with some text")
        if not self.questions:
            raise FieldError("no questions given", fix="add {questions}")
        for number, question in enumerate(self.questions, 1):
            if not question.strip():
                raise UsageError(f"question {number} is empty", fix="remove it or write the question")
        if self.max_new_tokens < 1:
            raise FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        fill_template(self.template, "question", document="", question="")  # fails before any model loads

    def branches(self, tokenizer, context_length: int | None = None) -> list[BranchSpec]:
        """One branch per question. Without retrieval, a prompt longer than `context_length` (the
        model's) is refused here, before any forward, with the way out."""
        self.validate()
        if self.retrieve is not None:
            return self._retrieved_branches(tokenizer)
        text = joined_text(self.documents) if self.documents else self.document
        constraint = compile_for(self.constraint, tokenizer)  # once: each branch starts its own state
        specs = [self._spec(tokenizer, text, question, constraint) for question in self.questions]
        check_context_fits(specs, context_length, len(self.corpus()))
        return specs

    def _retrieved_branches(self, tokenizer) -> list[BranchSpec]:
        index = ChunkIndex(chunk_documents(self.corpus(), self.chunk_tokens, token_counter(tokenizer)))
        specs, constraint = [], compile_for(self.constraint, tokenizer)  # once: each branch starts its own state
        for question in self.questions:
            hits = index.top(question, self.retrieve)
            spec = self._spec(tokenizer, context_text(hits), question, constraint)
            spec.sources = tuple(hit.source() for hit in hits)
            specs.append(spec)
        return specs

    def _spec(self, tokenizer, document: str, question: str, constraint) -> BranchSpec:
        text = fill_template(self.template, "question", document=document, question=question)
        ids = prompt_token_ids(tokenizer, text, system=self.system, chat_template=self.chat_template)
        return BranchSpec(
            label=question, prompt_ids=ids, sampling=self.sampling, max_new_tokens=self.max_new_tokens, stop=self.stop,
            constraint=constraint,
        )


def unretrieved_notes(specs: list[BranchSpec]) -> list[Note]:
    """A `retrieval` note for each question that retrieved no passage (no word of it, stop words
    aside, is in the documents): its answer has no source to stand on, and says only what the
    model makes of the question alone."""
    return [
        Note(kind="retrieval", message=f"'{spec.label}' shares no word with the documents: no passage retrieved, so "
             "it is answered without sources; reword it with the documents' words, or drop --retrieve",
             data={"question": spec.label, "passages": 0})
        for spec in specs if not spec.sources
    ]


def check_context_fits(specs: list[BranchSpec], context_length: int | None, documents: int = 1) -> None:
    """Refuse prompts the model cannot read whole (each needs room for one new token), naming the
    count against the limit and the two ways to read less: retrieval, or margins with each segment
    read alone."""
    if context_length is None or not specs:
        return
    longest = max(len(spec.prompt_ids) for spec in specs)
    if longest < context_length:
        return
    what = f"the {documents} documents" if documents > 1 else "the document"
    over = longest - context_length + 1  # a prompt needs room for one new token
    # margins' default layout for one document (chain) reads it whole by its last segment, which
    # is as long as this prompt: only the independent layout is a way out
    raise FieldError(
        f"{what} and the question make a prompt of {longest:,} tokens, {over:,} more than the model's context of "
        f"{context_length} allows",
        fix="use {retrieve} K to read only each question's K best passages, or mdcli margins --context independent "
            "to read it one segment at a time",
    )
