"""Cascade attention (mdcli.backends.attention.prefix) on random tensors is the dense attention.

Every query of a bucket is scored against the bucket's prefix in one product, unmasked, and
against its rest in another, masked; the two softmax parts are merged by their log-sum-exp (or,
where the rest runs on from the prefix, are one product with the mask on the rest's columns only).
On random queries, keys and values (query heads per key/value head 1 and 3, the keys a view of a
longer cache buffer as the engine's are), masks as the engine lays them out (ask-many's shared
document, margins' depths, a sliding window on some layer types cutting into the document), the
output equals the dense attention's to float32 rounding, and a row that sees nothing gives no NaN.
"""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention import prefix
from mdcli.backends.attention.prefix import PrefixPlan, bucket_prefixes, merge, partial
from mdcli.backends.attention.sparse import plan_for
from mdcli.backends.llama import _grouped_attention
from mdcli.bench.attention import margins_step, shared_document

LOWEST = torch.finfo(torch.float32).min
DIM = 16


def additive(allowed: torch.Tensor, fill: float = LOWEST) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, fill)[None, None]


def windowed(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """The same rows, each seeing only the last `window` of the slots it saw."""
    seen = allowed.to(torch.int32).flip(1).cumsum(1).flip(1)  # [M, N]: visible slots from here on
    return allowed & (seen <= window)


def dense(query, keys, values, additive_mask, groups: int):
    rows = additive_mask[0, 0].repeat(query.shape[1] // groups, 1)
    return _grouped_attention(query, keys, values, rows, DIM ** -0.5, groups)


def operands(m: int, n: int, heads: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, m, DIM, generator=g)
    keys = torch.randn(1, groups, n + 40, DIM, generator=g)[:, :, :n]  # a view of a longer buffer
    values = torch.randn(1, groups, n + 40, DIM, generator=g)[:, :, :n]
    return query, keys, values


def cascade(mask, query, keys, values, kind="full_attention"):
    plan = plan_for(mask, mode="prefix")
    assert isinstance(plan, PrefixPlan)
    return plan, plan.attend("bmm", False, kind, query, keys, values, DIM ** -0.5)


def close(a, b) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))


SCENES = {
    "ask-many, 8 branches": lambda: shared_document(8, document=300, question=9, written=6).allowed,
    "ask-many, 3 branches, long answers": lambda: shared_document(3, document=120, question=5, written=60).allowed,
    "margins, 2 questions x 4 segments": lambda: margins_step(2, 4, document=400, suffix=12, written=5).allowed,
}


@pytest.mark.parametrize("per_group", [1, 3], ids=["mha", "gqa-3"])
@pytest.mark.parametrize("scene", list(SCENES))
def test_cascade_equals_dense_attention(scene, per_group):
    allowed = SCENES[scene]()
    m, n = allowed.shape
    groups = 2
    query, keys, values = operands(m, n, groups * per_group, groups)
    mask = additive(allowed)
    plan, out = cascade(mask, query, keys, values)
    assert close(out, dense(query, keys, values, mask, groups))
    if scene.startswith("ask-many"):
        assert len(plan.buckets) == 1 and plan.whole, "every query reads the document in one product"


@pytest.mark.parametrize("per_group", [1, 3], ids=["mha", "gqa-3"])
def test_a_window_cutting_into_the_document_shortens_the_prefix_for_every_layer_type(per_group):
    allowed = shared_document(6, document=200, question=7, written=10).allowed
    m, n = allowed.shape
    masks = {"full_attention": additive(allowed), "sliding_attention": additive(windowed(allowed, 64))}
    query, keys, values = operands(m, n, 2 * per_group, 2, seed=1)
    plan = plan_for(masks, mode="prefix")
    assert isinstance(plan, PrefixPlan)
    assert max(b.prefix for b in plan.buckets) <= n - 64, "no query sees the document's start through the window"
    for kind, mask in masks.items():
        out = plan.attend("bmm", False, kind, query, keys, values, DIM ** -0.5)
        assert close(out, dense(query, keys, values, mask, 2)), kind


def test_the_branch_whose_question_follows_the_document_reads_it_with_the_others():
    allowed = shared_document(8, document=300, question=9, written=2).allowed
    prefixes, bucket_of_row = bucket_prefixes(allowed)
    assert prefixes.tolist() == [300] and bucket_of_row.tolist() == [0] * 8
    # margins' depths of a 4,000-token document stay buckets of their own: 500 slots more for 4
    # queries cost more than reading the prefix again
    depths = margins_step(4, 8).allowed
    assert bucket_prefixes(depths)[0].tolist() == [500 * (i + 1) for i in range(8)]


@pytest.mark.parametrize("fill", [LOWEST, float("-inf")], ids=["dtype-min", "-inf"])
def test_a_row_that_sees_nothing_gives_no_nan_and_leaves_the_others_exact(fill):
    allowed = shared_document(4, document=50, question=4, written=3).allowed
    allowed[2, 50:] = False  # row 2 sees only the document
    blind = allowed.clone()
    blind[3] = False  # row 3 sees nothing at all
    query, keys, values = operands(4, allowed.shape[1], 3, 1, seed=2)
    _, out = cascade(additive(blind, fill), query, keys, values)
    assert not out.isnan().any()
    expected = dense(query, keys, values, additive(allowed), 1)
    seeing = out.view(4, 3, DIM)[:3]
    assert close(seeing, expected.view(4, 3, DIM)[:3])


def test_the_log_sum_exp_merge_of_two_parts_is_the_softmax_over_both():
    g = torch.Generator().manual_seed(3)
    stacked, keys, values = (torch.randn(2, 5, DIM, generator=g), torch.randn(2, 30, DIM, generator=g),
                             torch.randn(2, 30, DIM, generator=g))
    rows = torch.zeros(5, 12).masked_fill_(torch.rand(5, 12, generator=g) < 0.5, LOWEST)
    whole_mask = torch.cat([torch.zeros(5, 18), rows], dim=1)
    expected = torch.softmax(stacked @ keys.transpose(1, 2) + whole_mask, dim=-1) @ values
    first = partial(stacked, keys[:, :18], values[:, :18], None)
    second = partial(stacked, keys[:, 18:], values[:, 18:], rows)
    assert close(merge(first, second), expected)


def test_the_parts_off_the_fused_kernel_are_the_same(monkeypatch):
    """Where torch's fused CPU kernel does not apply (another device, another dtype), two batched
    products and a softmax compute the same part."""
    g = torch.Generator().manual_seed(4)
    stacked, keys, values = (torch.randn(2, 5, DIM, generator=g), torch.randn(2, 30, DIM, generator=g),
                             torch.randn(2, 30, DIM, generator=g))
    rows = torch.zeros(5, 30).masked_fill_(torch.rand(5, 30, generator=g) < 0.5, LOWEST)
    fused = partial(stacked, keys, values, rows)
    monkeypatch.setattr(prefix, "FLASH", None)
    plain = partial(stacked, keys, values, rows, {})
    assert close(fused[0], plain[0]) and close(fused[1], plain[1])
