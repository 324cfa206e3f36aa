"""Attention over each query's visible prefix read in place (mdcli.backends.attention.prefix) is the dense attention.

Margins' chain layout hangs branches off different depths of one long document. The radix prefill
feeds such a document alone (its short side edges wait), so it lies in one run of slots and each
branch sees a prefix of it: the forward then attends bucket by bucket, each bucket's prefix read
in place and its few other slots gathered. On the tiny models of every architecture mdcli's
forward supports (sliding windows included) and on both attention cores, every step's logits
equal the dense path's and each branch's alone, and the greedy tokens equal `generate`. Which plan
the rule picks on the forests the constants were fitted to is stated too.
"""

from __future__ import annotations

import pytest
import torch

from mdcli.backends import llama
from mdcli.backends.attention.prefix import PrefixPlan, visible_prefix
from mdcli.backends.attention.sparse import GATHER_COST, GATHER_COST_AVX512, SparsePlan, plan_for
from mdcli.bench.attention import margins_step, separate_prompts, shared_document
from mdcli.core.decoding import prefill_prompts
from tests.test_engine_exactness import VOCAB
from tests.test_sparse_attention import (
    SUPPORTED,
    by_rule_equals_dense_and_generate,
    decode,
    model_for,
    own_engine,
    own_forward,
    planned_equals_dense_and_alone,
    wide_forest,
)

WINDOWED = {"mistral", "qwen2-mixed"}  # a window on every layer, or on some
DEPTHS = [(70, 3), (70, 8), (140, 1), (140, 5), (140, 9), (210, 2), (210, 6)]


def chain_forest() -> list[list[int]]:
    """A 210-token document and branches reading 70, 140 or all of it, each with its own tail."""
    g = torch.Generator().manual_seed(11)
    document = torch.randint(2, VOCAB, (210,), generator=g).tolist()
    return [document[:depth] + torch.randint(2, VOCAB, (tail,), generator=g).tolist() for depth, tail in DEPTHS]


def ask_many_forest() -> list[list[int]]:
    """ask-many: eight questions of 3-9 tokens after one 150-token document."""
    g = torch.Generator().manual_seed(12)
    document = torch.randint(2, VOCAB, (150,), generator=g).tolist()
    return [document + torch.randint(2, VOCAB, (3 + i % 7,), generator=g).tolist() for i in range(8)]


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]


def test_the_prefill_lays_a_document_read_to_different_depths_in_one_run_of_slots():
    model = model_for("llama")
    engine = own_engine(model, "bmm")
    prompts = chain_forest()
    rows = torch.stack([r.row for r in prefill_prompts(engine, prompts)])  # [C, N]
    assert engine.forest.tokens[:210].tolist() == prompts[-1][:210], "the document comes first, in order"
    seen = visible_prefix(rows)
    for (depth, tail), row, prefix in zip(DEPTHS, rows, seen.tolist()):
        assert prefix == depth, "each branch sees the document's first `depth` slots without a gap"
        assert int(row.sum()) == depth + tail, "and its own tail, nothing else"


@pytest.mark.parametrize("forest", [chain_forest, wide_forest, ask_many_forest],
                         ids=["one-document", "unrelated-roots", "ask-many"])
@pytest.mark.parametrize("attention", ["bmm", "sdpa"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_branches_off_one_document_give_the_dense_logits_each_alone_and_generate_tokens(arch, attention, forest):
    """Every forward of 2+ queries takes the prefix plan (=prefix): the tails' prefill and every
    step. Unrelated roots make buckets whose prefix is empty (their rows see nothing at slot 0)."""
    forward = planned_equals_dense_and_alone(model_for(arch), forest(), "prefix", attention)
    assert forward.prefix_forwards >= 8, "the prefill's masked forwards and the steps take the prefix plan"


def test_the_real_model_takes_the_prefix_plan_by_the_rule_and_matches_generate(embedded_float32):
    prompts = [p for p in chain_forest() for _ in range(3)]  # three questions per depth: 21 branches
    prompts = [p + [7 + i % 3] for i, p in enumerate(prompts)]
    forward = by_rule_equals_dense_and_generate(embedded_float32.model, prompts, 3)
    assert forward.prefix_forwards >= 1


def test_many_questions_over_one_document_take_the_cascade_by_the_rule_and_match_generate():
    """ask-many with 24 branches: every decode step is one bucket, prefix and rest one product."""
    g = torch.Generator().manual_seed(13)
    document = torch.randint(2, VOCAB, (120,), generator=g).tolist()
    prompts = [document + torch.randint(2, VOCAB, (2 + i % 5,), generator=g).tolist() for i in range(24)]
    forward = by_rule_equals_dense_and_generate(model_for("llama"), prompts, 5)
    assert forward.prefix_forwards >= 4, "the decode steps take the prefix plan"


def _picked(allowed: torch.Tensor, gather_cost: float = GATHER_COST_AVX512) -> str:
    plan = plan_for(additive(allowed), gather_cost)
    return "dense" if plan is None else {PrefixPlan: "prefix", SparsePlan: "gathered"}[type(plan)]


def test_the_rule_reads_prefixes_in_place_for_many_questions_margins_and_stays_dense_otherwise():
    # `python -m mdcli.bench.attention` on Zen 4: prefix 5.0 / dense 8.4 ms (4 x 8), 8.9 / 23.4 (8 x 8)
    assert _picked(margins_step(4, 8).allowed) == "prefix"
    assert _picked(margins_step(8, 8).allowed) == "prefix"
    # one question: eight buckets of one query each read the document 4.5 times (2.3 / 2.2 ms)
    assert _picked(margins_step(1, 8).allowed) == "dense"
    # ask-many: every branch sees the whole document, one bucket, prefix and rest one product (the
    # mask on the rest only): no gain with 8 or 16 branches (whole steps on Zen 3: 1.01-1.06x and
    # 0.88-1.10x dense), from 24 a large one (0.51-0.8x by the median)
    for gather_cost in (GATHER_COST, GATHER_COST_AVX512):
        assert _picked(shared_document(8).allowed, gather_cost) == "dense"
        assert _picked(shared_document(8, 1800, 25, 1).allowed, gather_cost) == "dense"
        assert _picked(shared_document(16).allowed, gather_cost) == "dense"
        assert _picked(shared_document(24).allowed, gather_cost) == "prefix"
        assert _picked(shared_document(32).allowed, gather_cost) == "prefix"
    # unrelated prompts: each sees ~1/30 of the cache, gathered (2.2 / 13.9 ms)
    assert _picked(separate_prompts(32).allowed) == "gathered"


def test_a_forest_with_more_distinct_prefixes_than_buckets_allowed_is_not_planned_by_prefix():
    allowed = torch.zeros(40, 100, dtype=torch.bool)
    for row in range(40):
        allowed[row, : row + 1] = True  # 40 distinct prefixes
    assert plan_for(additive(allowed), mode="prefix") is None
    assert isinstance(plan_for(additive(allowed[:32]), mode="prefix"), PrefixPlan)


@pytest.mark.parametrize("mode", ["off", "prefix"], ids=["dense", "prefix-plan"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_reading_the_cache_ahead_changes_no_logit_and_reads_only_what_the_plan_attends_in_place(arch, mode,
                                                                                                 monkeypatch):
    """mdcli.backends.attention.gemm.read_ahead only reads: the same forest decoded with and without it
    gives the same logits bit for bit. Dense attention reads the whole cache ahead, the prefix plan
    its longest prefix (the 210-token document), and only forwards of several queries read ahead."""
    model = model_for(arch)
    reaches: list[int] = []
    real = llama.read_ahead

    def counted(keys, values):  # the real read, and how many slots it covered
        reaches.append(keys.shape[1])
        real(keys, values)

    monkeypatch.setattr(llama, "read_ahead", counted)
    runs = []
    for ahead in (False, True):
        engine = own_engine(model, "bmm", mode)
        own_forward(engine).read_ahead = ahead
        runs.append((decode(engine, chain_forest(), steps=4), len(engine)))
    ((plain_logits, plain_tokens), _), ((ahead_logits, ahead_tokens), cache_length) = runs
    assert ahead_tokens == plain_tokens
    assert all(torch.equal(a, b) for a, b in zip(plain_logits, ahead_logits))
    assert len(reaches) % model.config.num_hidden_layers == 0, "a forward reads ahead in every layer or none"
    if mode == "prefix" and arch in WINDOWED:
        assert reaches == [], "under a window no slot is in every query's prefix: nothing is read in place"
    elif mode == "prefix":
        assert set(reaches) == {210}, "the longest prefix read in place: the document"
    else:
        assert max(reaches) == cache_length, "the last step reads its whole cache"


def test_a_lone_query_does_not_read_ahead(monkeypatch):
    """A lone token's weighted sum runs on OpenBLAS where this pays, which reads well cold."""
    model = model_for("llama")
    engine = own_engine(model, "bmm")
    own_forward(engine).read_ahead = True
    reads = []
    monkeypatch.setattr(llama, "read_ahead", lambda *views: reads.append(views))
    decode(engine, [chain_forest()[0]], steps=3)
    assert reads == [] and engine.forwards >= 3
