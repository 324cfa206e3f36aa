"""Speculative decoding changes how many forwards a branch takes, never its tokens.

Drafts come from prompt lookup (what followed the branch's last n tokens earlier in what it reads);
the model verifies every draft node in the same forward as every branch's next token; rejected
nodes leave the cache. Evidence: greedy tokens with `--speculate auto` and with a large forced N
equal those with speculation off and `model.generate` alone (embedded model and tiny models of every
architecture, sliding windows included, many branches, forks, compaction); seeded sampling draws the
same tokens as without drafts; each tree node's logits equal its path run alone; after a rollback
the cache holds exactly what feeding only the accepted tokens would have left.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdcli.api import ask_many, run_specs
from mdcli.core.decoding import BranchSpec, Decoder
from mdcli.speculative.drafting import Candidate, DraftTree, PromptLookup, merge_candidates
from mdcli.core.engine import Engine
from mdcli.errors import UsageError
from mdcli.events import Done, Finish, Start, Token
from mdcli.core.forest import layout_trees
from mdcli.models.load import load_model
from mdcli.core.sampling import SamplingParams
from mdcli.speculative.cost import ForwardCost
from mdcli.speculative.planner import Speculate, SpeculationPolicy, parse_speculate
from tests.reference import generate_alone
from tests.test_engine_exactness import ARCHS, engine_for, tiny_model

STORY = (
    "Mara lived in a small lighthouse on the coast of Brittany. Every night she climbed the one hundred "
    "steps to light the great lamp. One stormy evening, a fishing boat named the Petrel lost its way in "
    "the fog. Mara rang the old bronze bell until the fishermen found the harbour.\n"
)
QUOTING = [
    "Repeat the first sentence of the text word for word.",
    "Copy the text above exactly.",
    "What did Mara ring?",
    "Where did Mara live?",
]


def finishes(events) -> dict[str, list[int]]:
    return {e.label: e.token_ids for e in events if isinstance(e, Finish)}


def done_stats(events):
    return next(e for e in events if isinstance(e, Done)).stats


# -- the setting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "mode", "most"), [("auto", "auto", 16), ("off", "off", 16), ("0", "off", 16),
                                                    ("12", "fixed", 12), (" AUTO ", "auto", 16)])
def test_speculate_setting_reads_auto_off_and_a_draft_count(text, mode, most):
    setting = parse_speculate(text)
    assert (setting.mode, setting.most) == (mode, most)


def test_the_generating_commands_speculate_auto_unless_told_off():
    import inspect

    from mdcli.cli.ask_many import ask_many as ask_many_command
    from mdcli.cli.margins import margins
    from mdcli.cli.think import think

    for command in (ask_many_command, margins, think):
        assert inspect.signature(command).parameters["speculate"].default == "auto", command.__name__
    assert parse_speculate(None) == Speculate("auto")  # `mdcli run` and recipes without a setting


@pytest.mark.parametrize("text", ["-1", "many", "1.5"])
def test_a_bad_speculate_setting_is_refused_with_the_fix(text):
    with pytest.raises(UsageError, match="--speculate takes auto, off or a number"):
        parse_speculate(text)


# -- drafts --------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_tokens_longest_match_first():
    drafter = PromptLookup().drafter([1, 2, 3, 4, 5, 9, 7, 3, 8, 1, 2, 3])
    found = drafter.candidates(3)
    assert found[0] == Candidate((4, 5, 9), 3)  # "1 2 3" was followed by 4 5 9
    assert Candidate((8, 1, 2), 1) in found  # "3" alone was also followed by 8
    assert all(c.strength >= d.strength for c, d in zip(found, found[1:]))


def test_prompt_lookup_also_reads_the_branch_own_answer_so_far():
    drafter = PromptLookup().drafter([5, 6])
    assert drafter.candidates(4) == []
    drafter.add([10, 11, 12, 13, 10, 11])
    assert drafter.candidates(2)[0] == Candidate((12, 13), 2)


@given(
    document=st.lists(st.integers(0, 5), min_size=64, max_size=160),
    tails=st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=2, max_size=4),
    answers=st.lists(st.lists(st.integers(0, 5), max_size=10), min_size=4, max_size=4),
)
@settings(max_examples=60, deadline=None)
def test_branches_sharing_a_document_share_its_index_and_draft_exactly_as_alone(document, tails, answers):
    """One lookup source for the run: later branches reuse the first one's index of the document
    (and of its question, where theirs starts the same) and index only their own rest; their
    candidates at every point are those of a drafter built alone."""
    together = PromptLookup(max_occurrences=5)
    drafters = [together.drafter(document + tail) for tail in tails]
    for tail, drafter, answer in zip(tails, drafters, answers):
        alone = PromptLookup(max_occurrences=5).drafter(document + tail)
        for token in answer:
            assert drafter.candidates(4) == alone.candidates(4)
            drafter.add([token])
            alone.add([token])
        assert drafter.candidates(4) == alone.candidates(4)


def test_candidates_merge_into_a_tree_whose_probabilities_never_rise_down_a_path():
    first, follow = {3: 0.6, 2: 0.4, 1: 0.2}, {3: 0.9, 2: 0.8, 1: 0.7}
    tree = merge_candidates([Candidate((4, 5, 6), 3), Candidate((4, 5, 7), 2), Candidate((8,), 1)], first, follow)
    assert tree.tokens == [4, 5, 6, 7, 8]
    assert tree.parents == [-1, 0, 1, 1, -1]  # shared prefix "4 5" is one path
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            assert tree.probability[node] <= tree.probability[parent]
    assert tree.children()[0] == {4: 0, 8: 4}


def test_a_fixed_budget_keeps_at_most_n_nodes_per_branch_and_only_whole_paths():
    policy = SpeculationPolicy(Speculate("fixed", 3))
    drafter = PromptLookup().drafter([1, 2, 3, 4, 5, 6, 7, 1, 2, 9, 9, 1, 2])
    tree = policy.draft(_state(policy, drafter), [], 3)
    [kept] = policy.plan([tree], room=100)
    assert 0 < len(kept) <= 3
    assert all(p < i for i, p in enumerate(kept.parents))


def _state(policy, drafter):
    from mdcli.speculative.planner import BranchDrafts

    return BranchDrafts(drafter)


def test_auto_verifies_fewer_drafts_when_a_forward_token_costs_more():
    def kept_with(cost_per_token: float) -> int:
        policy = SpeculationPolicy(Speculate("auto"))
        _time_steps(policy, 1, (0, 3, 15, 31), 0.02, cost_per_token)
        drafter = PromptLookup().drafter(list(range(40)) * 2 + list(range(5)))
        tree = policy.draft(_state(policy, drafter), [], 16)
        return len(policy.plan([tree], room=100)[0])

    assert kept_with(0.0001) > kept_with(0.02)


def test_auto_spends_no_guesses_on_a_branch_already_ahead_of_the_others():
    policy = SpeculationPolicy(Speculate("auto"))
    drafter = PromptLookup().drafter([1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3])
    tree = policy.draft(_state(policy, drafter), [], 8)
    ahead, behind = policy.plan([tree, tree], room=100, remaining=[10, 30])
    assert len(ahead) == 0 and len(behind) > 0


TIED_DRAFTS = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3]


def _time_steps(policy, tokens: int, guesses, base: float, per_token: float, overhead: float = 0.0) -> None:
    """Time steps of `tokens` tokens plus each count of `guesses` (0: a plain step) at `base` s +
    `per_token` s a token (+ `overhead` s for a verifying step), after one warm-up step of each
    shape (the policy learns nothing from a shape's first forward: `test_a_shape_first_forward_...`)."""
    for g in dict.fromkeys(guesses):
        policy.observe_verified(tokens, g, 1.0) if g else policy.observe_plain(tokens, 1.0)
    for g in guesses:
        seconds = base + per_token * (tokens + g)
        if g:
            policy.observe_verified(tokens, g, seconds + overhead)
        else:
            policy.observe_plain(tokens, seconds)


def _tied_plan(per_token: float, first: float, follow: float, guesses=(0, 8, 24) * 2, overhead=0.0,
               branches: int = 8, left: int = 50) -> list[int]:
    """Draft tokens auto verifies for `branches` branches tied `left` tokens from done, after timing
    steps of that many tokens plus `guesses` at 80 ms + `per_token` s a token (+ `overhead`)."""
    policy = SpeculationPolicy(Speculate("auto"), first={3: first, 2: first, 1: first},
                               follow={3: follow, 2: follow, 1: follow})
    _time_steps(policy, branches, guesses, 0.08, per_token, overhead)
    trees = [policy.draft(_state(policy, PromptLookup().drafter(TIED_DRAFTS)), [], 8) for _ in range(branches)]
    return [len(t) for t in policy.plan(trees, room=200, remaining=[left] * branches)]


def test_where_a_token_costs_much_tied_branches_guess_only_when_all_of_them_would_likely_be_right():
    """One CPU core: each token adds ~6% to an eight-token forward; a forward is saved only if
    all eight accept, and 0.5 ** 8 is a forward saved once in 256 steps."""
    assert _tied_plan(0.01, 0.5, 0.8) == [0] * 8
    likely = _tied_plan(0.01, 0.99, 0.99)
    assert min(likely) > 0 and len(set(likely)) == 1  # all guess, equally deep


def test_where_wider_forwards_cost_almost_nothing_every_tied_branch_guesses_deep():
    """A GPU: 64 more tokens add 0.01% to a forward, so every branch's guesses pay for the run as
    a whole even though this step is rarely shortened by them all."""
    kept = _tied_plan(0.000001, 0.5, 0.8)
    assert min(kept) >= 2 and sum(kept) > 16


def test_tied_branches_do_not_guess_for_the_run_when_one_of_them_cannot_keep_up():
    """A GPU-like machine, eight tied branches: seven could guess deep, but the eighth has nothing
    to guess (no match in what it reads), so the run lasts its 50 steps whatever the others
    accept, and guessing for them would cost without saving a forward."""
    policy = SpeculationPolicy(Speculate("auto"), first={3: 0.9, 2: 0.9, 1: 0.9}, follow={3: 0.9, 2: 0.9, 1: 0.9})
    _time_steps(policy, 8, (0, 8, 24) * 2, 0.08, 0.000001)
    trees = [policy.draft(_state(policy, PromptLookup().drafter(TIED_DRAFTS)), [], 8) for _ in range(7)]
    stuck = policy.draft(_state(policy, PromptLookup().drafter([11, 12, 13, 14])), [], 8)
    assert len(stuck) == 0
    assert [len(t) for t in policy.plan([*trees, stuck], room=200, remaining=[50] * 8)] == [0] * 8
    assert min(len(t) for t in policy.plan([*trees, trees[0]], room=200, remaining=[50] * 8)) >= 2


def test_what_verifying_costs_beyond_the_guesses_makes_auto_guess_deeper_or_not_at_all():
    """A GPU where the forward is free but the walk and the rollback add a fixed 10 ms to a
    30 ms step: a few guesses do not pay for it, many likely ones do."""
    def kept_with(first: float, follow: float) -> int:
        policy = SpeculationPolicy(Speculate("auto"), first={3: first, 2: first, 1: first},
                                   follow={3: follow, 2: follow, 1: follow})
        _time_steps(policy, 8, (0, 8, 24, 0, 40, 16) * 3, 0.03, 0.0, overhead=0.01)
        trees = [policy.draft(_state(policy, PromptLookup().drafter(TIED_DRAFTS)), [], 8) for _ in range(8)]
        return sum(len(t) for t in policy.plan(trees, room=200, remaining=[50] * 8))

    assert kept_with(0.1, 0.3) == 0
    assert kept_with(0.6, 0.9) > 16


def test_auto_probes_wider_forwards_a_few_times_before_trusting_its_cost_prior():
    """Only plain eight-token steps timed: auto cannot tell a CPU from a GPU yet, so it verifies
    one guess per branch (a probe), until PROBES verifying steps have been timed."""
    from mdcli.speculative.planner import PROBE_GUESSES, PROBE_RUN_LEFT, PROBES

    assert _tied_plan(0.01, 0.5, 0.8, guesses=(0,) * 20) == [1] * 8
    assert _tied_plan(0.01, 0.5, 0.8, guesses=(0,) * 20 + (8,) * PROBES) == [0] * 8
    assert sum(_tied_plan(0.01, 0.5, 0.8, guesses=(0,) * 20, branches=32)) == PROBE_GUESSES  # a bounded probe
    assert _tied_plan(0.01, 0.5, 0.8, guesses=(0,) * 20, left=PROBE_RUN_LEFT - 1) == [0] * 8  # too short to pay


def test_auto_probes_again_after_a_stretch_without_guesses_and_guesses_on_once_they_land():
    """Eight tied branches whose first guesses all failed early (acceptance estimated at 0.1):
    nothing pays, so auto stops guessing, but probes again once a probe costs at most
    PROBE_SHARE of the steps since, and when that probe's guesses are all right (the answers
    have started quoting the document), every branch guesses from the next step on."""
    from mdcli.speculative.planner import PROBE_EVERY, PROBES

    policy = SpeculationPolicy(Speculate("auto"), first={3: 0.1, 2: 0.1, 1: 0.1}, follow={3: 0.3, 2: 0.3, 1: 0.3})
    _time_steps(policy, 8, (0,) * 10 + (8,) * PROBES, 0.08, 0.002)  # a guess adds 2% to a step
    states = [_state(policy, PromptLookup().drafter(TIED_DRAFTS)) for _ in range(8)]

    def step() -> list[DraftTree]:
        trees = [policy.draft(state, [], 8) for state in states]
        kept = policy.plan(trees, room=200, remaining=[200] * 8)
        if guesses := sum(len(t) for t in kept):
            policy.observe_verified(8, guesses, 0.08 + 0.002 * (8 + guesses))
        else:
            policy.observe_plain(8, 0.08 + 0.002 * 8)
        return kept

    quiet, kept = 0, step()
    while not any(len(t) for t in kept) and quiet < 100:
        quiet, kept = quiet + 1, step()
    assert PROBE_EVERY - 1 <= quiet <= 40  # 8 guesses cost 17% of a step: a probe after ~17 steps
    assert [len(t) for t in kept] == [1] * 8
    for state, tree in zip(states, kept):
        policy.observe(state, tree, [0])
    assert all(len(t) >= 1 for t in step())


def test_a_shape_first_forward_teaches_the_cost_model_nothing():
    """A shape's first forward pays for its kernels' first call (oneDNN builds a primitive per
    shape): a lone branch's first two-token forward, ten plain steps long, must not teach auto
    that guessing never pays."""
    policy = SpeculationPolicy(Speculate("auto"))
    _time_steps(policy, 1, (0, 0, 0), 0.06, 0.0)
    policy.observe_verified(1, 1, 0.60)  # cold
    assert policy.cost.verifying == 0
    policy.observe_verified(1, 1, 0.08)  # warm
    assert policy.cost.verified(1, 1) / policy.cost.plain(1) < 1.5


def test_auto_has_the_branch_left_behind_guess_as_much_deeper_as_it_lags():
    """Two tokens behind: its first two guesses alone can save forwards; any deeper one saves a
    forward only together with a guess of the branch ahead."""
    policy = SpeculationPolicy(Speculate("auto"), first={3: 0.9, 2: 0.9, 1: 0.9}, follow={3: 0.9, 2: 0.9, 1: 0.9})
    _time_steps(policy, 2, (0, 6, 14), 0.08, 0.001)
    tree = policy.draft(_state(policy, PromptLookup().drafter([1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3])), [], 8)
    behind, ahead = policy.plan([tree, tree], room=100, remaining=[32, 30])
    assert len(behind) >= 2 and len(behind) == len(ahead) + 2


def test_one_slow_verifying_step_moves_the_cost_model_by_at_most_half_a_step():
    """A pause in a rare verifying step (the collector, the VM) must not make auto expect every
    later guess to cost it, but steps that keep showing a dear verification are believed."""
    cost = ForwardCost()
    cost.observe_plain(8, 0.1)
    expected = cost.verified(8, 8) / cost.plain(8)
    cost.observe_verified(8, 8, 1.5)  # paused: 14 steps long
    assert cost.verified(8, 8) / cost.plain(8) <= expected + 0.5
    for _ in range(40):
        cost.observe_verified(8, 8, 0.3)
    assert cost.verified(8, 8) / cost.plain(8) == pytest.approx(3.0, rel=0.1)


def test_the_cost_model_learns_plain_steps_by_width_and_verifying_as_a_fixed_part_plus_a_part_per_guess():
    cost = ForwardCost()
    cost.observe_plain(1, 0.020)  # a lone branch's step can run a cheaper kernel than any longer forward
    cost.observe_plain(8, 0.040)
    for _ in range(40):
        for guesses in (1, 7, 15, 39):
            cost.observe_verified(1, guesses, 0.020 + 0.009 + 0.002 * guesses)
    assert cost.verified(1, 9) / cost.plain(1) == pytest.approx((0.029 + 0.018) / 0.020, rel=0.02)
    assert cost.plain(8) / cost.plain(1) == pytest.approx(2.0)
    assert cost.verified(8, 4) / cost.plain(8) == pytest.approx((0.049 + 0.008) / 0.040, rel=0.02)


@pytest.mark.parametrize("per_token", [0.00001, 0.005], ids=["gpu-like", "cpu-core-like"])
def test_the_cost_model_keeps_what_a_few_verifying_steps_showed_through_hundreds_of_plain_steps(per_token):
    """Eight branches, no guesses for 300 steps: those steps say nothing about what a guess
    costs, so what three verifying steps showed must stand."""
    cost = ForwardCost()
    cost.observe_plain(8, 0.02 + per_token * 8)
    for guesses in (4, 16, 40):
        cost.observe_verified(8, guesses, 0.02 + per_token * (8 + guesses))
    for _ in range(300):
        cost.observe_plain(8, 0.02 + per_token * 8)
    expected = (0.02 + per_token * 64) / (0.02 + per_token * 8)
    assert cost.verified(8, 56) / cost.plain(8) == pytest.approx(expected, rel=0.15)


def test_a_branch_whose_drafts_keep_failing_pauses_drafting():
    policy = SpeculationPolicy(Speculate("auto"))
    state = _state(policy, PromptLookup().drafter([1, 2, 3, 1, 2]))
    tree = policy.draft(state, [], 4)
    for _ in range(3):
        policy.plan([tree], 10)
        policy.observe(state, tree, [])
    assert len(policy.draft(state, [], 4)) == 0


def test_each_verified_sibling_up_to_the_right_one_is_a_guess_of_its_own_strength_seen():
    """The rates are the chance a child is right when the siblings before it were not (what
    merge_candidates reads), so four one-token matches all wrong are four misses, and when the
    second is right the first was a miss, the second a hit, and the two after it say nothing."""
    def learnt(accepted: list[int]) -> tuple[int, float]:
        policy = SpeculationPolicy(Speculate("auto"))
        tree = merge_candidates([Candidate((t,), 1) for t in (5, 6, 7, 8)], policy.first, policy.follow)
        policy.observe(_state(policy, PromptLookup().drafter([1, 2])), tree, accepted)
        return policy.seen[(True, 1)], policy.first[1]

    seen, rate = learnt([])
    assert seen == 4 and rate < 0.07  # four misses
    # (the mean of its prior, 0.1 worth PRIOR_GUESSES[1] = 8 guesses, and a miss and a hit)
    assert learnt([1]) == (2, pytest.approx((8 * 0.1 + 0 + 1) / (8 + 2)))


def test_one_lucky_first_guess_leans_a_branch_estimate_only_part_of_the_way():
    policy = SpeculationPolicy(Speculate("auto"))
    state = _state(policy, PromptLookup().drafter([1, 2, 3, 9, 1]))  # "1" was followed by "2": a one-token match
    tree = policy.draft(state, [], 4)
    assert tree.strength[0] == 1 and tree.probability[0] == pytest.approx(0.1)
    policy.observe(state, tree, [0])
    assert policy.draft(state, [], 4).probability[0] < 0.4  # a prior of 0.1, one hit: not a coin toss


def _steps_verifying(policy, seconds_verifying: float, saved: int, steps: int = 200) -> tuple[int, float]:
    """Run `steps` steps of a lone branch 300 tokens from done whose plan always wants to guess:
    a plain step takes 60 ms, a verifying one `seconds_verifying`, and saves `saved` forwards (its
    estimates never learn otherwise). Returns (verifying steps, the loss in plain steps)."""
    state = _state(policy, PromptLookup().drafter(TIED_DRAFTS))
    verifying = 0
    for _ in range(steps):
        [kept] = policy.plan([policy.draft(state, [], 4)], room=100, remaining=[300])
        if len(kept):
            verifying += 1
            policy.settle([saved])
            policy.observe_verified(1, len(kept), seconds_verifying)
        else:
            policy.observe_plain(1, 0.06)
    return verifying, -policy.balance


def test_auto_guessing_wrong_loses_at_most_a_small_share_of_the_run_whatever_its_estimates_say():
    """Estimates that stay at 90% while every guess fails (a verifying step costing 1.5 plain
    steps): auto still verifies only while what guessing has lost stays within LOSS_SHARE of the
    steps taken, so the run is at most about that much slower than without guesses."""
    from mdcli.speculative.planner import LOSS_SHARE, LOSS_START

    def sure() -> SpeculationPolicy:
        policy = SpeculationPolicy(Speculate("auto"), first={3: 0.9, 2: 0.9, 1: 0.9}, follow={3: 0.9, 2: 0.9, 1: 0.9})
        _time_steps(policy, 1, (0, 1, 2, 3, 4) * 3, 0.06, 0.0, overhead=0.03)
        return policy

    verifying, lost = _steps_verifying(sure(), 0.09, saved=0)
    assert 3 <= verifying <= 20
    assert lost <= LOSS_SHARE * (200 + LOSS_START) + 0.5 + 1e-9  # one step's overshoot at most
    verifying, lost = _steps_verifying(sure(), 0.09, saved=2)
    assert verifying == 200 and lost < 0  # guesses that save forwards go on every step


def test_what_tied_branches_probes_cost_does_not_keep_the_branch_left_alone_from_guessing():
    """Eight tied branches on one CPU core (a guess adds 1/16 of a step): while they are tied, auto
    probes, a first guess each, seven of them right; the run is no shorter (it waits for the
    eighth), and each probe costs half a step. Probes are paced by their own rule (PROBES, then
    PROBE_SHARE), not charged to the loss account: when one of the seven is left alone, 30 tokens
    from done and quoting its document, it guesses as a lone branch does (charged, two probes
    had spent the account and it guessed nothing; the 8-question bench on Zen 3: 41-62 forwards
    with the probes charged, 39-44 without)."""
    from mdcli.speculative.planner import PROBES

    policy = SpeculationPolicy(Speculate("auto"))
    _time_steps(policy, 8, (0,) * 10, 0.08, 0.01)
    states = [_state(policy, PromptLookup().drafter(TIED_DRAFTS)) for _ in range(8)]
    for step in range(30):
        kept = policy.plan([policy.draft(state, [], 8) for state in states], room=200, remaining=[60 - step] * 8)
        guesses = sum(len(tree) for tree in kept)
        if not guesses:
            policy.observe_plain(8, 0.08 + 0.01 * 8)
            continue
        right = [[0] if b and len(tree) else [] for b, tree in enumerate(kept)]  # the eighth is wrong
        for state, tree, path in zip(states, kept, right):
            policy.observe(state, tree, path)
        policy.settle([len(path) for path in right])
        policy.observe_verified(8, guesses, 0.08 + 0.01 * (8 + guesses))
    assert policy.probes >= PROBES

    _time_steps(policy, 1, (0,) * 5, 0.06, 0.001)
    [alone] = policy.plan([policy.draft(states[1], [], 16)], room=100, remaining=[30])
    assert len(alone) >= 4


def test_probes_the_cost_model_cannot_time_still_count_towards_the_first_few():
    """In a forest each probe is a forward of a new width (branches end, the guesses change), and a
    shape's first forward is never timed: after PROBES probes, auto probes at the pace
    PROBE_SHARE allows (at most every PROBE_EVERY steps), not at every step until one is timed."""
    from mdcli.speculative.planner import PROBE_EVERY, PROBES

    policy = SpeculationPolicy(Speculate("auto"), first={3: 0.1, 2: 0.1, 1: 0.1}, follow={3: 0.3, 2: 0.3, 1: 0.3})
    _time_steps(policy, 8, (0,) * 10, 0.08, 0.01)
    states = [_state(policy, PromptLookup().drafter(TIED_DRAFTS)) for _ in range(8)]
    probing = []
    for step in range(40):
        kept = policy.plan([policy.draft(state, [], 8) for state in states], room=200, remaining=[200 - step] * 8)
        if any(len(tree) for tree in kept):
            probing.append(step)  # not timed
        else:
            policy.observe_plain(8, 0.08 + 0.01 * 8)
    assert policy.cost.verifying == 0
    assert probing[:PROBES] == list(range(PROBES))
    assert all(later - before >= PROBE_EVERY for before, later in zip(probing[PROBES - 1 :], probing[PROBES:]))


# -- trees in the engine ---------------------------------------------------------------------------


def test_tree_layout_every_node_attends_exactly_its_ancestors_at_its_depth():
    rows = torch.tensor([[True, True, False], [True, False, True]])  # two places in a 3-slot cache
    layout = layout_trees(rows, [[-1, 0, 0, 1], [-1]], n_cache=3)
    assert layout.positions.tolist() == [2, 3, 3, 4, 2]
    assert layout.parents.tolist() == [1, 3, 3, 4, 2]
    own = layout.allowed[:, 3:].int().tolist()
    assert own == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]]
    assert layout.allowed[:4, :3].tolist() == [[True, True, False]] * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tree_node_gets_the_logits_of_its_path_run_alone(arch):
    model = tiny_model(arch, "sdpa")
    engine = engine_for(model)
    prompt = [5, 17, 3, 99, 42, 8, 8, 21, 7, 300, 11, 12]  # longer than the tiny sliding window
    [first] = engine.extend([engine.forest.empty_row()], [prompt[:-1]])
    tokens = [prompt[-1], 40, 41, 50, 42, 43, 44, 45, 46, 47]
    parents = [-1, 0, 1, 0, 2, 4, 5, 6, 7, 3]
    [result] = engine.forward_trees(first.row[None], [parents], [tokens])
    for node in range(len(tokens)):
        path, walk = [], node
        while walk >= 0:
            path.insert(0, tokens[walk])
            walk = parents[walk]
        with torch.inference_mode():
            alone = model(torch.tensor([prompt[:-1] + path])).logits[0, -1]
        assert torch.allclose(result.logits[node], alone, atol=1e-4), f"node {node}"


@pytest.mark.parametrize("arch", ARCHS)
def test_after_keeping_one_path_the_cache_is_what_feeding_that_path_leaves(arch):
    model = tiny_model(arch, "eager")
    prompt = [5, 17, 3, 99, 42, 8, 8, 21, 7, 300]
    tokens, parents = [11, 40, 41, 50, 42, 43], [-1, 0, 1, 0, 3, 4]
    kept = [0, 3, 4, 5]  # 11 -> 50 -> 42 -> 43

    drafted = engine_for(model)
    [first] = drafted.extend([drafted.forest.empty_row()], [prompt])
    start = len(drafted)
    [result] = drafted.forward_trees(first.row[None], [parents], [tokens])
    keep = torch.tensor(kept)
    drafted.keep_tail(start, keep + start)
    row = torch.cat([result.rows[kept[-1]][:start], result.rows[kept[-1]][start:][keep]])

    plain = engine_for(model)
    [alone] = plain.extend([plain.forest.empty_row()], [prompt + [tokens[i] for i in kept]])
    assert drafted.forest.tokens.tolist() == plain.forest.tokens.tolist()
    assert drafted.forest.depth.tolist() == plain.forest.depth.tolist()
    assert drafted.forest.parent.tolist() == plain.forest.parent.tolist()
    assert drafted.forest.longest_cached_prefix(prompt + [11, 50, 42], 99) == (len(prompt) + 3, start + 2)
    after_drafted = drafted.forward(row[None], [[7]])[0].logits
    after_plain = plain.forward(alone.row[None], [[7]])[0].logits
    assert torch.allclose(after_drafted, after_plain, atol=1e-4)


# -- whole runs: the tokens never change ---------------------------------------------------------


def tiny_specs(lm, *, children: bool) -> list[BranchSpec]:
    document = STORY * 2
    specs = []
    for i, question in enumerate(QUOTING + ["Who?", "Why?"]):
        ids = lm.tokenizer(f"{document}\nQ: {question}\nA:")["input_ids"]
        kids = [BranchSpec(label="more", prompt_ids=lm.tokenizer("\nQ: And then?\nA:")["input_ids"],
                           max_new_tokens=6)] if children and i % 2 == 0 else []
        specs.append(BranchSpec(label=question, prompt_ids=list(ids), max_new_tokens=6 + 4 * i, children=kids))
    return specs


def assert_branches_equal_generate(model, events):
    start = next(e for e in events if isinstance(e, Start))
    prompts = {b.id: b.prompt_token_ids for b in start.branches}
    prompts.update({e.branch.id: e.branch.prompt_token_ids for e in events if e.type == "fork"})
    for finish in (e for e in events if isinstance(e, Finish)):
        assert finish.token_ids == generate_alone(model, prompts[finish.branch], len(finish.token_ids)), finish.label


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral", "gemma3"])
def test_greedy_tokens_are_the_same_with_any_speculation_on_every_architecture(tiny_dir, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True)
    runs = {}
    for setting in ("off", "auto", "32"):
        events = list(run_specs(lm, tiny_specs(lm, children=True), strategy="test", compact_ratio=0.0,
                                speculate=setting))
        runs[setting] = events
    off = finishes(runs["off"])
    assert finishes(runs["auto"]) == off
    assert finishes(runs["32"]) == off
    assert done_stats(runs["32"]).draft_tokens > 0
    assert done_stats(runs["off"]).compactions > 0
    assert_branches_equal_generate(lm.model, runs["32"])


def test_embedded_answers_are_generate_alone_with_fewer_forwards(embedded):
    runs = {s: list(ask_many(embedded, STORY, QUOTING, max_new_tokens=40, speculate=s)) for s in ("off", "auto", "24")}
    off = finishes(runs["off"])
    for setting in ("auto", "24"):
        assert finishes(runs[setting]) == off, setting
        stats = done_stats(runs[setting])
        assert stats.accepted_tokens > 0
        assert stats.steps < done_stats(runs["off"]).steps
        assert stats.generated_tokens == done_stats(runs["off"]).generated_tokens
    assert_branches_equal_generate(embedded.model, runs["24"])


def test_one_token_event_per_accepted_token_in_order(embedded):
    events = list(ask_many(embedded, STORY, QUOTING[:2], max_new_tokens=30, speculate="16"))
    for finish in (e for e in events if isinstance(e, Finish)):
        streamed = [e for e in events if isinstance(e, Token) and e.branch == finish.branch]
        assert [e.token_id for e in streamed] == finish.token_ids
        assert "".join(e.text for e in streamed) == finish.text
        assert math.isclose(sum(e.logprob for e in streamed), finish.cumulative_logprob, abs_tol=1e-3)


def test_seeded_sampling_draws_the_same_tokens_with_drafts(embedded):
    sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    runs = {s: list(ask_many(embedded, STORY, QUOTING, sampling=sampling, max_new_tokens=32, speculate=s))
            for s in ("off", "16")}
    assert finishes(runs["16"]) == finishes(runs["off"])
    assert done_stats(runs["16"]).accepted_tokens > 0


def test_the_cache_ends_holding_only_accepted_tokens(embedded):
    def final_forest(setting):
        engine = Engine(embedded.forward)
        decoder = Decoder(engine, embedded.tokenizer, embedded.eos_token_ids, compact_ratio=math.inf,
                          speculate=setting)
        specs = [BranchSpec(label=q, prompt_ids=embedded.tokenizer(STORY + q)["input_ids"], max_new_tokens=24)
                 for q in QUOTING[:2]]
        decoder.announce(specs)
        list(decoder.decode())
        return sorted(zip(engine.forest.depth.tolist(), engine.forest.tokens.tolist()))

    assert final_forest("16") == final_forest("off")


def test_think_and_margins_give_the_same_text_with_speculation(embedded):
    from mdcli.api import margins, think

    for run in (
        lambda s: think(embedded, "What is 12 + 30? Answer: ", paths=2, max_new_tokens=16, conclusion_tokens=12,
                        path_instructions=["Be brief.", "Show steps."], speculate=s),
        lambda s: margins(embedded, STORY, "Who rang the bell?", max_new_tokens=16, classify_tokens=6,
                          answer_tokens=12, speculate=s),
    ):
        assert finishes(list(run("8"))) == finishes(list(run("off")))


# -- settings from the command line and recipes -----------------------------------------------------


def test_a_recipe_can_set_speculate_and_a_bad_value_names_the_field():
    from mdcli.errors import RecipeError
    from mdcli.recipes import load_recipe_text

    base = "version: 1\nstrategy: ask-many\nquestions: [Who]\ncontext: {text: hi}\n"
    assert load_recipe_text(base + "speculate: 4\n").speculate == 4
    assert load_recipe_text(base + "speculate: 'off'\n").speculate == "off"
    for word, meaning in (("off", "off"), ("no", "off"), ("false", "off"), ("on", "auto"), ("yes", "auto")):
        # YAML 1.1 reads these unquoted words as booleans; they still mean what they say
        assert load_recipe_text(base + f"speculate: {word}\n").speculate == meaning, word
    assert load_recipe_text(base + "speculate: 0\n").speculation(None).mode == "off"
    with pytest.raises(RecipeError, match="speculate"):
        load_recipe_text(base + "speculate: sometimes\n")


def test_a_beam_recipe_that_asks_to_speculate_is_refused(embedded):
    from mdcli.errors import RecipeError
    from mdcli.recipes import load_recipe_text, recipe_events

    recipe = load_recipe_text("version: 1\nstrategy: beam\nprompt: Hello\nspeculate: 4\n")
    with pytest.raises(RecipeError, match="beam search does not speculate"):
        recipe_events(recipe, embedded)


def test_the_command_line_refuses_a_bad_speculate_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from mdcli.cli.app import app

    document = tmp_path / "doc.txt"
    document.write_text(STORY)
    result = CliRunner().invoke(app, ["ask-many", str(document), "-q", "Who?", "--speculate", "lots"])
    assert result.exit_code == 2
    assert "--speculate takes auto, off or a number of draft tokens, not 'lots'" in result.stderr


def test_the_summary_line_counts_steps_and_accepted_drafts():
    from mdcli.events import Stats
    from mdcli.render.base import BranchBook, summary_line

    stats = Stats(prompt_tokens=10, prefill_tokens=10, generated_tokens=412, steps=37, seconds=5.2,
                  prefill_seconds=0.2, decode_seconds=5.0, peak_cache_tokens=1912, final_cache_tokens=1900,
                  compactions=0, draft_tokens=400, accepted_tokens=252, forwards=38)
    assert "412 tokens in 37 steps (63% of drafts accepted)" in summary_line(BranchBook(), stats)
    plain = Stats(**{**{f: getattr(stats, f) for f in stats.__slots__}, "draft_tokens": 0})
    assert "412 tokens in 37 steps" in summary_line(BranchBook(), plain)
