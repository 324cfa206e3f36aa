"""The ask-many recipe: independent branches over one context.

`questions` + `template` is shorthand for a flat `branches` list: each question becomes a branch
labelled by the question, its prompt the template with $question filled in. With `retrieve: K`
each question's $context is its K best passages of the context's documents (as `mdcli ask-many
--retrieve K`: strategies.ask_many), and its branch names them as its sources.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from mdcli import api
from mdcli.constraints import compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.documents.chunks import DEFAULT_CHUNK_TOKENS, MIN_CHUNK_TOKENS, chunk_documents
from mdcli.documents.inputs import Document
from mdcli.documents.retrieve import ChunkIndex, context_text
from mdcli.strategies.ask_many import unretrieved_notes
from mdcli.strategies.segmenting import token_counter
from mdcli.strategies.prompts import prompt_token_ids
from mdcli.recipes.branches import BranchesRecipe, branch_spec
from mdcli.recipes.checks import check_branch_list, check_questions, question_sites
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import Branch, TemplateSite
from mdcli.recipes.templates import ask_many_default_template, fill, recipe_template_to_document
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE, AskMany

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.strategies.job import RunOptions


class AskManyRecipe(BranchesRecipe):
    """ask-many: independent branches over one context. `questions` + `template` is shorthand for
    a flat `branches` list: each question becomes a branch labelled by the question."""

    strategy: Literal["ask-many"]
    questions: list[str] | None = None
    template: str | None = None
    branches: list[Branch] | None = None
    retrieve: int | None = Field(None, ge=1)  # each question reads its K best passages of the context
    chunk_tokens: int | None = Field(None, ge=MIN_CHUNK_TOKENS)  # a passage's most tokens (default 256)
    runs_each: ClassVar[bool] = True

    def check(self, var_names: set[str]) -> None:
        if self.retrieve is not None and (self.questions is None or self.context is None):
            raise Problem(("retrieve",), "needs `questions:` and a `context:`", "add them, or remove `retrieve:`")
        if self.chunk_tokens is not None and self.retrieve is None:
            raise Problem(("chunk_tokens",), "only applies with `retrieve:`", "add `retrieve: K`, or remove it")
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
        index = self._index(tokenizer, values) if self.retrieve is not None else None
        specs, constraint = [], compile_for(self.constraint, tokenizer)
        for question in self.questions:
            label = fill(question, values)
            hits = index.top(label, self.retrieve) if index is not None else []
            context = {"context": context_text(hits)} if index is not None else {}
            text = fill(template, {**values, **context, "question": label})
            ids = prompt_token_ids(tokenizer, text, system=self.system, chat_template=self.chat_template)
            spec = branch_spec(label, ids, settings, [], constraint)
            spec.sources = tuple(hit.source() for hit in hits)
            specs.append(spec)
        return specs

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        """run_specs, with a note for each question that retrieved nothing (`retrieve:` only)."""
        specs = self.specs(model.tokenizer, values)
        return api.run_specs(
            model, specs, strategy=self.strategy_name(), seed=self.sampling.seed, options=options,
            notes=unretrieved_notes(specs) if self.retrieve is not None else (),
        )

    def each_job(self, values: dict[str, str]) -> AskMany:
        """The ask-many job of `mdcli run RECIPE --each`: the recipe's questions, template (in
        ask-many's form), system, sampling, retrieval and constraint, each document's prompts those
        of this recipe run on it alone (and of `mdcli ask-many FILE` with the same settings)."""
        if self.questions is None:
            raise Problem(("branches",), "--each asks `questions:` of every document, not a branch list",
                          "write the branches as `questions:` with a `template:`, or run it without --each")
        settings = self.sampling
        return AskMany(
            questions=[fill(question, values) for question in self.questions],
            template=DEFAULT_TEMPLATE if self.template is None else recipe_template_to_document(self.template, values),
            system=self.system, chat_template=self.chat_template, sampling=settings.params(),
            max_new_tokens=settings.new_tokens(), stop=settings.stop_strings(), retrieve=self.retrieve,
            chunk_tokens=self.chunk_tokens or DEFAULT_CHUNK_TOKENS, constraint=self.constraint,
        )

    def _index(self, tokenizer, values: dict[str, str]) -> ChunkIndex:
        """The BM25 index of the context's passages (compile.ContextText knows its documents)."""
        context = values["context"]
        documents = getattr(context, "documents", None) or [Document("context", context)]
        budget = self.chunk_tokens or DEFAULT_CHUNK_TOKENS
        return ChunkIndex(chunk_documents(documents, budget, token_counter(tokenizer)))
