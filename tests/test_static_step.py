"""Decode forwards on static buffers (mdcli.backends.graphs) give every branch what it gets alone.

On CUDA each bucket's forward is captured as a CUDA graph and replayed (`pytest -m gpu`); on any
device `MDCLI_CUDA_GRAPHS=static` runs the same buffers, padding and slot writes uncaptured, which is
what the CPU tests here check: widths padded to a bucket, keys and values written at their slots,
attention over the whole buffer with the masked slots adding nothing, the cache growing and being
compacted under it, and speculation's verification trees taking the wider buckets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mdcli.api import ask_many
from mdcli.backends import graphs
from mdcli.backends.forward import ModelForward
from mdcli.backends.select import select
from mdcli.core.cache import GrowingLayer
from mdcli.events import Done, Finish
from mdcli.models.load import load_model
from tests.test_engine_exactness import (assert_each_step_matches_alone, engine_for, greedy_forest, random_prompts,
                                         settings_with, tiny_model)
from tests.test_low_precision import DOCUMENT, MAX_TIE_GAP, QUESTIONS, disagreements

HAS_CUDA = torch.cuda.is_available()
OWN_FORWARD_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]  # mdcli's own forward: the one the static step runs


@pytest.mark.parametrize("arch", OWN_FORWARD_ARCHS)
@pytest.mark.parametrize("core", [None, graphs.CAPTURED_CORE])  # the plan's own routes, and a captured step's
def test_every_branch_on_static_buffers_matches_its_sequence_run_alone_step_by_step(arch, core):
    """4 branches, then 3 after a compaction: padded to 4 rows."""
    model = tiny_model(arch, "sdpa")
    engine = engine_for(model, settings=settings_with(cuda_graphs="static"), plan_changes={"static_core": core},
                        max_forward_tokens=16)
    assert_each_step_matches_alone(model, engine)
    assert engine.model_forward.static.steps >= 9  # every decode step ran on the static buffers


@pytest.mark.parametrize("branches", [3, 5, 9])  # padded to 4, 8 and 16 rows
def test_padded_rows_change_nothing_in_the_real_rows_logits(branches):
    model = tiny_model("llama", "sdpa")
    prompts = random_prompts(20, [2 + i for i in range(branches)], seed=branches)
    static = engine_for(model, settings=settings_with(cuda_graphs="static"))
    plain = engine_for(model, settings=settings_with(cuda_graphs="off"))
    seen = {}

    def keep(name):
        def on_step(alive, logits, generated):
            seen.setdefault(name, []).append(logits.clone())
        return on_step

    assert greedy_forest(static, prompts, 6, on_step=keep("static")) == greedy_forest(plain, prompts, 6, on_step=keep("plain"))
    assert plain.model_forward.static is None
    worst = max(float((a - b).abs().max()) for a, b in zip(seen["static"], seen["plain"]))
    assert worst < 1e-4, f"max logit difference {worst:.2e}"


def test_a_cache_that_grows_under_the_static_buffers_keeps_every_branch_exact():
    """256 slots to start, a quarter more when full: 40 steps of 8 branches past a 230-token prefix
    (550 slots by the end) regrow the buffers again and again, and the step's inputs follow them to
    their new addresses."""
    model = tiny_model("qwen2", "sdpa")
    prompts = random_prompts(230, [1] * 8, seed=3)
    static = engine_for(model, settings=settings_with(cuda_graphs="static"))
    plain = engine_for(model, settings=settings_with(cuda_graphs="off"))
    capacities = set()
    record = lambda alive, logits, generated: capacities.add(static.cache.layers[0].buffers[0].shape[-2])  # noqa: E731
    assert greedy_forest(static, prompts, 40, on_step=record) == greedy_forest(plain, prompts, 40)
    assert len(capacities) >= 3


def test_slots_past_the_filled_part_hold_finite_numbers_so_masked_slots_add_exact_zeros():
    layer = GrowingLayer()
    keys = torch.randn(1, 2, 300, 8)
    layer.update(keys, keys.clone())
    buffer = layer.buffers[0]  # grown from 256 to 300 slots, then by a quarter on the next reserve
    layer.reserve(301)
    grown = layer.buffers[0]
    assert grown.shape[-2] == 375 and grown.data_ptr() != buffer.data_ptr()
    assert torch.equal(grown[..., :300, :], keys) and torch.count_nonzero(grown[..., 300:, :]) == 0


def test_speculation_verifies_its_trees_on_the_wider_buckets_with_the_same_tokens():
    """A fixed draft budget makes every step a verification tree of several tokens per branch."""
    lm = load_model(quiet=True, cuda_graphs="static")
    assert lm.forward.plan.static_step and not lm.forward.plan.cuda_graphs
    answers = {}
    for speculate in ("off", "6"):
        finishes, stats = {}, None
        for event in ask_many(lm, DOCUMENT, QUESTIONS[:3], max_new_tokens=16, speculate=speculate):
            if isinstance(event, Finish):
                finishes[event.branch] = event.token_ids
            elif isinstance(event, Done):
                stats = event.stats
        answers[speculate] = finishes
        assert stats.graph_captures == 0  # static buffers, never captured
    assert answers["6"] == answers["off"]
    assert lm.forward.static.steps > 0


@pytest.fixture(scope="module")
def cpu_bf16_on_the_captured_core():
    """The embedded model in bf16 on the CPU, its static step on the core a captured step attends
    with (the plan a CUDA model gets, but uncaptured): its arithmetic, checked without a GPU."""
    lm = load_model(device="cpu", dtype="bfloat16", quiet=True, cuda_graphs="static")
    plan = replace(lm.forward.plan, static_core=graphs.CAPTURED_CORE)
    return replace(lm, forward=ModelForward(lm.model, plan, sliding_window=lm.sliding_window))


def test_the_captured_core_in_bf16_agrees_with_generate_up_to_ties(cpu_bf16_on_the_captured_core):
    lm = cpu_bf16_on_the_captured_core
    assert disagreements(lm, MAX_TIE_GAP) == []
    assert lm.forward.static.core == "bmm" and lm.forward.static.steps > 0


def test_the_plan_captures_on_cuda_only_and_says_why_not_elsewhere():
    model = tiny_model("llama", "sdpa")
    auto = select(model, settings_with(cuda_graphs="auto"))
    assert not auto.static_step and auto.graphs_reason == "not a CUDA model"
    static = select(model, settings_with(cuda_graphs="static"))
    assert static.static_step and not static.cuda_graphs and "1-64 tokens on static buffers" in static.describe()
    off = select(model, settings_with(cuda_graphs="off"))
    assert not off.static_step and off.graphs_reason == "MDCLI_CUDA_GRAPHS=off"
    reference = select(tiny_model("gpt2", "sdpa"), settings_with(cuda_graphs="static"))
    assert not reference.static_step and reference.graphs_reason.startswith("transformers' forward")


def test_a_rotary_embedding_that_reads_its_depths_on_the_host_is_never_captured():
    model = tiny_model("llama", "sdpa")
    assert graphs.capture_reason(model, torch.device("cuda")) is None
    model.model.rotary_emb.rope_type = "dynamic"
    assert "reads the depths on the host" in graphs.capture_reason(model, torch.device("cuda"))


def test_a_bad_cuda_graphs_value_is_a_usage_error_naming_the_variable():
    from mdcli.errors import UsageError

    with pytest.raises(UsageError, match="MDCLI_CUDA_GRAPHS"):
        settings_with(cuda_graphs="sometimes")


# -- on a GPU: captured and replayed -------------------------------------------------------------


def _captured(lm) -> int:
    return lm.forward.graph_captures


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", ["auto", "off"])
def test_float32_forest_equals_generate_on_cuda_with_graphs_on_and_off(cuda_graphs):
    lm = load_model(device="cuda", dtype="float32", quiet=True, cuda_graphs=cuda_graphs)
    assert lm.forward.plan.cuda_graphs is (cuda_graphs == "auto"), lm.forward.plan.graphs_reason
    assert disagreements(lm, max_gap=1e-3) == []  # float32 rounding only
    assert (_captured(lm) > 0) is (cuda_graphs == "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", ["auto", "off"])
def test_bf16_forest_agrees_with_generate_up_to_ties_on_cuda_with_graphs_on_and_off(cuda_graphs):
    lm = load_model(device="cuda", quiet=True, cuda_graphs=cuda_graphs)
    assert lm.dtype in (torch.bfloat16, torch.float16)
    assert disagreements(lm, MAX_TIE_GAP) == []
    assert (_captured(lm) > 0) is (cuda_graphs == "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_speculation_with_graphs_gives_the_plain_forest_tokens_in_float32_on_cuda():
    lm = load_model(device="cuda", dtype="float32", quiet=True)
    answers, captures = {}, {}
    for speculate in ("off", "6"):
        finishes = {}
        for event in ask_many(lm, DOCUMENT, QUESTIONS, max_new_tokens=24, speculate=speculate):
            if isinstance(event, Finish):
                finishes[event.branch] = event.token_ids
            elif isinstance(event, Done):
                captures[speculate] = event.stats.graph_captures
        answers[speculate] = finishes
    assert answers["6"] == answers["off"]
    assert captures["off"] > 0  # the first run captures its buckets; a later one may reuse them
