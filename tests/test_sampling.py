"""Sampling: the filters keep what they promise, and each branch's stream is its own."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mdcli.core.sampling import (
    Sampler,
    SamplingParams,
    branch_seed,
    choose_next,
    draw,
    filtered_logits,
    greedy_tokens,
    outside_nucleus,
)


def nucleus_by_full_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook rule: sort everything, drop a token once the mass before it reaches top_p."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = sorted_scores.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    return torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)


@given(st.integers(0, 10_000), st.floats(0.05, 0.999), st.floats(0.1, 8.0), st.sampled_from([50, 300, 5000]))
@settings(max_examples=200, deadline=None)
def test_the_fast_nucleus_equals_the_full_sort(seed, top_p, spread, vocab):
    scores = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread
    # a token whose mass before it is top_p to float32 rounding is in or out by the order the
    # probabilities were summed in (a softmax over another order rounds differently; seen on an
    # AVX2 host at top_p 0.999): such ties are no property of the rule, so they are not drawn
    probs = scores.double().softmax(-1).sort(descending=True).values
    mass_before = probs.cumsum(-1) - probs  # [V]: what each token's predecessors hold
    assume(bool((mass_before - top_p).abs().min() > 1e-5))
    assert torch.equal(outside_nucleus(scores, top_p, candidates=64), nucleus_by_full_sort(scores, top_p))


def test_the_most_likely_token_always_survives_top_p():
    scores = torch.tensor([5.0, 1.0, 0.5, 0.1])
    assert not outside_nucleus(scores, 0.01)[0]
    assert outside_nucleus(scores, 0.01)[1:].all()


def test_top_k_keeps_exactly_k_tokens_without_ties():
    scores = torch.arange(10, dtype=torch.float32)
    kept = torch.isfinite(filtered_logits(scores, SamplingParams(temperature=1.0, top_k=3)))
    assert kept.tolist() == [False] * 7 + [True] * 3


def test_min_p_drops_tokens_far_below_the_best():
    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filtered_logits(scores, SamplingParams(temperature=1.0, min_p=0.2)))
    assert kept.tolist() == [True, True, True, False]


def test_the_one_token_choice_suppresses_eos_where_ignored_and_gives_the_logprob_it_chose_under():
    eos = 1
    logits = torch.tensor([[0.5, 3.0, 2.0, 0.0], [0.5, 3.0, 2.0, 0.0]])  # EOS the likeliest in both rows
    tokens, logprobs = choose_next(logits.clone(), [Sampler(SamplingParams(), key=k) for k in (0, 1)],
                                   ignore_eos=[True, False], eos={eos})
    assert tokens == [2, eos]  # the row that ignores EOS takes the next best, as min_new_tokens does
    without_eos = torch.tensor([0.5, float("-inf"), 2.0, 0.0]).log_softmax(-1)
    assert logprobs == [without_eos[2].item(), logits[1].log_softmax(-1)[eos].item()]


def test_greedy_is_the_argmax():
    assert Sampler(SamplingParams(), key=0)(torch.tensor([0.1, 3.0, 2.0])) == 1


@given(st.integers(0, 10_000), st.integers(1, 9), st.sampled_from([3, 50, 5000]))
@settings(max_examples=100, deadline=None)
def test_the_batched_greedy_choice_is_torchs_argmax_ties_to_the_first(seed, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).round()  # many ties
    logits[0] = float("-inf")  # a row masked everywhere still names a token, the first
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()


@given(st.integers(0, 10_000), st.floats(0.1, 8.0), st.sampled_from([5, 300, 5000]))
@settings(max_examples=100, deadline=None)
def test_a_draw_is_torchs_multinomial_draw_from_the_same_generator(seed, spread, vocab):
    probs = (torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread).softmax(-1)
    probs[seed % vocab] = 0.0  # a filtered-out token is never drawn
    ours, torchs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    draws = [draw(probs, ours) for _ in range(4)]  # the generators stay in step draw after draw
    assert draws == [int(torch.multinomial(probs, 1, generator=torchs)) for _ in range(4)]


def test_a_branch_stream_depends_only_on_seed_and_branch_key():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.zeros(1000)
    first = [Sampler(params, key=3)(logits) for _ in range(1)]
    again = Sampler(params, key=3)
    other = Sampler(params, key=4)
    draws = [again(logits) for _ in range(20)]
    assert draws[0] == first[0]
    assert draws != [other(logits) for _ in range(20)]
    assert branch_seed(11, 3) != branch_seed(11, 4) and branch_seed(None, 3) == branch_seed(0, 3)


def test_settings_out_of_range_are_one_plain_line_naming_the_bound():
    """Built in Python (the subcommands' flags), a bad setting is a ValueError the CLI shows as is."""
    import pytest

    for settings_, words in [({"temperature": -1.0}, "temperature must be >= 0 (0 means greedy)"),
                             ({"top_p": 0.0}, "top-p must be in (0, 1]"), ({"top_k": -2}, "top-k must be >= 0"),
                             ({"min_p": 1.0}, "min-p must be in [0, 1)")]:
        with pytest.raises(ValueError) as raised:
            SamplingParams(**settings_)
        assert str(raised.value).startswith(words) and "\n" not in str(raised.value)


def test_a_recipe_sampling_layer_states_only_what_it_changes_and_inherits_the_rest():
    """recipe -> branch -> child: unset fields come from the layer around; the sampler gets SamplingParams."""
    from mdcli.recipes import Sampling

    recipe = Sampling(temperature=0.7, seed=3, max_new_tokens=40)
    branch = recipe.then(Sampling(temperature=0.0))
    child = branch.then(Sampling(top_k=5))
    assert child.params() == SamplingParams(temperature=0.0, seed=3, top_k=5)
    assert (child.new_tokens(), Sampling().new_tokens(), Sampling().params()) == (40, 256, SamplingParams())
    assert Sampling(top_k=5).temperature is None  # unset, not the default: a layer says only what it sets
