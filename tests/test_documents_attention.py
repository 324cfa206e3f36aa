"""Several documents' trees in one forest (mdcli.backends.attention.documents): each document's
queries read only the slots they see, on mdcli's kernel, and get the dense attention and generate's
tokens."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention import fused
from mdcli.backends.attention.documents import MAX_GROUPS, documents_plan
from tests.reference import generate_alone
from tests.test_engine_exactness import greedy_forest, random_prompts
from tests.test_fused_attention import LOWEST, cache_views, engine_on_kernel, needs_kernel, torch_attention
from tests.test_sparse_attention import SUPPORTED, model_for


def forest_of_documents(documents: list[int], branches: int, written: int) -> torch.Tensor:
    """[M, N] bool: documents laid down one after another, `branches` branches off each, their
    `written` tokens each interleaved after all of them (as a forest's steps append them); one query
    per branch, its last token."""
    n = sum(documents) + len(documents) * branches * written
    allowed = torch.zeros(len(documents) * branches, n, dtype=torch.bool)
    start = 0
    for d, length in enumerate(documents):
        for b in range(branches):
            row = d * branches + b
            allowed[row, start:start + length] = True
            for step in range(written):  # slot of branch `row`'s token at `step`: steps interleave every branch's
                allowed[row, sum(documents) + step * allowed.shape[0] + row] = True
        start += length
    return allowed


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, LOWEST)[None, None]


@needs_kernel
@pytest.mark.parametrize("heads, groups", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("queries", [1, 2, 5, 17])
def test_the_kernel_reading_chosen_slots_gives_the_attention_over_those_slots_alone(heads, groups, queries):
    g = torch.Generator().manual_seed(queries)
    n, dim = 300, 64
    keys, values = cache_views(groups, n, dim, g)
    slots = torch.randperm(n, generator=g)[:97].sort().values  # [S] ascending
    query = torch.randn(1, heads, queries, dim, generator=g)
    allowed = torch.rand(queries, slots.shape[0], generator=g) < 0.8
    allowed[:, -1] = True
    mask = additive(allowed)  # [1, 1, M, S]
    ours = fused.fused_attention(query, keys, values, fused.step_mask(mask, heads // groups), 0.125, groups, slots=slots)
    theirs = torch_attention(query, keys[:, :, slots], values[:, :, slots], mask, 0.125)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads, groups", [(9, 3), (4, 2)])
def test_a_forest_of_several_documents_is_split_by_document_and_gives_the_dense_attention(heads, groups):
    allowed = forest_of_documents([120, 75, 200], branches=3, written=4)
    m, n = allowed.shape
    plan = documents_plan(additive(allowed), heads // groups)
    assert plan is not None and len(plan.groups) == 3, "one group a document"
    assert all(int(group.slots.shape[0]) < n // 2 for group in plan.groups), "each reads its document, not the others"
    g = torch.Generator().manual_seed(1)
    keys, values = cache_views(groups, n, 64, g)
    query = torch.randn(1, heads, m, 64, generator=g)
    ours = plan.attend("bmm", False, "full_attention", query, keys, values, 0.125)
    assert torch.allclose(ours, torch_attention(query, keys, values, additive(allowed), 0.125), rtol=1e-4, atol=1e-5)


def test_a_forest_over_one_document_stays_dense():
    """ask-many's forest: every query starts at slot 0, nothing to split."""
    allowed = forest_of_documents([300], branches=8, written=5)
    assert documents_plan(additive(allowed), 3) is None


def test_more_documents_than_calls_pay_for_stay_dense():
    allowed = forest_of_documents([40] * (MAX_GROUPS + 1), branches=1, written=2)
    assert documents_plan(additive(allowed), 3) is None
    assert documents_plan(additive(forest_of_documents([40] * MAX_GROUPS, branches=1, written=2)), 3) is not None


@needs_kernel
@pytest.mark.parametrize("arch", SUPPORTED)
def test_branches_off_several_documents_in_one_forest_get_the_tokens_generate_gives_each_alone(arch):
    model = model_for(arch)
    engine = engine_on_kernel(model)
    prompts = [p for seed, n in ((3, 60), (4, 90), (5, 45)) for p in random_prompts(n, [3, 5], seed=seed)]
    generated = greedy_forest(engine, prompts, steps=10, drop_at=4)
    split = engine.model_forward.own.document_forwards
    if engine.mixed_layer_types or engine.sliding_window:  # a mask per layer type, or a window: as before
        assert split == 0
    else:
        assert split >= 6, "the steps read each document's slots alone"
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"
