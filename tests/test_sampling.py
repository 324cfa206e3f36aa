"""Sampling: the filters keep what they promise, and each branch's stream is its own."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdcli.sampling import Sampler, SamplingParams, branch_seed, filtered_logits, outside_nucleus


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


def test_greedy_is_the_argmax():
    assert Sampler(SamplingParams(), key=0)(torch.tensor([0.1, 3.0, 2.0])) == 1


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
