"""think's texts: its prompts, reading a model-written plan, extracting and voting on answers.

Pure text and token-id work, no model: the prompt templates and how a conversation is tokenized
whole (`conversation_token_ids`), `parse_plan` (the items of an untidy outline), `extract_answer`
/ `normalize_answer` / `majority_vote` (the vote). The run itself is in run.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from mdcli.events import Note
from mdcli.strategies.prompts import fill_template

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

_LEADING_MARKER = re.compile(r"(?i)^(?:[\s*_`\"']*(?:final\s+)?answer(?:\s+is\b|\s*:)\s*:?)+\s*")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_ANSWER_DECORATION = " \t*_`$\"'.,;:!"


def extract_answer(text: str, pattern: str | None = None, question: str | None = None) -> str | None:
    """A path's final answer, for voting; None when there is none. `text` is what the path
    generated; `question`, if given, is what it was asked: an answer the question itself yields
    ("End with Answer: N" gives "N") is a format the path echoes, never the path's answer.

    Default rule: the text after the last "Answer:" / "answer is" (ANSWER_MARKER_PATTERN, up to the
    end of its sentence), else the last number (LAST_NUMBER_PATTERN). A custom `pattern` replaces
    both: its last match counts, and the answer is its group named `answer`, else its first group,
    else the whole match.
    """
    if pattern is not None:
        return _last_answer(text, pattern, _answers_in(question, pattern))
    marked = _last_answer(text, ANSWER_MARKER_PATTERN, _answers_in(question, ANSWER_MARKER_PATTERN))
    if marked is not None:
        return marked
    return _last_answer(text, LAST_NUMBER_PATTERN, set())


def _answers_in(question: str | None, pattern: str) -> set[str]:
    """What `pattern` extracts from the question itself (normalized): placeholders, not answers."""
    if not question:
        return set()
    found = (_match_answer(match, pattern == ANSWER_MARKER_PATTERN) for match in re.finditer(pattern, question))
    return {normalize_answer(answer) for answer in found if answer is not None}


def _last_answer(text: str, pattern: str, excluded: set[str]) -> str | None:
    """The answer of the last match of `pattern` in `text` that is not one of `excluded`."""
    for match in reversed(list(re.finditer(pattern, text))):
        answer = _match_answer(match, pattern == ANSWER_MARKER_PATTERN)
        if answer is not None and normalize_answer(answer) not in excluded:
            return answer
    return None


def _match_answer(match: re.Match, first_sentence: bool) -> str | None:
    if "answer" in match.re.groupindex:
        found = match.group("answer")
    elif match.re.groups:
        found = match.group(1)
    else:
        found = match.group(0)
    found = found or ""
    if first_sentence:
        found = _LEADING_MARKER.sub("", found)  # "The answer is: Answer: 50" -> "50"
        # the sentence is cut before the decoration goes: in 'end with "Answer:". Here is...' the
        # marker is mentioned, not used, and the next sentence is no answer
        end = _SENTENCE_END.search(found)
        found = found if end is None else found[: end.start()]
    return found.strip(_ANSWER_DECORATION) or None


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
    winner: str | None  # the most common answer (the first given among equals); None: no answers
    votes: int

    @property
    def majority(self) -> bool:
        """More than half of the paths gave the winner: 2 of 3 is a majority, 1 of 3 is not."""
        return self.winner is not None and 2 * self.votes > len(self.answers)

    def note(self) -> Note:
        data = {"answers": dict(self.answers), "winner": self.winner, "votes": self.votes,
                "paths": len(self.answers), "majority": self.majority}
        return Note(kind="vote", message=self.table(), data=data)

    def headline(self) -> str:
        """The result in one line: the answer and how many paths gave it, honestly named."""
        paths = len(self.answers)
        if self.winner is None:
            return f"no answer: no path gave an extractable answer ({paths} paths; see --answer-pattern)"
        count = f"{self.votes} of {paths} path" + ("" if paths == 1 else "s")
        if self.majority:
            return f"{self.winner} ({count}: majority)"
        if self.votes > 1:
            return f"{self.winner} ({count}: the most common answer, no majority)"
        return f"no majority: no two paths agree; first answer {self.winner} ({count})"

    def table(self) -> str:
        """What the user sees: the result, then one line per path."""
        width = max(len(label) for label in self.answers) if self.answers else 0
        rows = [f"  {label:<{width}}  {answer if answer is not None else '-'}" for label, answer in self.answers.items()]
        return "\n".join([self.headline(), *rows])


def majority_vote(answers: dict[str, str | None]) -> Vote:
    """The most common answer (after normalize_answer); a tie goes to the one given first.
    Whether it is a majority (more than half of the paths) is `Vote.majority`."""
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
