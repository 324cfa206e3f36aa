"""think: parallel chains of thought on an unmodified model, as Map / Process / Reduce.

Map      Either K independent *paths* from the same question (diversity from per-path seeds,
         temperature, or per-path instructions), or a *plan*: the model first writes a short
         numbered outline of independent sub-tasks and each item becomes a path.
Process  Every path decodes together over the shared question (and plan) in ONE cache, each
         stopping on its own (EOS, a stop string, its token budget).
Reduce   `reencode` (default, exact): the paths' texts go into one conclusion prompt that starts
         with the question (and plan); it is tokenized whole and only its new tokens are fed,
         hanging off the cached prefix, so the conclusion is exactly what the model writes for
         that prompt alone.
         `attend` (approximate, opt-in): Multiverse-style. The conclusion prompt attends directly
         to every path's cached tokens at position max-depth + 1, with nothing re-encoded. An
         unmodified model was never trained to read several branches at once, so this is NOT what
         the model would write for any single prompt; its branch is announced with exact=False.
         `vote`: a final answer is extracted from each path (`extract_answer`) and the majority
         is reported in a Note, with no conclusion decode (unless a merge is also asked for).

The prompts, each rendered as a chat conversation (or plain text for models without a chat
template) and tokenized WHOLE:

    paths:      user: QUESTION [\\n\\n INSTRUCTION] \\n\\n REASONING_INSTRUCTION
    plan:       user: QUESTION \\n\\n PLAN_INSTRUCTION
    plan path:  user: (the plan prompt) / assistant: PLAN / user: ITEM_TEMPLATE [...] REASONING_INSTRUCTION
    conclusion: user: QUESTION \\n\\n CONCLUSION_TEMPLATE                       (paths)
                user: (the plan prompt) / assistant: PLAN / user: CONCLUSION_TEMPLATE (plan)

Path i gets seed key i, so with a fixed seed its tokens are the same whether 1, 4 or 8 paths run.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

from mdcli.decoding import BranchSpec, Decoder
from mdcli.detok import StreamingDetokenizer
from mdcli.errors import ContextTooLongError, UsageError
from mdcli.events import BranchInfo, Done, Event, Finish, Fork, Note, Token
from mdcli.prompts import fill_template
from mdcli.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    import torch

    from mdcli.loading import LoadedModel

MERGE_MODES = ("reencode", "attend", "none")

REASONING_INSTRUCTION = 'Think step by step, then finish with a line of the form "Answer: ...".'
PLAN_INSTRUCTION = (
    "Do not solve it yet. Write a numbered plan (1., 2., 3.) of the steps needed to solve it, one short "
    "line each."
)
"""Kept this plain on purpose: asking SmolLM2-135M for "at most N independent sub-tasks" made it
number its answer instead (--max-paths caps the items when the plan is parsed)."""
ITEM_TEMPLATE = "Work on item $number of the plan: $item\nDo only this item."
PATH_ENTRY_TEMPLATE = "Path $number: $text"
CONCLUSION_TEMPLATE = (
    "$intro\n\n$paths\n\nUsing them, give the final answer. Be brief, and finish with a line of the "
    'form "Answer: ...".'
)
CONCLUSION_INTRO_PATHS = "Here are $count independent attempts at it:"
CONCLUSION_INTRO_PLAN = "Here is the work on each item of the plan:"
ATTEND_INSTRUCTION = (
    "Several independent attempts at this question are above. Using them, give the final answer. "
    'Be brief, and finish with a line of the form "Answer: ...".'
)
EMPTY_PATH_TEXT = "(no output)"

PLAN_SEED_KEY = 1_000_000  # path i uses seed key i; the plan and conclusion keep out of their way
CONCLUSION_SEED_KEY = 1_000_001
LABEL_WIDTH = 48

# -- plan parsing -----------------------------------------------------------------------------

_STEP_ITEM = re.compile(r"^[\W_]*(?:step|task|item|part|sub-?task)\s*(\d{1,2})\b\s*[.):\-–—]*\s*(.*)$", re.IGNORECASE)
_NUMBERED_ITEM = re.compile(r"^[\s*#>(\[_]*(\d{1,2})\s*(?:[.)\]:](?!\d)|\s[-–—]\s)\s*(.*)$")
_BULLET_ITEM = re.compile(r"^\s*[-*•+]\s+(.+)$")
_INLINE_NUMBER = re.compile(r"(?:^|\s)(\d{1,2})[.)]\s+")
_DECORATION = " \t*_`#:"


def parse_plan(text: str, max_items: int) -> list[str] | None:
    """The sub-tasks of a model-written outline, or None when it holds no list at all.

    Accepts "1.", "1)", "(1)", "1:", "**1.**", "Step 1:", "Task 2 -" items (an item whose text is
    on the next line takes that line), else "- " / "* " / "• " bullets, else an inline "1. ... 2.
    ..." list. A small model's outline is often untidy, hence the tolerance; anything that is not
    an item (a preamble, sub-bullets under numbered items) is ignored. A second list starting again
    at 1 ends the first (the model went on to solve it). Returns at most `max_items` non-empty items.
    """
    if max_items < 1:
        raise ValueError("max_items must be at least 1")
    lines = text.splitlines()
    items = _numbered_items(lines) or _bullet_items(lines) or _inline_items(text)
    items = [item for item in items if _has_words(item)][:max_items]
    return items or None


def _numbered_items(lines: list[str]) -> list[str]:
    items: list[str] = []
    last_number = 0
    waiting_for_text = False  # "Step 1:" alone on its line: its text is the next line
    for line in lines:
        match = _STEP_ITEM.match(line) or _NUMBERED_ITEM.match(line)
        if match is None:
            if waiting_for_text and _clean(line):
                items[-1] = _clean(line)
                waiting_for_text = False
            continue
        number = int(match.group(1))
        if number == 1 and last_number > 1:
            break
        last_number = number
        items.append(_clean(match.group(2)))
        waiting_for_text = not items[-1]
    return items


def _bullet_items(lines: list[str]) -> list[str]:
    return [_clean(m.group(1)) for line in lines if (m := _BULLET_ITEM.match(line))]


def _inline_items(text: str) -> list[str]:
    """"1. foo 2. bar 3. baz" on one line: split at the numbers, which must count up from 1."""
    marks = list(_INLINE_NUMBER.finditer(text))
    numbers = [int(m.group(1)) for m in marks]
    if len(marks) < 2 or numbers != list(range(1, len(marks) + 1)):
        return []
    ends = [m.start() for m in marks[1:]] + [len(text)]
    return [_clean(text[m.end() : end]) for m, end in zip(marks, ends)]


def _has_words(item: str) -> bool:
    """A sub-task says something: "1. 2. 3." (a model numbering nothing) is not an item."""
    return any(ch.isalpha() for ch in item)


def _clean(item: str) -> str:
    return " ".join(item.split()).strip(_DECORATION)


# -- answer extraction ------------------------------------------------------------------------

ANSWER_MARKER_PATTERN = r"(?i)\b(?:final\s+)?answer(?:\s+is\b|\s*:)\s*:?\s*(?P<answer>[^\n]+)"
"""Text after the last "Answer:" / "answer is" (the rest of that line, cut at a sentence end)."""
LAST_NUMBER_PATTERN = r"-?\d[\d,]*(?:\.\d+)?"
"""Failing that, the last number in the text."""

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_ANSWER_DECORATION = " \t*_`$\"'.,;:!"


def extract_answer(text: str, pattern: str | None = None) -> str | None:
    """A path's final answer, for voting; None when there is none.

    Default rule: the text after the last "Answer:" / "answer is" (ANSWER_MARKER_PATTERN, up to the
    end of its sentence), else the last number (LAST_NUMBER_PATTERN). A custom `pattern` replaces
    both: its last match counts, and the answer is its group named `answer`, else its first group,
    else the whole match.
    """
    if pattern is not None:
        return _last_match_answer(text, pattern)
    marked = _last_match_answer(text, ANSWER_MARKER_PATTERN)
    if marked is not None:
        return _first_sentence(marked)
    return _last_match_answer(text, LAST_NUMBER_PATTERN)


def _last_match_answer(text: str, pattern: str) -> str | None:
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    match = matches[-1]
    if "answer" in match.re.groupindex:
        found = match.group("answer")
    elif match.re.groups:
        found = match.group(1)
    else:
        found = match.group(0)
    answer = (found or "").strip(_ANSWER_DECORATION)
    return answer or None


def _first_sentence(answer: str) -> str | None:
    end = _SENTENCE_END.search(answer)
    cut = answer if end is None else answer[: end.start()]
    return cut.strip(_ANSWER_DECORATION) or None


def normalize_answer(answer: str) -> str:
    """The form answers are grouped by in a vote: "$1,000.0" and "1000" are the same answer."""
    flat = re.sub(r"(?<=\d),(?=\d)", "", answer.lower())
    flat = "".join(ch for ch in flat if ch not in " \t\n*_`$").strip(".")
    try:
        number = Decimal(flat)
    except InvalidOperation:
        return flat
    if not number.is_finite() or abs(number.adjusted()) > 60:
        return flat
    return format(number.normalize(), "f")


@dataclass(frozen=True)
class Vote:
    answers: dict[str, str | None]  # path label -> extracted answer
    winner: str | None
    votes: int

    def note(self) -> Note:
        data = {"answers": dict(self.answers), "winner": self.winner, "votes": self.votes}
        return Note(kind="vote", message=self.table(), data=data)

    def table(self) -> str:
        """What the user sees: the winner, then one line per path."""
        paths = len(self.answers)
        if self.winner is None:
            head = f"no path gave an extractable answer ({paths} paths; see --answer-pattern)"
        else:
            head = f"majority answer: {self.winner} ({self.votes} of {paths} paths)"
        width = max(len(label) for label in self.answers) if self.answers else 0
        rows = [f"  {label:<{width}}  {answer if answer is not None else '-'}" for label, answer in self.answers.items()]
        return "\n".join([head, *rows])


def majority_vote(answers: dict[str, str | None]) -> Vote:
    """The most common answer (after normalize_answer); a tie goes to the one given first."""
    groups: dict[str, list[str]] = {}
    for answer in answers.values():
        if answer is not None:
            groups.setdefault(normalize_answer(answer), []).append(answer)
    if not groups:
        return Vote(answers, None, 0)
    best = max(groups.values(), key=len)  # max keeps the first of equals: insertion = path order
    return Vote(answers, best[0], len(best))


# -- prompts ------------------------------------------------------------------------------------

Turn = tuple[str, str]  # (role, text)
_MARK = "\u2063mdcli-turn-mark\u2063"


def conversation_token_ids(
    tokenizer, turns: list[Turn], *, system: str | None = None, chat_template: bool = True
) -> list[int]:
    """A whole conversation, rendered and tokenized WHOLE, ending where the assistant speaks next.

    With a single user turn this is exactly `prompts.prompt_token_ids`. Without a chat template
    the turns are joined by blank lines.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": role, "content": text} for role, text in turns
        ]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    rendered = "\n\n".join(([system] if system else []) + [text for _, text in turns])
    return list(tokenizer(rendered, add_special_tokens=True)["input_ids"])


def after_answer_token_ids(tokenizer, user_text: str, *, chat_template: bool = True) -> list[int]:
    """What follows an assistant's answer when the user speaks again: the end of the assistant's
    turn, a user turn, the assistant header. The attend merge hangs these tokens off all paths at
    once (each path's own end-of-turn token is never cached: a branch's last token is not fed)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "assistant", "content": _MARK}, {"role": "user", "content": user_text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tail = rendered[rendered.index(_MARK) + len(_MARK) :]
        return list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    return list(tokenizer(f"\n\n{user_text}\n\n", add_special_tokens=False)["input_ids"])


def with_instruction(text: str, instruction: str | None) -> str:
    """A path's user turn: its own text, its instruction (if any), then the reasoning request.
    The instruction comes after the shared text so that paths share as many tokens as possible."""
    parts = [text] + ([instruction.strip()] if instruction and instruction.strip() else [])
    return "\n\n".join(parts + [REASONING_INSTRUCTION])


def conclusion_user_text(path_texts: list[str], *, planned: bool) -> str:
    """The conclusion's user turn (after the question, or after the plan): every path's text."""
    entries = [
        fill_template(PATH_ENTRY_TEMPLATE, "path entry", number=str(i), text=text.strip() or EMPTY_PATH_TEXT)
        for i, text in enumerate(path_texts, 1)
    ]
    intro = CONCLUSION_INTRO_PLAN if planned else fill_template(
        CONCLUSION_INTRO_PATHS, "conclusion intro", count=str(len(path_texts))
    )
    return fill_template(CONCLUSION_TEMPLATE, "conclusion", intro=intro, paths="\n\n".join(entries))


def short_label(prefix: str, detail: str | None) -> str:
    if not detail:
        return prefix
    flat = " ".join(detail.split())
    if len(flat) > LABEL_WIDTH:
        flat = flat[: LABEL_WIDTH - 1].rstrip() + "…"
    return f"{prefix} · {flat}"


# -- the job ------------------------------------------------------------------------------------


@dataclass
class Think:
    """Everything `mdcli think` was asked to do, checked before any model is loaded."""

    question: str
    paths: int = 4
    plan: bool = False
    max_paths: int = 8
    merge: str = "reencode"
    vote: bool = False
    answer_pattern: str | None = None
    path_instructions: tuple[str, ...] = ()
    system: str | None = None
    chat_template: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    plan_tokens: int = 128
    conclusion_tokens: int = 256
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.question.strip():
            raise UsageError("the question is empty", fix="give the question as text, a file, or - for stdin")
        for name, value in [
            ("--paths", self.paths),
            ("--max-paths", self.max_paths),
            ("--max-new-tokens", self.max_new_tokens),
            ("--plan-tokens", self.plan_tokens),
            ("--conclusion-tokens", self.conclusion_tokens),
        ]:
            if value < 1:
                raise UsageError(f"{name} must be at least 1 (got {value})", fix="use a positive number")
        if self.merge not in MERGE_MODES:
            raise UsageError(f"unknown merge mode '{self.merge}'", fix="use --merge reencode, attend or none")
        if self.answer_pattern is not None:
            try:
                re.compile(self.answer_pattern)
            except re.error as error:
                raise UsageError(
                    f"--answer-pattern is not a valid regular expression: {error}",
                    fix="check the pattern, e.g. 'Answer: (.+)'",
                ) from error
        for number, instruction in enumerate(self.path_instructions, 1):
            if not instruction.strip():
                raise UsageError(f"path instruction {number} is empty", fix="remove it or write the instruction")

    def instruction_for(self, index: int) -> str | None:
        """Path `index`'s instruction: the instructions are dealt out in turn."""
        if not self.path_instructions:
            return None
        return self.path_instructions[index % len(self.path_instructions)]

    # prompts

    def question_turns(self) -> list[Turn]:
        """The conversation every path shares: the question, and with a plan the plan request."""
        if self.plan:
            return [("user", f"{self.question.strip()}\n\n{PLAN_INSTRUCTION}")]
        return []

    def plan_prompt_ids(self, tokenizer) -> list[int]:
        return self._ids(tokenizer, self.question_turns())

    def path_prompt_ids(self, tokenizer, index: int, plan_text: str | None = None, item: str | None = None) -> list[int]:
        instruction = self.instruction_for(index)
        if item is None:
            return self._ids(tokenizer, [("user", with_instruction(self.question.strip(), instruction))])
        work = fill_template(ITEM_TEMPLATE, "item", number=str(index + 1), item=item)
        turns = self.question_turns() + [("assistant", plan_text or ""), ("user", with_instruction(work, instruction))]
        return self._ids(tokenizer, turns)

    def conclusion_prompt_ids(self, tokenizer, path_texts: list[str], plan_text: str | None = None) -> list[int]:
        body = conclusion_user_text(path_texts, planned=plan_text is not None)
        if plan_text is None:
            return self._ids(tokenizer, [("user", f"{self.question.strip()}\n\n{body}")])
        return self._ids(tokenizer, self.question_turns() + [("assistant", plan_text), ("user", body)])

    def _ids(self, tokenizer, turns: list[Turn]) -> list[int]:
        return conversation_token_ids(tokenizer, turns, system=self.system, chat_template=self.chat_template)

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
        )


# -- the run ------------------------------------------------------------------------------------


@dataclass
class _Path:
    info: BranchInfo
    finish: Finish | None = None

    @property
    def text(self) -> str:
        return self.finish.text if self.finish is not None else ""


@dataclass
class _ExtraCounts:
    """Work done outside the Decoder (the attend merge), added to its stats at the end."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0


class ThinkRun:
    """One `think` run over one engine: plan (optional), paths, then vote and/or merge.

    A single Decoder serves every phase, so the question, the plan and the paths stay in one
    cache and each later phase reuses what is already there.
    """

    def __init__(
        self,
        model: LoadedModel,
        job: Think,
        *,
        max_forward_tokens: int = 1024,
        compact_ratio: float = 0.25,
        speculate: str = "off",
    ):
        from mdcli.engine import Engine

        self.model = model
        self.job = job
        self.tokenizer = model.tokenizer
        self.engine = Engine(
            model.model,
            sliding_window=model.sliding_window,
            mixed_layer_types=model.mixed_layer_types,
            max_forward_tokens=max_forward_tokens,
        )
        # the attend merge reads every path's cached tokens: none may be compacted away meanwhile
        ratio = math.inf if job.merge == "attend" else compact_ratio
        self.decoder = Decoder(
            self.engine, model.tokenizer, model.eos_token_ids, context_length=model.context_length, compact_ratio=ratio,
            speculate=speculate,
        )
        self.extra = _ExtraCounts()
        self.last_id = -1

    def events(self) -> Iterator[Event]:
        started = time.perf_counter()
        self._check_question_fits()
        plan_text, paths = yield from self._map()
        yield from self._decode_paths(paths)
        if self.job.vote:
            yield self._vote(paths)
        if self.job.merge == "reencode":
            yield from self._merge_by_reencoding(paths, plan_text)
        elif self.job.merge == "attend":
            yield from self._merge_by_attending(paths)
        yield Done(stats=self._stats(time.perf_counter() - started))

    # -- map -----------------------------------------------------------------------------------

    def _check_question_fits(self) -> None:
        """A question too long for the context fails here, before anything is shown."""
        limit = self.model.context_length
        first = self.job.plan_prompt_ids(self.tokenizer) if self.job.plan else self.job.path_prompt_ids(self.tokenizer, 0)
        if limit is not None and len(first) >= limit:
            raise ContextTooLongError(
                f"the question's prompt is {len(first)} tokens, {len(first) - limit + 1} more than the "
                f"model's context of {limit} allows",
                fix="shorten the question, or use a model with a longer context",
            )

    def _map(self) -> Iterator[Event]:
        """Announce the paths: straight from the question, or one per item of a plan."""
        if not self.job.plan:
            infos = yield from self._announce_plain_paths(start=True)
            return None, [_Path(info) for info in infos]
        plan = yield from self._write_plan()
        items = parse_plan(plan.text, self.job.max_paths)
        if items is None:
            yield Note(
                kind="plan-fallback",
                message=f"could not find a numbered outline in the plan; running {self.job.paths} plain paths instead",
                data={"plan": plan.text, "paths": self.job.paths},
            )
            infos = yield from self._announce_plain_paths(start=False)
            return None, [_Path(info) for info in infos]
        yield Note(kind="plan", message=f"{_plural(len(items), 'sub-task')}, one path each", data={"items": items})
        specs = [self.job.path_spec(self.tokenizer, i, plan.text, item) for i, item in enumerate(items)]
        infos = self._announce(specs)
        for info in infos:  # each path reads the plan: show it under the plan
            yield Fork(branch=replace(info, parent=plan.branch))
        return plan.text, [_Path(info) for info in infos]

    def _announce_plain_paths(self, *, start: bool) -> Iterator[Event]:
        """K paths from the question alone: in the Start event, or as Forks after a failed plan."""
        specs = [self.job.path_spec(self.tokenizer, i) for i in range(self.job.paths)]
        infos = self._announce(specs)
        if start:
            yield self._start(infos)
        else:
            for info in infos:
                yield Fork(branch=info)
        distinct = len({tuple(spec.prompt_ids) for spec in specs})
        if self.job.sampling.greedy and distinct < len(specs):
            yield Note(
                kind="identical-paths",
                message=f"greedy decoding: the {len(specs)} paths have only {distinct} distinct prompts, so "
                "paths with the same prompt will be identical; use --temperature (with --seed) or "
                "--path-instruction for diverse paths",
                data={"paths": len(specs), "distinct_prompts": distinct},
            )
        return infos

    def _write_plan(self) -> Iterator[Event]:
        [info] = self._announce([self.job.plan_spec(self.tokenizer)])
        yield self._start([info])
        plan = None
        for event in self.decoder.decode("plan"):
            yield event
            if isinstance(event, Finish):
                plan = event
        return plan

    def _start(self, infos: list[BranchInfo]):
        from mdcli.api import start_event

        return start_event(self.model, "think", self.job.sampling.seed, infos)

    def _announce(self, specs: list[BranchSpec]) -> list[BranchInfo]:
        infos = self.decoder.announce(specs)
        self.last_id = max([self.last_id] + [info.id for info in infos])
        return infos

    # -- process -------------------------------------------------------------------------------

    def _decode_paths(self, paths: list[_Path]) -> Iterator[Event]:
        by_id = {path.info.id: path for path in paths}
        for event in self.decoder.decode("paths"):
            yield event
            if isinstance(event, Finish) and event.branch in by_id:
                by_id[event.branch].finish = event

    # -- reduce --------------------------------------------------------------------------------

    def _vote(self, paths: list[_Path]) -> Note:
        answers = {
            f"path {i}": extract_answer(path.text, self.job.answer_pattern) for i, path in enumerate(paths, 1)
        }
        return majority_vote(answers).note()

    def _merge_by_reencoding(self, paths: list[_Path], plan_text: str | None) -> Iterator[Event]:
        """Exact: one conclusion prompt, tokenized whole; only the tokens after the cached
        question (and plan) are fed, in one prefill, and the engine's count proves it."""
        spec = self.job.conclusion_spec(self.tokenizer, [p.text for p in paths], plan_text)
        reused, _ = self.engine.forest.longest_cached_prefix(spec.prompt_ids, limit=len(spec.prompt_ids) - 1)
        try:
            [info] = self._announce([spec])
        except ContextTooLongError as error:
            yield _skipped_merge_note("reencode", error.problem)
            return
        fed_before = self.decoder.stats(0).prefill_tokens
        yield Fork(branch=info)
        yield from self.decoder.decode("conclusion")
        fed = self.decoder.stats(0).prefill_tokens - fed_before
        message = (
            f"reencode: the conclusion prompt is {len(spec.prompt_ids)} tokens; {reused} were already cached "
            f"(question{' and plan' if plan_text is not None else ''}), {fed} new ones were fed"
        )
        if fed != len(spec.prompt_ids) - reused:  # the engine's own count disagrees with the plan
            message += f" (expected {len(spec.prompt_ids) - reused})"
        yield Note(
            kind="merge",
            message=message,
            data={"mode": "reencode", "prompt_tokens": len(spec.prompt_ids), "reused_tokens": reused, "fed_tokens": fed},
        )

    def _merge_by_attending(self, paths: list[_Path]) -> Iterator[Event]:
        """Approximate, Multiverse-style: the conclusion attends to the union of every path's
        cached tokens (and the question) at position max-depth + 1; nothing is re-encoded."""
        import torch

        started = time.perf_counter()
        fed_before = self.extra.prefill_tokens
        rows = self._closed_path_rows(paths)  # [P, N]
        union = rows.any(0)  # [N]
        depth = int(rows.sum(-1).max())  # the deepest path's next position
        chain = after_answer_token_ids(self.tokenizer, ATTEND_INSTRUCTION, chat_template=self.job.chat_template)
        budget = self._attend_budget(depth + len(chain))
        if budget < 1:
            yield _skipped_merge_note("attend", f"the paths already fill the model's context of {self.model.context_length}")
            return
        self.last_id += 1
        info = BranchInfo(
            id=self.last_id,
            label="conclusion (approximate)",
            prompt_token_ids=self.engine.forest.path_token_ids(union) + chain,  # in cache order, not a sequence
            exact=False,
        )
        yield Fork(branch=info)
        yield Note(
            kind="approximate",
            message=f"--merge attend: the conclusion reads all {len(paths)} paths at once from position {depth} "
            "without re-encoding them; the model was not trained for this, so it is not what the model would "
            "write for any single prompt (use --merge reencode for the exact conclusion)",
            data={"mode": "attend", "start_depth": depth, "fed_tokens": self.extra.prefill_tokens - fed_before + len(chain)},
        )
        first = self.engine.forward(union[None], [chain], start_depths=torch.tensor([depth]))[0]
        self.extra.prefill_tokens += len(chain)
        yield from self._decode_from(info, first, depth + len(chain), budget)
        self.extra.seconds += time.perf_counter() - started

    def _closed_path_rows(self, paths: list[_Path]) -> torch.Tensor:
        """[P, N] bool: each path's cached tokens, its final token included.

        A branch's last token is never fed (nothing needed its logits). Paths that ended on EOS
        leave it out (the merge chain supplies the end of turn); the others get it fed now, in one
        forward, so the conclusion sees every word of every path.
        """
        from mdcli.forest import stack_rows

        rows, tails = [], []
        for path in paths:
            tokens = path.finish.token_ids if path.finish is not None else []
            fed = path.info.prompt_token_ids + tokens[:-1]
            rows.append(self._cached_row(fed))
            if tokens and tokens[-1] not in self.model.eos_token_ids:
                tails.append((len(rows) - 1, tokens[-1]))
        if tails:
            stacked = stack_rows([rows[i] for i, _ in tails], len(self.engine))
            outs = self.engine.forward(stacked, [[token] for _, token in tails], logits=False)
            for (i, _), out in zip(tails, outs):
                rows[i] = out.row
            self.extra.prefill_tokens += len(tails)
        return stack_rows(rows, len(self.engine))  # [P, N]

    def _cached_row(self, sequence: list[int]) -> torch.Tensor:
        """The ancestor row of a cached node whose path is `sequence` (any such node will do: its
        keys and values depend only on its path).

        Walked level by level over every cached node, not through the forest's (parent, token)
        index: paths that sampled the same first tokens hold duplicate nodes, the index keeps only
        the first of them, and a path's later tokens may hang under another duplicate.
        """
        import torch

        forest = self.engine.forest
        frontier = torch.tensor([-1], device=forest.device)  # [F] slots whose path is the prefix so far
        for depth, token in enumerate(sequence):
            hits = (forest.tokens == token) & (forest.depth == depth) & torch.isin(forest.parent, frontier)  # [N]
            frontier = hits.nonzero().flatten()
            if frontier.numel() == 0:
                raise RuntimeError(f"a path's tokens are no longer cached ({depth} of {len(sequence)} found)")
        return forest.row_of(int(frontier[0]))

    def _attend_budget(self, first_free_position: int) -> int:
        limit = self.model.context_length
        if limit is None:
            return self.job.conclusion_tokens
        return min(self.job.conclusion_tokens, limit - first_free_position)

    def _decode_from(self, info: BranchInfo, result, depth: int, budget: int) -> Iterator[Event]:
        """One branch decoded by hand, its depth tracked explicitly: after an approximate merge a
        token's position is no longer the number of tokens it attends to, so the engine's default
        (position = popcount of the row) would be wrong."""
        import torch

        sampler = Sampler(self.job.sampling, CONCLUSION_SEED_KEY, self.engine.device)
        detok = StreamingDetokenizer(self.tokenizer, self.job.stop)
        total = 0.0
        while True:
            token = sampler(result.logits)
            logprob = float(torch.log_softmax(result.logits, -1)[token])
            total += logprob
            text = detok.add(token)
            self.extra.generated_tokens += 1
            reason = self._finish_reason(token, detok, budget)
            if reason is not None:
                yield Token(branch=info.id, token_id=token, text=text + detok.finish(), logprob=logprob)
                yield Finish(
                    branch=info.id,
                    label=info.label,
                    text=detok.final_text,
                    token_ids=list(detok.token_ids),
                    finish_reason=reason,
                    cumulative_logprob=total,
                )
                return
            yield Token(branch=info.id, token_id=token, text=text, logprob=logprob)
            result = self.engine.forward(result.row[None], [[token]], start_depths=torch.tensor([depth]))[0]
            self.extra.steps += 1
            depth += 1

    def _finish_reason(self, token: int, detok: StreamingDetokenizer, budget: int) -> str | None:
        if token in self.model.eos_token_ids or detok.stopped_at is not None:
            return "stop"
        if len(detok.token_ids) >= budget:
            return "length"
        return None

    def _stats(self, seconds: float):
        base = self.decoder.stats(seconds)
        return replace(
            base,
            prefill_tokens=base.prefill_tokens + self.extra.prefill_tokens,
            generated_tokens=base.generated_tokens + self.extra.generated_tokens,
            steps=base.steps + self.extra.steps,
            decode_seconds=round(base.decode_seconds + self.extra.seconds, 4),
            peak_cache_tokens=max(base.peak_cache_tokens, self.engine.peak_tokens),
            final_cache_tokens=len(self.engine),
        )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _skipped_merge_note(mode: str, why: str) -> Note:
    return Note(kind="merge-skipped", message=f"no conclusion ({mode}): {why}", data={"mode": mode, "reason": why})


def run_think(model: LoadedModel, job: Think, **engine_options) -> Iterator[Event]:
    """The events of a think run (validate `job` first to fail before any output)."""
    return ThinkRun(model, job, **engine_options).events()
