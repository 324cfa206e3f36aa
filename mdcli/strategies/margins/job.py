"""margins, what a run asks: the documents, the questions, every parameter (MarginsOptions,
shared with the recipe), and every prompt text.

No model is needed here except a tokenizer to build token ids. The running of the three phases
is run.py (its docstring documents the prompts and the events); what fits in the context and in
memory is fit.py.

Several questions: every question gets its own margin per segment, its own classifications and
its own answer. Each of those prompts is exactly the prompt that question would get in a run of
its own (same template, same segment labels in its notes), so a multi-question run gives each
question the tokens a single-question run gives it. The margin template puts `$context` before
`$query`, so all questions' margins of one segment share that segment's cached tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from mdcli.constraints import Constraint, compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.core.sampling import SamplingParams
from mdcli.errors import UsageError
from mdcli.strategies.job import FieldError, Job, Options
from mdcli.strategies.prompts import fill_template, prompt_token_ids
from mdcli.strategies.segmenting import DEFAULT_SEGMENT_TOKENS, Segment, check_segment_tokens, split_documents, token_counter

Layout = Literal["chain", "independent"]
Keep = Literal["all", "relevant"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
KEEPS: tuple[str, ...] = get_args(Keep)

MARGIN_TEMPLATE = (
    "```\n$context\n```\n"
    'Given the above context, extract all information relevant to the query: "$query". '
    'If the context is not relevant to the query, answer "I don\'t know."'
)
"""The paper's extractive-summary prompt. The context comes first so that, in the chain layout,
margin i+1's prompt begins with margin i's context, and so that every question's margin of one
segment begins with the same tokens (shared in the cache)."""

CLASSIFICATION_RULES = (
    "Should I save it for later?\n"
    "Here are rules:\n"
    "- Answer YES if the answer contains information about the query.\n"
    "- Answer NO if the answer says the piece isn't related to the query.\n\n"
    "Provide the answer in the format: <YES/NO>#<Explanation>.\n"
    "Here are example answers:\n\n"
    "YES#Yes, the information contains an excerpt from a book that is related to the question.\n"
    "NO#No, the LLM assistant concluded the information isn't relevant.\n\n"
    'Don\'t add any other comments, all your remarks should be included in the "Explanation" section.'
)
CLASSIFICATION_TEMPLATE = (
    'I asked an LLM assistant whether a piece of document is related to the query: "$query". '
    "This is its answer:\n```text\n$margin\n```\n" + CLASSIFICATION_RULES
)
"""The paper's classifier prompt: the margin is judged without the segment it came from."""

CLASSIFICATION_CONSTRAINT = Constraint(regex=r"(YES|NO)#[^\n]*")
"""The classifier's reply, as CLASSIFICATION_RULES ask for it: the label, '#', a one-line
explanation. Without it the embedded model wrote every verdict as "relevant" or unreadable
(docs/performance.md, "Margins' labels")."""

ANSWER_TEMPLATE = "Notes taken while reading the document:\n```\n$notes\n```\n$query"
"""The paper's final prompt (margins, then the query), with a line saying what the notes are."""

NOTE_TEMPLATE = "[$label] $margin"
NOTE_WITH_SEGMENT_TEMPLATE = "[$label]\n$segment\nNote: $margin"
NO_NOTES = "(no relevant notes)"
NOTE_SEPARATOR = "\n\n"
DOCUMENT_SEPARATOR = "\n\n"
"""Between documents in the chain layout's context."""


@dataclass(frozen=True)
class MarginsPrompts:
    """Every text the strategy writes to the model; recipes and flags may replace any of them."""

    margin: str = MARGIN_TEMPLATE  # $context, $query
    classification: str = CLASSIFICATION_TEMPLATE  # $query, $margin
    answer: str = ANSWER_TEMPLATE  # $notes, $query
    note: str = NOTE_TEMPLATE  # $label, $margin
    note_with_segment: str = NOTE_WITH_SEGMENT_TEMPLATE  # $label, $segment, $margin
    no_notes: str = NO_NOTES
    system: str | None = None  # None: the chat template's default system prompt, if any

    def check(self) -> None:
        """Fill every template once with placeholders, so a bad one fails before the model loads."""
        fill_template(self.margin, "margin", context="c", query="q")
        fill_template(self.classification, "classification", query="q", margin="m")
        fill_template(self.answer, "answer", notes="n", query="q")
        fill_template(self.note, "note", label="l", margin="m")
        fill_template(self.note_with_segment, "note-with-segment", label="l", segment="s", margin="m")

    def question_first(self) -> bool:
        """Whether the margin template puts $query before $context: then the questions' margins
        share no segment tokens (still exact, only slower and larger)."""
        query, context = self.margin.find("$query"), self.margin.find("$context")
        if query < 0:
            query = self.margin.find("${query}")
        if context < 0:
            context = self.margin.find("${context}")
        return 0 <= query < context


@dataclass
class MarginResult:
    """A finished margin and what became of it."""

    number: int  # 1-based segment number
    segment: Segment
    label: str  # the segment's label ("segment 3/8"): what the answer's notes call it
    branch: int
    text: str
    relevant: bool = True
    parsed: bool = True
    reason: str = ""
    classification_branch: int | None = None
    question: int = 0  # 0-based index of the question this margin was written for


class MarginsOptions(Options):
    """margins' parameters: the job's and the recipe's (mdcli/recipes/margins.py) alike."""

    layout: Layout | None = None  # None: chain for one document, independent for several
    # at least MIN_SEGMENT_TOKENS: the segmenter's own rule, checked by validate() (and by the splitter)
    segment_tokens: int = Field(DEFAULT_SEGMENT_TOKENS, ge=1)
    keep: Keep = "relevant"  # the margins the answer reads: those classified relevant, or all
    classify: bool = True  # False: no classification; the answer reads every margin
    # the classifier's reply decodes under CLASSIFICATION_CONSTRAINT: it always starts YES# or NO#
    classify_constraint: bool = True
    with_segments: bool = False  # the answer's notes quote each kept margin's segment too
    # None: follow the margins' limit (-n), as Margins resolves it; see Margins._token_limits
    classify_tokens: int | None = Field(None, ge=1)
    answer_tokens: int | None = Field(None, ge=1)


DEFAULT_MARGIN_TOKENS = 48
DEFAULT_CLASSIFY_TOKENS = 24
DEFAULT_ANSWER_TOKENS = 256


class Margins(Job, MarginsOptions):
    """One run: documents, one or more questions and every choice; `validate()` needs no model.

    `query` is the one-question form; `questions` the several-question form (give one of them)."""

    documents: list[str]
    query: str = ""
    questions: list[str] = Field(default_factory=list)
    names: list[str] | None = None
    prompts: MarginsPrompts = Field(default_factory=MarginsPrompts)
    chat_template: bool = True
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    margin_tokens: int | None = Field(None, ge=1)  # -n (a recipe's sampling.max_new_tokens); see _token_limits
    memory_budget_bytes: int | None = None  # None: MEMORY_SHARE of the device's free memory

    @model_validator(mode="after")
    def _token_limits(self) -> Margins:
        """-n (`margin_tokens`) bounds every phase unless the phase's own limit is given: a margin
        gets -n tokens, a classification min(24, -n), the answer -n. Without -n: margins 48,
        classifications 24, the answer 256 (DEFAULT_*_TOKENS)."""
        given = self.margin_tokens
        self.margin_tokens = DEFAULT_MARGIN_TOKENS if given is None else given
        if self.classify_tokens is None:
            self.classify_tokens = DEFAULT_CLASSIFY_TOKENS if given is None else min(DEFAULT_CLASSIFY_TOKENS, given)
        if self.answer_tokens is None:
            self.answer_tokens = DEFAULT_ANSWER_TOKENS if given is None else given
        return self

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name == "layout":
            return FieldError(f"unknown context layout '{value}'", fix="use {layout} chain or independent")
        if name == "keep":
            return FieldError(f"unknown {{keep}} '{value}'", fix="use {keep} all or relevant")
        if name == "segment_tokens" and isinstance(value, int):
            try:
                check_segment_tokens(value)
            except FieldError as error:
                return error
        if name in ("margin_tokens", "classify_tokens", "answer_tokens") and isinstance(value, int):
            return FieldError(f"{{{name}}} must be at least 1", fix="use a positive number")
        return super().problem(name, value, data, message)

    # -- checks without a model --------------------------------------------------------------

    def validate(self) -> None:
        self._check_questions()
        if not self.documents:
            raise UsageError("no documents given", fix="give one or more files, or - for stdin")
        for name, text in zip(self.document_names(), self.documents):
            if not text.strip():
                raise UsageError(f"{name} is empty", fix="give a document with some text")
        check_segment_tokens(self.segment_tokens)  # layout, keep and the token limits: checked by the fields
        self.prompts.check()

    def _check_questions(self) -> None:
        if self.query and self.questions:
            raise UsageError(
                "both a query and a list of questions were given", fix="give the query as one of the questions"
            )
        questions = self.all_questions()
        if not questions or (len(questions) == 1 and not questions[0].strip()):
            raise UsageError("the query is missing", fix='add -q "your question" (repeat -q for several)')
        first: dict[str, int] = {}
        for number, question in enumerate(questions, 1):
            if not question.strip():
                raise UsageError(f"question {number} is empty", fix="remove it or write the question")
            if question.strip() in first:
                raise UsageError(
                    f"question {number} repeats question {first[question.strip()]}", fix="ask each question once"
                )
            first[question.strip()] = number

    def all_questions(self) -> list[str]:
        return list(self.questions) if self.questions else [self.query]

    def several(self) -> bool:
        return len(self.all_questions()) > 1

    def document_names(self) -> list[str]:
        if self.names is not None:
            if len(self.names) != len(self.documents):
                raise ValueError(f"{len(self.names)} names for {len(self.documents)} documents")
            return list(self.names)
        if len(self.documents) == 1:
            return ["the document"]
        return [f"document {i}" for i in range(1, len(self.documents) + 1)]

    def resolved_layout(self) -> Layout:
        if self.layout is not None:
            return self.layout
        return "chain" if len(self.documents) == 1 else "independent"

    # -- labels: the segment's own label, and the branch's (which names the question) ----------

    def labels(self, segments: list[Segment]) -> list[str]:
        """Segment labels, as the answer's notes name them: "segment 3/8" (+ " (doc.txt)")."""
        total = len(segments)
        several = len(self.documents) > 1
        return [
            f"segment {i}/{total}" + (f" ({s.name})" if several else "") for i, s in enumerate(segments, 1)
        ]

    def branch_label(self, question: int, label: str) -> str:
        """A margin or classification branch: its segment label, prefixed "q2 " when several."""
        return f"q{question + 1} {label}" if self.several() else label

    def answer_label(self, question: int) -> str:
        """The answer branch: "answer" for one question, the question itself for several."""
        return self.all_questions()[question].strip() if self.several() else "answer"

    def group(self, question: int) -> str:
        """What renderers group by (and JSONL consumers read): the question."""
        return self.all_questions()[question].strip()

    # -- phase 1: margins ----------------------------------------------------------------------

    def segments(self, tokenizer) -> list[Segment]:
        return split_documents(self.documents, self.segment_tokens, token_counter(tokenizer), self.document_names())

    def margin_context(self, segments: list[Segment], index: int) -> str:
        """What margin `index` (0-based) reads: the documented `$context` of its layout."""
        if self.resolved_layout() == "independent":
            return segments[index].text.strip()
        read: dict[int, str] = {}
        for segment in segments[: index + 1]:
            read[segment.document] = read.get(segment.document, "") + segment.text
        return DOCUMENT_SEPARATOR.join(text.strip() for text in read.values())

    def margin_specs(self, tokenizer, segments: list[Segment], questions: range | None = None) -> list[BranchSpec]:
        """Question-major: every segment's margin for question 1, then for question 2, ..."""
        specs = []
        for q in questions if questions is not None else range(len(self.all_questions())):
            for i, label in enumerate(self.labels(segments)):
                spec = self._spec(
                    tokenizer, self.branch_label(q, label), self.margin_prompt(segments, i, q), self.sampling,
                    self.margin_tokens,
                )
                spec.seed_key = i  # the id this margin has in a run of its question alone
                specs.append(spec)
        return specs

    def margin_prompt(self, segments: list[Segment], index: int, question: int = 0) -> str:
        context = self.margin_context(segments, index)
        query = self.all_questions()[question]
        return fill_template(self.prompts.margin, "margin", context=context, query=query)

    # -- phase 2: classification ---------------------------------------------------------------

    def classification_specs(self, tokenizer, margins: list[MarginResult]) -> list[BranchSpec]:
        total = len({m.number for m in margins})
        constraint = compile_for(CLASSIFICATION_CONSTRAINT if self.classify_constraint else None, tokenizer)
        specs = []
        for m in margins:
            query = self.all_questions()[m.question]
            text = fill_template(self.prompts.classification, "classification", query=query, margin=m.text.strip())
            label = self.branch_label(m.question, f"classification {m.number}/{total}")
            spec = self._spec(tokenizer, label, text, SamplingParams(), self.classify_tokens)
            spec.seed_key = total + m.number - 1  # as in a single-question run (greedy anyway)
            spec.constraint = constraint
            specs.append(spec)
        return specs

    # -- phase 3: the answers ------------------------------------------------------------------

    def kept(self, margins: list[MarginResult]) -> list[MarginResult]:
        return list(margins) if self.keep == "all" or not self.classify else [m for m in margins if m.relevant]

    def answer_prompt(self, kept: list[MarginResult], question: int = 0) -> str:
        query = self.all_questions()[question]
        return fill_template(self.prompts.answer, "answer", notes=self.notes(kept), query=query)

    def notes(self, kept: list[MarginResult]) -> str:
        if not kept:
            return self.prompts.no_notes
        if self.with_segments:
            blocks = [
                fill_template(
                    self.prompts.note_with_segment,
                    "note-with-segment",
                    label=m.label,
                    segment=m.segment.text.strip(),
                    margin=m.text.strip(),
                )
                for m in kept
            ]
        else:
            blocks = [fill_template(self.prompts.note, "note", label=m.label, margin=m.text.strip()) for m in kept]
        return NOTE_SEPARATOR.join(blocks)

    def answer_spec(self, tokenizer, kept: list[MarginResult], question: int = 0, segments: int = 0) -> BranchSpec:
        spec = self._spec(
            tokenizer, self.answer_label(question), self.answer_prompt(kept, question), self.sampling,
            self.answer_tokens,
        )
        spec.seed_key = segments * (2 if self.classify else 1)  # the answer's id in a run of its own
        return spec

    def _spec(self, tokenizer, label: str, user_text: str, sampling: SamplingParams, max_new: int) -> BranchSpec:
        ids = prompt_token_ids(tokenizer, user_text, system=self.prompts.system, chat_template=self.chat_template)
        return BranchSpec(label=label, prompt_ids=ids, sampling=sampling, max_new_tokens=max_new)




# -- reading the classifier ---------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    relevant: bool
    parsed: bool  # False: no YES/NO found, kept as relevant by default
    reason: str


_LEADING_VERDICT = re.compile(r"^[\s`*_\"'>\[\](){}.:#-]*(?:answer\s*[:=]\s*)?(yes|no)(?![a-z])", re.IGNORECASE)
_TAGGED_VERDICT = re.compile(r"\b(yes|no)\s*#", re.IGNORECASE)


def parse_verdict(text: str) -> Verdict:
    """Read "YES#reason" / "NO#reason" as small models actually write it: any case, wrapped in
    code fences, quotes or bold, "Answer: yes", or the tag later in the text. Nothing readable
    (or both tags): relevant, `parsed=False`, so no information is dropped on a misread."""
    cleaned = text.replace("```text", "").replace("```", "").strip()
    match = _LEADING_VERDICT.match(cleaned)
    if match is None:
        tags = {m.group(1).lower() for m in _TAGGED_VERDICT.finditer(cleaned)}
        if len(tags) != 1:
            return Verdict(relevant=True, parsed=False, reason=cleaned)
        word = tags.pop()
        rest = cleaned.split("#", 1)[1]
    else:
        word = match.group(1).lower()
        rest = cleaned[match.end() :]
    return Verdict(relevant=word == "yes", parsed=True, reason=rest.lstrip(" *_`#:-,.").strip())
