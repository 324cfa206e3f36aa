"""The margins recipe: Writing in the Margins over the context, run as a strategies.margins job.

Both ways between the recipe and the job: `job()` is the job a recipe runs (`mdcli run`, and
`mdcli explain` draws its margin phase); `margins_recipe_data(job)` is the recipe a `mdcli margins`
command line saves (--save-recipe). The document becomes `context: {input: true}`, so
`mdcli run FILE --input DOC` runs the same prompts and gives the same tokens. The segment size and
every token limit are written out, so the recipe does not change meaning if the command's defaults
do. A recipe has one context, so a run over several documents cannot be saved (refused before
anything runs, in one line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from mdcli.errors import UsageError
from mdcli.recipes.checks import check_questions
from mdcli.recipes.compile import values_and_context
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import RECIPE_VERSION, RecipeBase, TemplateSite, stated_sampling
from mdcli.recipes.templates import escape_dollars, fill
from mdcli.strategies.margins import run_margins
from mdcli.strategies.margins.job import Margins, MarginsOptions, MarginsPrompts

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.strategies.job import RunOptions

_TEMPLATE_FIELDS = {"margin_template": "margin", "classification_template": "classification",
                    "answer_template": "answer"}
# a dumped recipe's own keys, after the common ones: the order a person reads them in
_DUMP_ORDER = ("query", "questions", "layout", "segment_tokens", "keep", "classify", "classify_constraint", "with_segments",
               "margin_template", "classification_template", "answer_template", "classify_tokens", "answer_tokens")
# dumped whenever the recipe states them, even at their defaults: a saved recipe (--save-recipe
# states them all) keeps its meaning if the defaults change
_STATED_LIMITS = ("segment_tokens", "classify_tokens", "answer_tokens")


class MarginsRecipe(RecipeBase, MarginsOptions):
    """margins: Writing in the Margins over the context (the document). `query` (one question)
    or `questions` (several, sharing one cache). `sampling.max_new_tokens` bounds each margin, and
    the classifications (at most 24) and answers unless `classify_tokens` / `answer_tokens` are
    given (strategies.margins.Margins._token_limits)."""

    strategy: Literal["margins"]
    query: str | None = None
    questions: list[str] | None = None
    margin_template: str | None = None  # None: the strategy's (MarginsPrompts)
    classification_template: str | None = None
    answer_template: str | None = None
    runs_each: ClassVar[bool] = True
    # the rest of the fields are margins' own parameters, with their defaults and bounds: MarginsOptions

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        if info.exclude_defaults and info.include is None and info.exclude is None:
            data.update({name: getattr(self, name) for name in _STATED_LIMITS if name in self.model_fields_set})
        ordered = {key: value for key, value in data.items() if key not in _DUMP_ORDER}
        return ordered | {key: data[key] for key in _DUMP_ORDER if key in data}

    def check(self, var_names: set[str]) -> None:
        if self.context is None:
            raise Problem(("context",), "missing: margins reads a document", "add `context: {input: true}` (or text: / file:)")
        if (self.query is None) == (self.questions is None):
            raise Problem(
                ("query",), "give `query:` (one question) or `questions:` (a list), not both" if self.query is not None
                else "missing: margins needs a question", "write `query: ...` or `questions: [...]`",
            )
        if self.questions is not None:
            check_questions(self.questions)
        elif not self.query.strip():
            raise Problem(("query",), "is empty", "write the question to answer from the document")
        for field, name in _TEMPLATE_FIELDS.items():
            text = getattr(self, field)
            if text is None:
                continue
            try:
                dataclasses.replace(MarginsPrompts(), **{name: text}).check()
            except UsageError as error:
                raise Problem((field,), error.problem, error.fix or "see docs/recipes.md") from None

    def template_sites(self) -> Iterator[TemplateSite]:
        if self.query is not None:
            yield TemplateSite(("query",), self.query, "query")
        for index, question in enumerate(self.questions or []):
            yield TemplateSite(("questions", index), question, "query")

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        job = self.job(values, context)
        job.validate()  # here, before the first event is asked for
        return run_margins(model, job, options)

    def each_job(self, values: dict[str, str]) -> Margins:
        """The job of `mdcli run RECIPE --each`: this recipe's on each document alone (api.ask_each
        puts each document in)."""
        return self.job(values, "(each)")

    def job(self, values: dict[str, str], context: str) -> Margins:
        """The strategies.margins job this recipe runs, its variables' values known. A context of
        several documents (`files:`, or several --input) gives each its own segment group, named
        by its path (compile.ContextText knows them)."""
        overrides = {name: getattr(self, field) for field, name in _TEMPLATE_FIELDS.items()}
        prompts = MarginsPrompts(system=self.system, **{k: v for k, v in overrides.items() if v is not None})
        documents = list(getattr(context, "documents", ()))
        several = len(documents) > 1
        return Margins(
            documents=[d.text for d in documents] if several else [context],
            names=[d.path for d in documents] if several else None, query=fill(self.query, values) if self.query is not None else "",
            questions=[fill(question, values) for question in self.questions or []], prompts=prompts,
            chat_template=self.chat_template, sampling=self.sampling.params(),
            margin_tokens=self.sampling.new_tokens(Margins.model_fields["margin_tokens"].default),
            **{name: getattr(self, name) for name in MarginsOptions.model_fields},
        )


def margins_job(recipe: MarginsRecipe, *, input_text: str | None = None, vars: dict[str, str] | None = None) -> Margins:
    """The strategies.margins.Margins job a margins recipe runs (explain draws its margin phase)."""
    values, context = values_and_context(recipe, input_text, vars)
    return recipe.job(values, context)


def margins_recipe_data(job: Margins, *, given_layout: bool) -> dict[str, Any]:
    """The margins recipe (as plain data, to validate) equivalent to a `mdcli margins` job. Its
    context is the run's input: run on the same documents (`mdcli run FILE --input DOC...`, several
    each its own segment group, named by its path) it gives the job's tokens."""
    questions = [escape_dollars(q) for q in job.all_questions()]
    data: dict[str, Any] = {
        "version": RECIPE_VERSION,
        "description": "Saved from mdcli margins.",
        "strategy": "margins",
        "context": {"input": True},
    }
    if job.prompts.system is not None:
        data["system"] = job.prompts.system
    if not job.chat_template:
        data["chat_template"] = False
    data["sampling"] = stated_sampling(job.sampling, job.margin_tokens)
    if len(questions) == 1:
        data["query"] = questions[0]
    else:
        data["questions"] = questions
    if given_layout:
        data["layout"] = job.resolved_layout()
    data.update(
        segment_tokens=job.segment_tokens, keep=job.keep, classify=job.classify, with_segments=job.with_segments,
    )
    if not job.classify_constraint:
        data["classify_constraint"] = False
    defaults = MarginsPrompts()
    for name in ("margin", "classification", "answer"):
        if getattr(job.prompts, name) != getattr(defaults, name):
            data[f"{name}_template"] = getattr(job.prompts, name)
    data.update(classify_tokens=job.classify_tokens, answer_tokens=job.answer_tokens)
    return data
