"""A picture of one speculative step (`mdcli explain --speculate N`): what each branch guessed,
the mask rows that let every guess be checked in the same forward, and what was accepted.

Unlike the forest picture (mdcli/explain/forest.py), this one needs the model: a guess exists only after
the branch has chosen its next token. So the recipe runs, with N draft tokens per branch, until
the first step in which a guess is accepted (or, if none ever is, the first step that verified
any), and that step is drawn from what the engine itself did: the tokens each branch fed, their
positions, and the rows of the attention mask the engine built for them (`VerifiedStep`, mdcli/speculative/planner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mdcli.events import Event
from mdcli.explain.forest import EMPTY, FILLED, TOKEN_GRID_LIMIT, stacked_header, token_label
from mdcli.speculative.planner import Speculate, VerifiedBranch, VerifiedStep

TokenText = Callable[[int], str]

NEXT, ACCEPTED, REJECTED = "→", "✓", "✗"


class _Seen(Exception):
    """Stops the run once the step to draw has been seen."""


def first_verified_step(run: Callable[[Speculate], Iterator[Event]], most: int) -> VerifiedStep | None:
    """Run `run(setting)` with `most` draft tokens per branch until a step accepts a guess.

    Returns that step, else (the run ended first) the first step that verified any guess, else
    None (no branch ever had a guess)."""
    seen: list[VerifiedStep] = []

    def watch(step: VerifiedStep) -> None:
        if not seen:
            seen.append(step)
        if any(branch.accepted for branch in step.branches):
            seen[0] = step
            raise _Seen

    events = run(Speculate("fixed", most, watch=watch))
    try:
        for _ in events:
            pass
    except _Seen:
        pass
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    return seen[0] if seen else None


def describe_step(step: VerifiedStep, token_text: TokenText, *, title: str) -> list[str]:
    """The step in words (per branch: its next token, its guesses, what was accepted), then its
    mask rows."""
    fed = sum(len(branch.tokens) for branch in step.branches)
    count = len(step.branches)
    lines = [
        f"{title}: decode step {step.step}, {count} branch{'es' if count != 1 else ''} fed {fed} tokens "
        f"in one forward over {step.cache_slots} cached slots",
        "",
    ]
    for branch, first in _with_offsets(step):
        lines += _branch_summary(branch, first, token_text)
    lines.append("")
    return lines + mask_rows(step, token_text)


def _with_offsets(step: VerifiedStep) -> list[tuple[VerifiedBranch, int]]:
    """Each branch with the index of its first fed token among the step's fed tokens."""
    placed, offset = [], 0
    for branch in step.branches:
        placed.append((branch, offset))
        offset += len(branch.tokens)
    return placed


def _branch_summary(branch: VerifiedBranch, first: int, token_text: TokenText) -> list[str]:
    text = _quoted(token_text, branch.tokens[: branch.drafts_from])
    head = f"{branch.label}: next token {text} at position {branch.depths[branch.drafts_from - 1]}"
    guesses = _guesses(branch, first)
    if not guesses:
        return [f"{head}; no guesses"]
    shown = " · ".join(_quoted(token_text, [branch.tokens[i] for i in path]) for path in guesses)
    drafts = len(branch.tokens) - branch.drafts_from
    taken = _quoted(token_text, [branch.tokens[i] for i in branch.accepted]) if branch.accepted else "none"
    after = (
        f", then the model's own {_quoted(token_text, [branch.next_token])}"
        if branch.next_token is not None else ", and the branch finished"
    )
    return [
        f"{head}; guessed {shown}",
        f"    accepted {taken} ({len(branch.accepted)} of {drafts} guessed tokens){after}",
    ]


def _guesses(branch: VerifiedBranch, first: int) -> list[list[int]]:
    """Each root-to-leaf path of the branch's draft tree, as indices into its fed tokens (a draft
    node attends to exactly its ancestors and itself among the fed tokens)."""
    drafts = range(branch.drafts_from, len(branch.tokens))
    path = {i: [s - first for s in branch.sees[i] if s - first >= branch.drafts_from] for i in drafts}
    inner = {a for i in drafts for a in path[i] if a != i}
    return [path[i] for i in drafts if i not in inner]


def _clip(label: str, width: int = 16) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _quoted(token_text: TokenText, tokens: list[int]) -> str:
    return repr("".join(token_text(t) for t in tokens))


def mask_rows(step: VerifiedStep, token_text: TokenText) -> list[str]:
    """A row per fed token, a column per fed token: ■ where the engine let it attend. Each row
    also reads its branch's path (the cached slots before the step), counted in `reads`."""
    drawn, left_out = _drawn_branches(step)
    column_of = {}  # the step index of a fed token -> its column
    for branch, first in drawn:
        for i in range(len(branch.tokens)):
            column_of[first + i] = len(column_of)
    nodes = [(branch, i) for branch, _ in drawn for i in range(len(branch.tokens))]
    labels = [token_label(token_text(branch.tokens[i])) for branch, i in nodes]
    label_width = max([len("token")] + [len(label) for label in labels])
    names = {id(branch): _clip(branch.label) for branch, _ in drawn}
    name_width = max([len("branch")] + [len(name) for name in names.values()])
    lead = f"{'pos':>4}  {'token':<{label_width}}    {'branch':<{name_width}}  {'reads':>5}  "
    lines = [
        "Attention mask of the step's tokens: row = query, column = key; "
        f"{FILLED} = attends, {EMPTY} = masked; {NEXT} next token, {ACCEPTED} guess accepted, {REJECTED} rejected.",
        "Every row also attends to the cached slots of its own branch's path ('reads' of them), "
        "and to nothing of any other branch.",
    ]
    lines += stacked_header("key pos", [branch.depths[i] for branch, i in nodes], len(lead))
    lines.append(lead.rstrip())
    for (branch, i), label in zip(nodes, labels):
        visible = {column_of[s] for s in branch.sees[i] if s in column_of}
        cells = " ".join(FILLED if column in visible else EMPTY for column in range(len(nodes)))
        mark = NEXT if i < branch.drafts_from else ACCEPTED if i in branch.accepted else REJECTED
        lines.append(
            f"{branch.depths[i]:>4}  {label:<{label_width}} {mark}  {names[id(branch)]:<{name_width}}  "
            f"{branch.path_slots:>5}  {cells}"
        )
    if left_out:
        lines.append(
            f"({left_out} more branch{'es' if left_out != 1 else ''} not drawn: the grid shows at most "
            f"{TOKEN_GRID_LIMIT} tokens, branches with guesses first)"
        )
    return lines


def _drawn_branches(step: VerifiedStep) -> tuple[list[tuple[VerifiedBranch, int]], int]:
    """The branches to draw, each with the step index of its first fed token: all of them when
    they fit in TOKEN_GRID_LIMIT columns, else those with guesses first, as many as fit."""
    placed = _with_offsets(step)
    if sum(len(branch.tokens) for branch, _ in placed) <= TOKEN_GRID_LIMIT:
        return placed, 0
    drawn, width = [], 0
    for branch, first in sorted(placed, key=lambda item: len(item[0].tokens) == item[0].drafts_from):
        if width + len(branch.tokens) > TOKEN_GRID_LIMIT:
            continue
        drawn.append((branch, first))
        width += len(branch.tokens)
    drawn.sort(key=lambda item: item[1])
    return drawn, len(placed) - len(drawn)
