"""think, what a run asks: the question, every parameter (ThinkOptions, shared with the recipe),
and the prompts and branch specs built from them. No model is needed here but a tokenizer."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from mdcli.constraints import Constraint, compile_for
from mdcli.core.decoding import BranchSpec
from mdcli.core.sampling import SamplingParams
from mdcli.documents.inputs import Document, joined_text
from mdcli.errors import UsageError
from mdcli.strategies.job import FieldError, Job, Options
from mdcli.strategies.prompts import fill_template
from mdcli.strategies.think.text import (
    ITEM_TEMPLATE,
    PLAN_INSTRUCTION,
    Turn,
    conclusion_user_text,
    conversation_token_ids,
    short_label,
    with_instruction,
)

MERGE_MODES = ("reencode", "attend", "none")
MergeMode = Literal["reencode", "attend", "none"]

PATHS_TEMPERATURE = 0.7
PATHS_SEED = 0
"""The sampling of paths that greedy decoding would make identical (several paths from one prompt:
no --plan, no --path-instruction) when none is given: diverse, and the same on every run."""
DEFAULT_PLAN_TOKENS = 128

PLAN_SEED_KEY = 1_000_000  # path i uses seed key i; the plan and conclusion keep out of their way
CONCLUSION_SEED_KEY = 1_000_001


class ThinkOptions(Options):
    """think's parameters: the job's and the recipe's (mdcli/recipes/think.py) alike."""

    paths: int = Field(4, ge=1)  # independent paths (with `plan`: how many if the outline cannot be parsed)
    plan: bool = False  # the model first writes a numbered outline; one path per item
    max_paths: int = Field(8, ge=1)  # most outline items used as paths
    merge: MergeMode | None = None  # None: reencode, or none when voting
    vote: bool = False  # majority over each path's extracted answer
    answer_pattern: str | None = None  # regex for a path's answer (None: extract_answer's default)
    path_instructions: list[str] = Field(default_factory=list)  # dealt out to the paths in turn
    plan_tokens: int | None = Field(None, ge=1)  # None: min(128, max_new_tokens)
    conclusion_tokens: int | None = Field(None, ge=1)  # None: max_new_tokens (-n)
    # the final answer's shape: the conclusion's, or every path's when there is none (merge none)
    constraint: Constraint | None = None


class Think(Job, ThinkOptions):
    """Everything a think run is asked to do, checked (`validate`) before any model is loaded."""

    question: str
    documents: list[Document] = Field(default_factory=list)  # what the question is about, read before it
    system: str | None = None
    chat_template: bool = True
    sampling: SamplingParams | None = None  # None: see default_sampling
    max_new_tokens: int = Field(256, ge=1)
    stop: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _defaults(self) -> Think:
        """What a field left None means. merge: reencode, or none when voting (a vote alone needs
        no conclusion). The limits: -n (`max_new_tokens`) bounds every phase unless the phase's
        own is given (the conclusion gets -n, the outline min(128, -n)). sampling: see
        `default_sampling`."""
        if self.merge is None:
            self.merge = "none" if self.vote else "reencode"
        if self.conclusion_tokens is None:
            self.conclusion_tokens = self.max_new_tokens
        if self.plan_tokens is None:
            self.plan_tokens = min(DEFAULT_PLAN_TOKENS, self.max_new_tokens)
        if self.sampling is None:
            self.sampling = default_sampling(self.identical_when_greedy())
        return self

    def identical_when_greedy(self) -> bool:
        """Several paths from one prompt (no plan, no path instructions): greedy copies of one path."""
        return self.paths > 1 and not self.plan and not self.path_instructions

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name == "merge":
            return FieldError(f"unknown merge mode '{value}'", fix="use {merge} reencode, attend or none")
        return super().problem(name, value, data, message)

    def validate(self) -> None:
        if not self.question.strip():
            raise UsageError("the question is empty", fix="give the question as text, a file, or - for stdin")
        if self.answer_pattern is not None:
            try:
                re.compile(self.answer_pattern)
            except re.error as error:
                raise FieldError(
                    f"{{answer_pattern}} is not a valid regular expression: {error}",
                    fix="check the pattern, e.g. 'Answer: (.+)'",
                ) from error
        self.path_constraint()  # a pattern the constraint engine cannot read fails here, before any model loads
        for number, instruction in enumerate(self.path_instructions, 1):
            if not instruction.strip():
                raise UsageError(f"path instruction {number} is empty", fix="remove it or write the instruction")

    def instruction_for(self, index: int) -> str | None:
        """Path `index`'s instruction: the instructions are dealt out in turn."""
        if not self.path_instructions:
            return None
        return self.path_instructions[index % len(self.path_instructions)]

    # prompts

    def asked(self) -> str:
        """The question as every prompt states it: after its documents (each under a `# path`
        line when there are several; documents.inputs.joined_text), when it has any."""
        if not self.documents:
            return self.question.strip()
        return f"{joined_text(self.documents).strip()}\n\n{self.question.strip()}"

    def question_turns(self) -> list[Turn]:
        """The conversation every path shares: the question, and with a plan the plan request."""
        if self.plan:
            return [("user", f"{self.asked()}\n\n{PLAN_INSTRUCTION}")]
        return []

    def plan_prompt_ids(self, tokenizer) -> list[int]:
        return self._ids(tokenizer, self.question_turns())

    def path_prompt_ids(self, tokenizer, index: int, plan_text: str | None = None, item: str | None = None) -> list[int]:
        instruction = self.instruction_for(index)
        if item is None:
            return self._ids(tokenizer, [("user", with_instruction(self.asked(), instruction))])
        work = fill_template(ITEM_TEMPLATE, "item", number=str(index + 1), item=item)
        turns = self.question_turns() + [("assistant", plan_text or ""), ("user", with_instruction(work, instruction))]
        return self._ids(tokenizer, turns)

    def conclusion_prompt_ids(self, tokenizer, path_texts: list[str], plan_text: str | None = None) -> list[int]:
        body = conclusion_user_text(path_texts, planned=plan_text is not None)
        if plan_text is None:
            return self._ids(tokenizer, [("user", f"{self.asked()}\n\n{body}")])
        return self._ids(tokenizer, self.question_turns() + [("assistant", plan_text), ("user", body)])

    def _ids(self, tokenizer, turns: list[Turn]) -> list[int]:
        return conversation_token_ids(tokenizer, turns, system=self.system, chat_template=self.chat_template)

    def path_constraint(self) -> Constraint | None:
        """What each path decodes under: `constraint` when the paths are the answers (merge none);
        else, when voting with an answer pattern, any text that ends in a match of the pattern, so
        every path that finishes has an answer to vote with."""
        if self.constraint is not None and self.merge == "none":
            return self.constraint
        if self.vote and self.answer_pattern is not None:
            return Constraint(regex=r"[\s\S]*(?:" + self.answer_pattern + ")")
        return None

    # branch specs

    def path_spec(self, tokenizer, index: int, plan_text: str | None = None, item: str | None = None) -> BranchSpec:
        detail = item if item is not None else self.instruction_for(index)
        return BranchSpec(
            label=short_label(f"path {index + 1}", detail),
            prompt_ids=self.path_prompt_ids(tokenizer, index, plan_text, item),
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            stop=self.stop,
            seed_key=index,
            constraint=compile_for(self.path_constraint(), tokenizer),
        )

    def plan_spec(self, tokenizer) -> BranchSpec:
        return BranchSpec(
            label="plan",
            prompt_ids=self.plan_prompt_ids(tokenizer),
            sampling=self.sampling,
            max_new_tokens=self.plan_tokens,
            seed_key=PLAN_SEED_KEY,
        )

    def conclusion_spec(self, tokenizer, path_texts: list[str], plan_text: str | None) -> BranchSpec:
        return BranchSpec(
            label="conclusion",
            prompt_ids=self.conclusion_prompt_ids(tokenizer, path_texts, plan_text),
            sampling=self.sampling,
            max_new_tokens=self.conclusion_tokens,
            stop=self.stop,
            seed_key=CONCLUSION_SEED_KEY,
            constraint=compile_for(self.constraint, tokenizer),
        )


def default_sampling(identical_when_greedy: bool) -> SamplingParams:
    """think's sampling when none is given: PATHS_TEMPERATURE with seed PATHS_SEED where greedy
    paths would all be the same, else greedy (exact: each path is model.generate's)."""
    if identical_when_greedy:
        return SamplingParams(temperature=PATHS_TEMPERATURE, seed=PATHS_SEED)
    return SamplingParams()
