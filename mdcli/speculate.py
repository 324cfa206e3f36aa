"""Speculative decoding inside the forest: how many guesses to verify, and which ones to keep.

Each step, a branch feeds its next token plus a tree of drafted tokens (mdcli/drafting.py) hanging
off it; every node sits at its own depth and attends to its ancestors, so the model scores every
guess of every branch in the same ONE forward. Walking down from the next token, a guess is
accepted while it equals the token the branch would have chosen there anyway (greedy: the
argmax; sampling: a draw from the branch's own generator at that node, the draw the unspeculated
run would make), and the model's own token after the last accepted guess comes for free. The
tokens are therefore exactly the unspeculated ones; only the number of forwards changes. The
decoder (mdcli/decoding.py) does the walking; this module decides the drafts:

* `Speculate`: the `--speculate auto|off|N` setting.
* `SpeculationPolicy`: per step, which draft nodes to verify. N: every branch drafts up to N
  tokens whenever its source has guesses. auto: each node has an estimated acceptance
  probability (learnt per match strength as the run goes) and is verified when the forward it
  is expected to save outweighs what one more token costs (a cost model t(m) = a + b m fitted
  to the forwards timed during the run; see `plan`), and a branch whose drafts keep failing
  pauses drafting for a while (after 3 failed steps in a row: 2, 4, ... 16 steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mdcli.drafting import DraftSource, DraftTree, Drafter, PromptLookup, merge_candidates
from mdcli.errors import UsageError

AUTO_MOST_PER_BRANCH = 16  # deepest draft auto ever verifies for one branch
LOOKUP_DEPTH = 10  # how far a candidate continuation reaches (HF's prompt_lookup_num_tokens default)
PAUSE_AFTER = 3  # auto: steps in a row with every guess rejected before a branch pauses guessing ...
MAX_PAUSE = 16  # ... for 2, 4, ... up to this many steps


@dataclass(frozen=True)
class Speculate:
    """`mode` is "auto", "off" or "fixed"; `most` is the draft tokens per branch per step."""

    mode: str = "auto"
    most: int = AUTO_MOST_PER_BRANCH

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def __str__(self) -> str:
        return str(self.most) if self.mode == "fixed" else self.mode


def parse_speculate(value: str | int | Speculate | None) -> Speculate:
    """'auto' | 'off' | N (N >= 1 draft tokens per branch per step; 0 means off)."""
    if isinstance(value, Speculate):
        return value
    if value is None:
        return Speculate()
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return Speculate(text)
    try:
        most = int(text)
    except ValueError:
        most = -1
    if most < 0:
        raise UsageError(f"--speculate takes auto, off or a number of draft tokens, not '{value}'",
                         fix="e.g. --speculate auto or --speculate 8")
    return Speculate("off") if most == 0 else Speculate("fixed", most)


def _critical_share(remaining: list[int]) -> list[float]:
    """1 / c for each of the c branches with the most tokens left, 0 for the others."""
    most = max(remaining)
    critical = sum(1 for r in remaining if r == most)
    return [1.0 / critical if r == most else 0.0 for r in remaining]


class ForwardCost:
    """t(m) = a + b m for a forward of m tokens, fitted to the forwards seen so far (weighted least
    squares, recent ones weighing more, so it follows the cache growing) plus a fixed prior in which
    one token costs 1/16 of a forward's fixed part (two pseudo-forwards, of 1 and 33 tokens)."""

    decay = 0.95
    _prior = (2.0, 34.0, 1090.0, 66.0, 1634.0)  # sums of 1, m, m^2, t, m t over (1, 17), (33, 49)

    def __init__(self) -> None:
        self.seen = [0.0] * 5  # the same sums over measured forwards, in prior units
        self.unit: float | None = None  # seconds per prior unit, set by the first measurement

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.unit is None:  # the first forward lands on the prior's line
            self.unit = seconds / (16 + tokens)
        t = seconds / self.unit
        self.seen = [self.decay * v for v in self.seen]
        for i, v in enumerate((1.0, tokens, tokens * tokens, t, tokens * t)):
            self.seen[i] += v

    def token_over_fixed(self) -> float:
        """b / a: what one more token adds to a forward, as a share of a forward's fixed cost."""
        n, sm, smm, st, smt = (p + v for p, v in zip(self._prior, self.seen))
        b = max((n * smt - sm * st) / (n * smm - sm * sm), 1e-3)
        a = max((st - b * sm) / n, 1e-3)
        return b / a


@dataclass
class BranchDrafts:
    """One branch's drafter and its record."""

    drafter: Drafter
    synced: int = 0  # generated tokens already given to the drafter
    failures: int = 0  # steps in a row whose drafts were all rejected
    paused_until: int = 0  # auto: no drafts before this step
    first_rate: float | None = None  # this branch's share of accepted first guesses (EMA)


@dataclass
class SpeculationPolicy:
    setting: Speculate
    source: DraftSource = field(default_factory=PromptLookup)
    cost: ForwardCost = field(default_factory=ForwardCost)
    # acceptance of a first guess and of a guess after an accepted one, per match strength
    first: dict[int, float] = field(default_factory=lambda: {3: 0.5, 2: 0.35, 1: 0.2})
    follow: dict[int, float] = field(default_factory=lambda: {3: 0.85, 2: 0.8, 1: 0.7})
    step: int = 0
    rate = 0.1  # EMA rate of the acceptance estimates

    # -- drafting ----------------------------------------------------------------------------

    def state(self, context: list[int]) -> BranchDrafts:
        return BranchDrafts(self.source.drafter(context))

    def draft(self, state: BranchDrafts, generated: list[int], most: int) -> DraftTree:
        """The candidate tree of one branch whose accepted tokens are now `generated`."""
        state.drafter.add(generated[state.synced :])
        state.synced = len(generated)
        if most < 1 or (self.setting.mode == "auto" and self.step < state.paused_until):
            return DraftTree()
        candidates = state.drafter.candidates(min(most, LOOKUP_DEPTH if self.setting.mode == "auto" else most))
        first = self.first
        if state.first_rate is not None:  # lean on how this branch has been doing
            first = {n: (p + state.first_rate) / 2 for n, p in first.items()}
        return merge_candidates(candidates, first, self.follow)

    def plan(self, trees: list[DraftTree], room: int, remaining: list[int] | None = None) -> list[DraftTree]:
        """Trim each branch's candidate tree to the nodes worth verifying this step.

        room: most draft tokens in all; remaining: tokens each branch may still generate.

        auto weighs a node by what it saves. A forward costs a + b m for m tokens, and every token
        a branch generates is fed once whether guessed or not, so a run costs about a x (its number
        of steps) + b x (tokens fed) and a rejected guess costs b. An accepted guess saves a step
        only when it shortens the run, which the branches furthest from done decide together: it
        is worth a / c for one of the c branches with the most tokens left and nothing for a
        branch that is already ahead. A node of acceptance chance p is verified when
        p a / c > (1 - p) b.
        """
        self.step += 1
        weight = _critical_share(remaining or [0] * len(trees))
        ranked = sorted(
            ((p * weight[b], p, b, node) for b, tree in enumerate(trees) for node, p in enumerate(tree.probability)),
            key=lambda item: (-item[0], item[2], item[3]),
        )
        per_token = self.cost.token_over_fixed()
        chosen: list[list[int]] = [[] for _ in trees]
        for worth, p, b, node in ranked:
            if room <= 0:
                break
            if self.setting.mode == "auto" and worth <= (1 - p) * per_token:
                continue
            parent = trees[b].parents[node]
            if len(chosen[b]) >= self.setting.most or (parent >= 0 and parent not in chosen[b]):
                continue
            chosen[b].append(node)
            room -= 1
        return [tree.keep(nodes) for tree, nodes in zip(trees, chosen)]

    # -- learning ----------------------------------------------------------------------------

    def observe_forward(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def observe(self, state: BranchDrafts, tree: DraftTree, accepted: list[int]) -> None:
        """accepted: the draft nodes accepted, root first (a path of `tree`)."""
        if not len(tree):
            return
        path = [-1, *accepted]
        for depth, parent in enumerate(path):
            offered = [i for i, p in enumerate(tree.parents) if p == parent]
            if not offered:
                break
            hit = depth < len(accepted)
            node = accepted[depth] if hit else offered[0]
            table = self.first if parent < 0 else self.follow
            n = tree.strength[node]
            table[n] += self.rate * (float(hit) - table[n])
            if parent < 0:
                rate = state.first_rate
                state.first_rate = float(hit) if rate is None else rate + 0.3 * (float(hit) - rate)
            if not hit:
                break
        self._pace(state, bool(accepted))

    def _pace(self, state: BranchDrafts, accepted_any: bool) -> None:
        """auto: a branch whose drafts keep failing drafts less often (2, 4, ... 16 steps off)."""
        if accepted_any:
            state.failures = 0
            return
        state.failures += 1
        if self.setting.mode == "auto" and state.failures >= PAUSE_AFTER:
            state.paused_until = self.step + min(MAX_PAUSE, 2 ** (state.failures - PAUSE_AFTER + 1))
