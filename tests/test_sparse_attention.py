"""Attention over each query's visible slots only (mdcli.backends.attention.sparse) is the dense attention.

A wide forest of unrelated branches (several roots, several chains each, mixed lengths) is where
mdcli's forward gathers each chain's slots instead of attending over the whole cache. On the tiny
models of every architecture mdcli's forward supports (Mistral's with a sliding window) and on
both attention cores, every step's logits equal the dense path's and each branch's alone, and the
greedy tokens equal `generate`. Which path runs is a rule on shapes, stated here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mdcli.backends.attention.sparse import (
    GATHER_COST,
    GATHER_COST_AVX512,
    group_starts,
    plan_for,
    sparse_wanted,
)
from mdcli.backends.llama import FastForward
from mdcli.backends.select import Host, select
from mdcli.core.decoding import prefill_prompts
from mdcli.core.forest import layout_chains, pad_rows
from tests.reference import generate_alone
from tests.test_engine_exactness import (
    alone_logits,
    engine_for,
    random_prompts,
    settings_with,
    tiny_model,
)

# the architectures mdcli's forward takes (mistral: window 6 on every layer; qwen2-mixed: a full
# layer and two with window 6, so the forward gets one mask per layer type)
SUPPORTED = ["llama", "qwen2", "mistral", "qwen2-mixed"]


def model_for(arch: str):
    if arch != "qwen2-mixed":
        return tiny_model(arch, "sdpa")
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            use_sliding_window=True, sliding_window=6, max_window_layers=1,
                            eos_token_id=None, pad_token_id=0, bos_token_id=1)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def wide_forest() -> list[list[int]]:
    """Twelve unrelated roots of 5-30 tokens with 1-4 chains of 1-13 tokens hanging off each."""
    shapes = [(30, [3, 13]), (9, [1, 6, 2, 11]), (22, [7]), (14, [4, 4, 9]), (26, [12, 2]), (5, [2, 8]),
              (17, [1]), (11, [6, 3, 5]), (24, [10]), (8, [2, 2]), (19, [13, 1, 4]), (12, [5])]
    return [p for seed, (root, tails) in enumerate(shapes) for p in random_prompts(root, tails, seed=seed + 5)]


def decode(engine, prompts, steps: int):
    """Greedy decode of every prompt together; returns per-step logits [C, V] and the tokens."""
    out = prefill_prompts(engine, prompts)
    rows, logits = [o.row for o in out], torch.stack([o.logits for o in out])
    history, generated = [logits], [[] for _ in prompts]
    for _ in range(steps - 1):
        tokens = logits.argmax(-1).tolist()
        for g, t in zip(generated, tokens):
            g.append(t)
        stacked = torch.stack([pad_rows(r[None], len(engine))[0] for r in rows])
        out = engine.forward(stacked, [[t] for t in tokens])
        rows, logits = [o.row for o in out], torch.stack([o.logits for o in out])
        history.append(logits)
    for g, t in zip(generated, logits.argmax(-1).tolist()):
        g.append(t)
    return history, generated


def own_engine(model, attention: str, mode: str = "auto", **options):
    """An engine on mdcli's own forward with attention core `attention` ("bmm" or "sdpa") and
    MDCLI_SPARSE_ATTENTION=mode in its plan."""
    engine = engine_for(model, settings=settings_with(sparse_attention=mode), **options)
    assert engine.model_forward.plan.sparse_attention == mode
    engine.model_forward.own = FastForward(model, replace(engine.model_forward.plan, attention=attention, bmm_max_queries=None,
                                                          fused_attention=False, packed=False))
    return engine


def own_forward(engine) -> FastForward:
    return engine.model_forward.own


def planned_equals_dense_and_alone(model, prompts, mode: str, attention: str, steps: int = 8):
    """Decode with MDCLI_SPARSE_ATTENTION=mode, then dense: the same tokens, every step's logits within
    1e-4 of the dense path's, the last step's within 1e-4 of each branch alone, and each branch's
    tokens those of `generate`. Returns the planned engine's forward (to ask which plans it took)."""
    planned = own_engine(model, attention, mode)
    planned_logits, planned_tokens = decode(planned, prompts, steps=steps)
    dense = own_engine(model, attention, "off")
    dense_logits, dense_tokens = decode(dense, prompts, steps=steps)
    assert own_forward(dense).sparse_forwards == 0
    assert planned_tokens == dense_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(planned_logits, dense_logits))
    assert worst < 1e-4, f"max logit difference to the dense path {worst:.2e}"
    for i, prompt in enumerate(prompts):
        alone = alone_logits(model, prompt + planned_tokens[i][:-1])
        assert float((alone - planned_logits[-1][i]).abs().max()) < 1e-4, f"branch {i} alone"
        assert planned_tokens[i] == generate_alone(model, prompt, steps), f"branch {i}"
    return own_forward(planned)


@pytest.mark.parametrize("attention", ["bmm", "sdpa"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_a_wide_forest_gives_the_dense_logits_each_branchs_alone_and_generate_tokens(arch, attention):
    """Every forward gathers (=always): the prefill's and every decode step's."""
    forward = planned_equals_dense_and_alone(model_for(arch), wide_forest(), "always", attention)
    assert forward.sparse_forwards >= 8, "the wide forest's prefill and steps take the sparse path"


@pytest.mark.parametrize("arch", SUPPORTED)
def test_a_wide_forest_fed_in_small_forwards_stays_exact(arch):
    """Chains cut across forwards (max_forward_tokens 16): groups see earlier pieces in the cache."""
    model = model_for(arch)
    prompts = wide_forest()
    engine = own_engine(model, "bmm", "always", max_forward_tokens=16)
    _, tokens = decode(engine, prompts, steps=6)
    assert own_forward(engine).sparse_forwards > 0
    for i, prompt in enumerate(prompts):
        assert tokens[i] == generate_alone(model, prompt, 6), f"branch {i}"


def by_rule_equals_dense_and_generate(model, prompts, steps: int):
    """Decode by the rule (auto), then dense: the same tokens, every step's logits within 1e-3 of
    the dense path's, each branch's tokens those of `generate`. Returns the rule's forward (to ask
    which plans it took)."""
    ruled = own_engine(model, "bmm", "auto")
    ruled_logits, ruled_tokens = decode(ruled, prompts, steps=steps)
    dense = own_engine(model, "bmm", "off")
    dense_logits, dense_tokens = decode(dense, prompts, steps=steps)
    assert own_forward(dense).sparse_forwards == 0
    assert ruled_tokens == dense_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(ruled_logits, dense_logits))
    assert worst < 1e-3, f"max logit difference to the dense path {worst:.2e}"
    for i, prompt in enumerate(prompts):
        assert ruled_tokens[i] == generate_alone(model, prompt, steps), f"branch {i}"
    return own_forward(ruled)


def test_the_real_model_on_a_wide_forest_matches_the_dense_path_and_generate(embedded_float32):
    """By the rule (auto): the prefill of twelve unrelated roots gathers, the decode steps too
    where each branch sees little of the cache."""
    forward = by_rule_equals_dense_and_generate(embedded_float32.model, wide_forest(), 4)
    assert forward.sparse_forwards >= 1


def test_the_rule_gathers_only_when_queries_see_a_small_part_of_the_cache():
    # classification steps at 8 questions: 64 lone-token branches, ~200 of 11,000 slots each
    assert sparse_wanted(queries=64, slots=11_000, groups=64, group_queries=1, group_keys=200)
    # a prefill forward of six unrelated 170-token chains over that cache
    assert sparse_wanted(queries=1024, slots=12_000, groups=6, group_queries=171, group_keys=171)
    # 8 branches decoding over one shared 1,700-token document: each sees nearly all of it
    assert not sparse_wanted(queries=8, slots=1_800, groups=8, group_queries=1, group_keys=1_720)
    # a lone query never: the dense product is one row
    assert not sparse_wanted(queries=1, slots=11_000, groups=1, group_queries=1, group_keys=10)
    # half the cache each: the padded work is no cheaper
    assert not sparse_wanted(queries=16, slots=1_000, groups=2, group_queries=8, group_keys=500)


def test_groups_are_the_chains_of_a_forward_and_a_shared_document_stays_dense():
    n_cache = 40
    doc = torch.zeros(1, n_cache, dtype=torch.bool)
    doc[0, :] = True  # every chain hangs off the whole 40-slot document
    layout = layout_chains(doc.expand(3, n_cache), [2, 1, 3], n_cache, None)
    assert group_starts(layout.allowed).tolist() == [0, 2, 3]
    additive = torch.zeros(layout.allowed.shape).masked_fill_(~layout.allowed, torch.finfo(torch.float32).min)
    assert plan_for(additive[None, None]) is None  # each chain sees 40+ of 46 slots
    n_cache = 400
    apart = torch.zeros(3, n_cache, dtype=torch.bool)
    for c, (a, b) in enumerate([(0, 5), (5, 9), (300, 310)]):
        apart[c, a:b] = True  # three unrelated short branches in a 400-slot forest
    layout = layout_chains(apart, [2, 1, 3], n_cache, None)
    additive = torch.zeros(layout.allowed.shape).masked_fill_(~layout.allowed, torch.finfo(torch.float32).min)
    plan = plan_for(additive[None, None])
    assert (plan.groups, plan.group_queries, plan.group_keys) == (3, 3, 13)  # the third: 10 + its 3
    assert plan.back.tolist() == [0, 1, 3, 6, 7, 8]  # row m's place among the 3 x 3 padded rows


def test_the_plan_carries_the_mode_and_the_gather_cost_of_its_host():
    """MDCLI_SPARSE_ATTENTION reaches the forward through the plan; a gathered slot costs 4 query
    rows where linears run on oneDNN (AVX-512), 12 elsewhere; =off plans nothing, =always gathers
    wherever there are two queries."""
    model = tiny_model("llama", "sdpa")
    avx512 = Host("x86_64", "AVX512", "AMD", 1, onednn=lambda: True)
    avx2 = Host("x86_64", "AVX2", "AMD", 1, onednn=lambda: True)
    for mode in ("auto", "off", "always", "prefix"):
        plan = select(model, settings_with(sparse_attention=mode, cpu_kernels="auto"), avx512)
        assert plan.sparse_attention == mode and FastForward(model, replace(plan, packed=False)).sparse_mode == mode
    assert select(model, settings_with(cpu_kernels="auto"), avx512).gather_cost == GATHER_COST_AVX512
    assert select(model, settings_with(cpu_kernels="auto"), avx2).gather_cost == GATHER_COST
    allowed = torch.eye(4, dtype=torch.bool)  # four lone queries, each seeing its own slot only
    additive = torch.zeros(4, 4).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    assert plan_for(additive, mode="off") is None
    assert plan_for(additive[:, :, :1], mode="always") is None  # a lone query: nothing to save
    forced = plan_for(torch.zeros(1, 1, 4, 4), mode="always")  # every slot seen: dense by the rule, gathered when forced
    assert forced is not None and plan_for(torch.zeros(1, 1, 4, 4)) is None
