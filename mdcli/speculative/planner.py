"""Speculative decoding inside the forest: how many guesses to verify, and which ones to keep.

Each step, a branch feeds its next token plus a tree of drafted tokens (mdcli/speculative/drafting.py) hanging
off it; every node sits at its own depth and attends to its ancestors, so the model scores every
guess of every branch in the same ONE forward. Walking down from the next token, a guess is
accepted while it equals the token the branch would have chosen there anyway (greedy: the
argmax; sampling: a draw from the branch's own generator at that node, the draw the unspeculated
run would make), and the model's own token after the last accepted guess comes for free. The
tokens are therefore exactly the unspeculated ones; only the number of forwards changes. The
step loop's verify walk (mdcli/core/verify.py) does the walking; this module decides the drafts:

* `Speculate`: the `--speculate auto|off|N` setting; its `watch` is shown a `VerifiedStep` for every
  step that verified drafts.
* `SpeculationPolicy`: per step, which draft nodes to verify. N: every branch drafts up to N
  tokens whenever its source has guesses. auto: each node has an estimated acceptance
  probability (learnt per match strength as the run goes); the nodes verified are those that
  save the most expected time, by a cost model of a forward of m tokens learnt from the forwards
  timed during the run (see `plan`, mdcli/speculative/cost.py), and a branch whose drafts keep failing
  pauses drafting for a while (after 3 failed steps in a row: 2, 4, ... 16 steps).

A run takes as many forwards as its slowest branch needs, so with several branches auto weighs
two plans (`_plan_several`): guesses that surely shorten the run this step (the branches furthest
from done must all accept together, `_plan_levels`: what pays on one CPU core, where eight tied
branches rarely all do, so auto mostly waits until one is left behind), and every branch guessing
for the run as a whole (`_plan_broad`: what pays where a wider forward costs about what a plain one
does, as on a GPU, or where every branch quotes its document; the branch that guesses worst sets
the run's pace). The cost model, timed on the machine the run is on, decides between them. When
neither pays, a few first guesses are verified now and then (a probe, at most 1% of the time), so
that what the answers do later in the run (start quoting) is found out. Whatever the estimates
say, auto keeps an account of its guesses (forwards saved against what verifying cost) and stops
verifying while they have lost more than LOSS_SHARE of the run so far (probes are paced by their own
rule, not by that account: what tied branches' probes lose must not keep a branch that is later
left alone from guessing as it would alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mdcli.errors import UsageError
from mdcli.speculative.cost import ForwardCost
from mdcli.speculative.drafting import DraftSource, DraftTree, Drafter, PromptLookup, merge_candidates

AUTO_MOST_PER_BRANCH = 16  # deepest draft auto ever verifies for one branch
LOOKUP_DEPTH = 10  # how far a candidate continuation reaches (HF's prompt_lookup_num_tokens default)
PAUSE_AFTER = 3  # auto: steps in a row with every guess rejected before a branch pauses guessing ...
MAX_PAUSE = 16  # ... for 2, 4, ... up to this many steps
# auto, several branches guessing all run long (`_plan_broad`): the share of the forwards the
# slowest branch's expected acceptance would save that the run really saves. For B tied branches it
# is the share of 1/B of a forward that one accepted guess saves, 0.6 (measured: notebook/gpu.md,
# "Eight questions on the GPU: every branch guessing").
BROAD_SHARE = 0.6
# auto: when no plan verifies anything, a probe verifies the likeliest first guesses of up to
# PROBE_GUESSES branches, while the run has at least PROBE_RUN_LEFT steps to go (a shorter run has
# little to gain): first until PROBES verifying steps have been timed (the cost model cannot tell
# a CPU from a GPU before) or PROBES probes were made (a forest's probes change width as branches
# end, and a shape's first forward is never timed, so they may never be), then again once probing
# would have cost at most PROBE_SHARE of the steps since the last guess, and never more often than
# every PROBE_EVERY steps. The later probes
# keep the acceptance estimates current: an answer that starts quoting its document after a first
# stretch of paraphrase (where every early guess failed) is found again (measured:
# notebook/speculation.md, "auto keeps learning through the run").
# what the acceptance estimates' starting values are worth, in guesses seen, by match strength: a
# three-token match's 0.5 little (answers quoting their document are almost always right there,
# and should be trusted within a step or two), a one-token match's 0.1 more (one lucky guess
# among many wrong ones must not make the next four look like a coin toss) (measured:
# notebook/speculation.md, "A loss limit, and sibling guesses priced one by one")
PRIOR_GUESSES = {3: 2, 2: 4, 1: 8}
# a branch's first guesses lean its estimates its way: the rate learnt over all branches counts as
# BRANCH_PRIOR guesses of its own, and its own count BRANCH_MEMORY less with each later one (at
# most 1 / (1 - BRANCH_MEMORY) = 3.3: about even with the prior once it has a record). A lone
# branch's one lucky one-token guess moves that strength's 0.1 to 0.36 for it (0.2 over all
# branches).
BRANCH_PRIOR = 4
BRANCH_MEMORY = 0.7
PROBES = 3
PROBE_GUESSES = 8
PROBE_RUN_LEFT = 32
PROBE_SHARE = 0.01
PROBE_EVERY = 16
# auto's loss limit: what its planned guesses have cost so far beyond the forwards they saved, in
# plain steps, may reach LOSS_SHARE of the steps taken (plus LOSS_START steps' worth, for the first
# ones); below that, no plan verifies anything until the run's length has made room again. The
# estimates alone can verify many guesses that are mostly wrong in steps dearer than a plain one; the
# account bounds what guessing loses to about that share of the run, as it sees it (steps timed
# whole; the machine's own drift is not in it) (notebook/speculation.md, "A loss limit, and sibling
# guesses priced one by one"). Probes are not charged: their pace bounds them (PROBE_SHARE), and tied
# branches' probes, which save no forward by design, would spend the account early and leave a branch
# that later quotes its document guessing nothing.
LOSS_SHARE = 0.02
LOSS_START = 16


@dataclass(frozen=True)
class VerifiedBranch:
    """One branch's part of a verified step. Indices into `tokens` are the branch's fed nodes:
    its chain (its next token) first, then its draft nodes."""

    label: str
    tokens: list[int]
    depths: list[int]  # the position (RoPE) of each fed token
    drafts_from: int  # index of the first draft node (= the chain's length)
    sees: list[list[int]]  # per fed token: the step's fed tokens it attends to (indices over the whole step)
    path_slots: int  # cache slots from before the step that all of its tokens attend to
    accepted: list[int]  # draft nodes accepted, root first
    next_token: int | None  # the model's own token after the last accepted one (None: the branch finished)


@dataclass(frozen=True)
class VerifiedStep:
    """A forward that verified drafts, as `Speculate.watch` is shown it (the step loop's verify
    walk, mdcli/core/verify.py, makes it): every branch fed in it, in the order they were laid out."""

    step: int  # the run's decode step count, this one included
    cache_slots: int  # slots in the cache before the step
    branches: list[VerifiedBranch]


@dataclass(frozen=True)
class Speculate:
    """`mode` is "auto", "off" or "fixed"; `most` is the draft tokens per branch per step;
    `watch`, if given, is shown every step that verifies drafts (`mdcli explain --speculate`)."""

    mode: str = "auto"
    most: int = AUTO_MOST_PER_BRANCH
    watch: Callable[[VerifiedStep], None] | None = field(default=None, compare=False, repr=False)

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def __str__(self) -> str:
        return str(self.most) if self.mode == "fixed" else self.mode

    def recipe_value(self) -> str | int:
        """The setting as a recipe's `speculate:` field writes it: "auto", "off" or N."""
        return self.most if self.mode == "fixed" else self.mode


# The command line's default (mdcli.api's functions default to "off"): auto guesses only where its
# learnt costs say a guess saves time, and stops while its guesses have lost more than LOSS_SHARE
# of the run (measured: docs/performance.md, "Speculative decoding (`--speculate auto` against `off`)").
DEFAULT_SPECULATE = "auto"


def parse_speculate(value: str | int | Speculate | None) -> Speculate:
    """'auto' | 'off' | N (N >= 1 draft tokens per branch per step; 0 means off)."""
    if isinstance(value, Speculate):
        return value
    if value is None:
        return Speculate(DEFAULT_SPECULATE)
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


def _keep(trees: list[DraftTree], picked: list[tuple[float, int, int]]) -> list[DraftTree]:
    """Each tree trimmed to its picked nodes ((worth, branch, node) triples)."""
    chosen: list[list[int]] = [[] for _ in trees]
    for _, b, node in picked:
        chosen[b].append(node)
    return [tree.keep(nodes) for tree, nodes in zip(trees, chosen)]


def _probe_breadth(fed: int) -> int:
    """Branches a probe needs guesses of: half of them, at least one, at most PROBE_GUESSES / 2."""
    return min(max(fed // 2, 1), PROBE_GUESSES // 2)


def _critical_share(remaining: list[int]) -> list[float]:
    """1 / c for each of the c branches with the most tokens left, 0 for the others."""
    most = max(remaining)
    critical = sum(1 for r in remaining if r == most)
    return [1.0 / critical if r == most else 0.0 for r in remaining]


@dataclass
class BranchDrafts:
    """One branch's drafter and its record."""

    drafter: Drafter
    synced: int = 0  # generated tokens already given to the drafter
    failures: int = 0  # steps in a row whose drafts were all rejected
    paused_until: int = 0  # auto: no drafts before this step
    first_seen: float = 0.0  # this branch's first guesses seen, and right: recent ones weigh most
    first_hits: float = 0.0

    def leaning(self, rate: float) -> float:
        """A first-guess rate learnt over all branches, leant towards how this one has been doing
        (`BRANCH_PRIOR`)."""
        return (BRANCH_PRIOR * rate + self.first_hits) / (BRANCH_PRIOR + self.first_seen)


@dataclass
class SpeculationPolicy:
    setting: Speculate
    source: DraftSource = field(default_factory=PromptLookup)
    cost: ForwardCost = field(default_factory=ForwardCost)
    # acceptance of a first guess and of a guess after an accepted one, per match strength
    first: dict[int, float] = field(default_factory=lambda: {3: 0.5, 2: 0.3, 1: 0.1})
    follow: dict[int, float] = field(default_factory=lambda: {3: 0.8, 2: 0.7, 1: 0.5})
    step: int = 0
    last_guess: int = 0  # the last step that verified guesses
    # forward shapes timed once already: the first forward of a shape pays for its kernels' first
    # call (oneDNN builds a primitive per shape, so it takes much longer than a later one), which would
    # teach the cost model that guessing costs several steps, after which auto would never guess
    # again to learn otherwise (measured: notebook/speculation.md, "auto keeps learning through the run")
    warm: set[tuple[int, bool]] = field(default_factory=set)
    timing: tuple[int, int] | None = None  # what this step fed: (branch tokens, guesses); None: not timed
    # how many guesses each estimate has learnt from ((first?, strength) -> count): an estimate
    # is the mean of its prior (worth PRIOR_GUESSES of its strength) and what it saw until it has seen
    # 1 / rate guesses, then a running mean at `rate` (answers change as they go: a paraphrase
    # can turn into a quote; a flat rate from the start learns too slowly that quoting answers'
    # matches are right) (measured: notebook/speculation.md, "auto keeps learning through the run").
    seen: dict[tuple[bool, int], int] = field(default_factory=dict)
    rate = 0.1
    # auto's account of its own guesses, in plain steps: forwards they saved minus what verifying
    # them cost beyond a plain step (see LOSS_SHARE); `gaps` are this step's branches' distances
    # behind the furthest from done, `charging` whether this step's cost goes on the account
    balance: float = 0.0
    probes: int = 0  # probes made (see PROBES)
    gaps: list[int] = field(default_factory=list)
    charging: bool = False

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
        first = {n: state.leaning(p) for n, p in self.first.items()}
        return merge_candidates(candidates, first, self.follow)

    def plan(self, trees: list[DraftTree], room: int, remaining: list[int] | None = None) -> list[DraftTree]:
        """Trim each branch's candidate tree to the nodes worth verifying this step.

        room: most draft tokens in all; remaining: tokens each branch may still generate.

        auto, a lone branch: a node accepted with chance p saves p of a plain step; d guesses cost
        what a step verifying them adds to it (`ForwardCost`). auto verifies the d likeliest nodes, for the d that saves the most time,
        if any (checked as a whole, since the first guess can cost more than the next ones).
        auto, several branches: `_plan_several`. N: the likeliest nodes, up to N per branch, those
        of the branches furthest from done first when `room` runs short.
        """
        self.step += 1
        fed = len(trees)
        remaining = remaining or [0] * fed
        self.gaps = [max(remaining) - r for r in remaining]
        if self.setting.mode != "auto":
            return _keep(trees, self._ranked(trees, _critical_share(remaining), room))
        if self.balance < -LOSS_SHARE * (self.step + LOSS_START):
            return [DraftTree() for _ in trees]
        if fed > 1:
            kept = self._plan_several(trees, room, remaining)
        else:
            picked = self._ranked(trees, _critical_share(remaining), room)
            kept = _keep(trees, picked[: self._best_count(picked, fed)[0]])
        self.charging = any(len(tree) for tree in kept)  # planned guesses go on the account; probes do not
        if not self.charging and (probe := self._probe(trees, room, remaining)) is not None:
            kept = probe
            self.probes += 1
        if sum(1 for tree in kept if len(tree)) >= _probe_breadth(fed):
            self.last_guess = self.step  # (a lagging branch's lone catch-up guess says little of the others)
        return kept

    def _probe(self, trees: list[DraftTree], room: int, remaining: list[int]) -> list[DraftTree] | None:
        """The likeliest first guesses of up to PROBE_GUESSES branches, if a probe is due (see
        PROBES) and enough branches have one (`_probe_breadth`); else None."""
        fed = len(trees)
        if max(remaining) < PROBE_RUN_LEFT:
            return None
        firsts = []  # (chance, branch, node) of each branch's likeliest first guess
        for b, tree in enumerate(trees):
            if len(tree):
                node = tree.likeliest_path()[0]
                firsts.append((tree.probability[node], b, node))
        firsts = sorted(firsts, reverse=True)[: min(PROBE_GUESSES, room)]
        if len(firsts) < _probe_breadth(fed):
            return None
        first_probes = self.cost.verifying < PROBES and self.probes < PROBES
        if not first_probes and self.step - self.last_guess < self._probe_interval(fed, len(firsts)):
            return None
        return _keep(trees, firsts)

    def _probe_interval(self, fed: int, guesses: int) -> int:
        """Steps between probes: what one costs, over PROBE_SHARE of a plain step."""
        plain = self.cost.plain(fed)
        extra = self.cost.verified(fed, guesses) - plain
        return max(PROBE_EVERY, math.ceil(extra / (PROBE_SHARE * plain)))

    def _ranked(self, trees: list[DraftTree], weight: list[float], room: int) -> list[tuple[float, int, int]]:
        """(worth, branch, node) of the likeliest nodes, worth = chance x the branch's weight,
        best first: at most `room` in all and `most` per branch, each after its parent."""
        ranked = sorted(
            ((p * weight[b], b, node) for b, tree in enumerate(trees) for node, p in enumerate(tree.probability)),
            key=lambda item: (-item[0], item[1], item[2]),
        )
        chosen: list[set[int]] = [set() for _ in trees]
        picked: list[tuple[float, int, int]] = []
        for worth, b, node in ranked:
            if len(picked) >= room or (self.setting.mode == "auto" and worth <= 0):
                break
            parent = trees[b].parents[node]
            if len(chosen[b]) >= self.setting.most or (parent >= 0 and parent not in chosen[b]):
                continue
            chosen[b].add(node)
            picked.append((worth, b, node))
        return picked

    def _plan_several(self, trees: list[DraftTree], room: int, remaining: list[int]) -> list[DraftTree]:
        """auto with several branches: the better of two plans, or none when neither saves time.

        `_plan_levels` counts only the forwards this step surely takes off the run (the branches
        furthest from done must all accept together), right where a wider forward costs much
        more (one CPU core). `_plan_broad` has every branch guess for the run's length as a whole,
        which pays where a wider forward costs about what a plain one does (a GPU). (When neither
        saves time, `plan` may still probe.)"""
        levels_gain, levels = self._plan_levels(trees, room, remaining)
        broad_gain, broad = self._plan_broad(trees, room, remaining)
        return broad if broad_gain > levels_gain else levels

    def _plan_broad(self, trees: list[DraftTree], room: int, remaining: list[int]) -> tuple[float, list[DraftTree]]:
        """Every branch that could set the run's length guesses its k likeliest nodes, for the k
        that saves the most time over the run as a whole.

        Guessing k nodes, branch b is expected to accept E_b of them a forward (the sum of their
        chances), so it needs about r_b / (1 + E_b) more forwards, and the run, which lasts as
        long as its slowest branch, L = max_b of that: the branch that guesses worst sets it
        (eight questions that all quote the document gain; among 32, one that paraphrases holds
        the run to its own pace, and guessing for the others saves nothing). A branch that ends
        within L without guessing does not guess. Saved a forward: (max_b r_b - L) / L plain
        steps, counted at BROAD_SHARE (the slowest branch's luck varies around its expectation)."""
        top = max(remaining)
        fed = len(trees)
        none = [DraftTree() for _ in trees]
        if top <= 0:
            return 0.0, none
        step = self.cost.plain(fed)
        ranked = [[node for _, _, node in self._ranked([tree], [1.0], len(tree))] for tree in trees]  # each likeliest first
        best_gain, best = 0.0, none
        for k in range(1, self.setting.most + 1):
            expected = [sum(tree.probability[n] for n in nodes[:k]) for tree, nodes in zip(trees, ranked)]
            length = max(r / (1 + e) for r, e in zip(remaining, expected))
            chosen = [nodes[:k] if r > length else [] for r, nodes in zip(remaining, ranked)]
            guesses = sum(len(nodes) for nodes in chosen)
            if guesses > room or length >= top:
                break
            gain = BROAD_SHARE * (top - length) / length * step - (self.cost.verified(fed, guesses) - step)
            if gain > best_gain:
                best_gain, best = gain, [tree.keep(nodes) for tree, nodes in zip(trees, chosen)]
        return best_gain, best

    def _plan_levels(self, trees: list[DraftTree], room: int, remaining: list[int]) -> tuple[float, list[DraftTree]]:
        """How far to try to shorten the run this step, counting only surely saved forwards.

        Without further guesses the run needs max(remaining) more forwards. Shortening it by J
        needs every branch b with gap g_b = max(remaining) - remaining_b < J to accept J - g_b
        guesses; so for each J the branches below that level draft that deep along their likeliest
        path, and the forwards saved are expected at sum over j <= J of prod_b P(b accepts
        j - g_b guesses). The J that saves the most time net of the wider forward's cost is
        the plan (with its gain), if any saves time. Only surely saved forwards count: an accepted
        guess of a branch that is no longer the slowest saves nothing (measured:
        notebook/speculation.md, "Several branches: guess only where it shortens the run")."""
        top = max(remaining)
        gaps = [top - r for r in remaining]
        paths = [tree.likeliest_path() for tree in trees]
        fed = len(trees)
        step = self.cost.plain(fed)
        best_level, best_gain, saved = 0, 0.0, 0.0
        for level in range(1, self.setting.most + 1):
            depths = [min(max(0, level - gap), len(path)) for gap, path in zip(gaps, paths)]
            if sum(depths) > room:
                break
            together = 1.0  # the chance every branch below this level reaches it
            for tree, gap, path in zip(trees, gaps, paths):
                need = level - gap
                if need > 0:
                    together *= tree.probability[path[need - 1]] if need <= len(path) else 0.0
            if together == 0.0:
                break
            saved += together
            gain = saved * step - (self.cost.verified(fed, sum(depths)) - step)
            if gain > best_gain:
                best_level, best_gain = level, gain
        return best_gain, [tree.keep(path[: max(0, best_level - gap)]) for tree, gap, path in zip(trees, gaps, paths)]

    def _best_count(self, picked: list[tuple[float, int, int]], fed: int) -> tuple[int, float]:
        """How many of the ranked nodes to verify (the count that saves the most time), and the
        time it saves."""
        step = self.cost.plain(fed)
        best, best_gain, saved = 0, 0.0, 0.0
        for count, (worth, _, _) in enumerate(picked, start=1):
            saved += worth * step
            gain = saved - (self.cost.verified(fed, count) - step)
            if gain > best_gain:
                best, best_gain = count, gain
        return best, best_gain

    # -- learning ----------------------------------------------------------------------------

    def observe_plain(self, tokens: int, seconds: float) -> None:
        if self._warmed((tokens, False)):
            self.cost.observe_plain(tokens, seconds)

    def observe_verified(self, tokens: int, guesses: int, seconds: float) -> None:
        warm = self._warmed((tokens + guesses, True))
        if warm:
            self.cost.observe_verified(tokens, guesses, seconds)
        if self.charging:  # a step this policy chose to verify: its cost beyond a plain step
            self.charging = False
            self.balance -= self.cost.excess(tokens, guesses, seconds) / self.cost.plain(tokens)

    def settle(self, accepted: list[int]) -> None:
        """Credit a verified step's guesses with the forwards they took off the run: the run
        lasts as long as the branch furthest from done, so it is shortened by min over branches
        of (how far behind that one it was + guesses it accepted). accepted: per branch fed, in
        the order `plan` was given them. A probe's step is neither charged nor credited."""
        if self.charging:
            self.balance += min(gap + n for gap, n in zip(self.gaps, accepted))

    def _warmed(self, shape: tuple[int, bool]) -> bool:
        """True if a forward of this shape (width, verifying) was timed before in this run."""
        if shape in self.warm:
            return True
        self.warm.add(shape)
        return False

    def observe(self, state: BranchDrafts, tree: DraftTree, accepted: list[int]) -> None:
        """accepted: the draft nodes accepted, root first (a path of `tree`).

        The rates are what `merge_candidates` reads: the chance that a child is right given that
        the siblings before it were not. So each verified child up to the right one is one
        guess of its strength seen, right or wrong, and the ones after the right one say nothing;
        counting one guess a level (right if any sibling was) would overprice siblings many times
        over (measured: notebook/speculation.md, "A loss limit, and sibling guesses priced one by one")."""
        if not len(tree):
            return
        path = [-1, *accepted]
        for depth, parent in enumerate(path):
            offered = [i for i, p in enumerate(tree.parents) if p == parent]
            if not offered:
                break
            right = accepted[depth] if depth < len(accepted) else None
            for node in offered:
                self._learn(parent < 0, tree.strength[node], node == right)
                if node == right:
                    break
            if parent < 0:  # the branch's own record: was its likeliest first guess right?
                state.first_seen = BRANCH_MEMORY * state.first_seen + 1
                state.first_hits = BRANCH_MEMORY * state.first_hits + float(offered[0] == right)
            if right is None:
                break
        self._pace(state, bool(accepted))

    def _learn(self, first: bool, strength: int, hit: bool) -> None:
        table = self.first if first else self.follow
        key = (first, strength)
        self.seen[key] = self.seen.get(key, 0) + 1
        step = max(self.rate, 1 / (PRIOR_GUESSES[strength] + self.seen[key]))
        table[strength] += step * (float(hit) - table[strength])

    def _pace(self, state: BranchDrafts, accepted_any: bool) -> None:
        """auto: a branch whose drafts keep failing drafts less often (2, 4, ... 16 steps off)."""
        if accepted_any:
            state.failures = 0
            return
        state.failures += 1
        if self.setting.mode == "auto" and state.failures >= PAUSE_AFTER:
            state.paused_until = self.step + min(MAX_PAUSE, 2 ** (state.failures - PAUSE_AFTER + 1))
