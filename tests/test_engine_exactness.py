"""The engine is exact: each branch of a forest gets the logits and greedy tokens it gets alone.

Tiny random models of several architectures (GQA + RoPE, learned absolute positions, sliding
windows, mixed full/sliding layers) under eager and sdpa, fp32. References: the plain model on the
branch's whole sequence (logits) and `model.generate` (tokens).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mdcli.backends.forward import ModelForward
from mdcli.backends.select import select
from mdcli.models.architectures import sliding_window_layout
from mdcli.settings import Settings, current
from mdcli.core.cache import GrowingLayer, cache_length, new_cache
from mdcli.core.decoding import prefill_prompts
from mdcli.core.engine import Engine
from mdcli.core.forest import pad_rows
from tests.reference import generate_alone

VOCAB = 512


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=None, pad_token_id=0, bos_token_id=1)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":  # RMSNorm over each query and key head (q_norm, k_norm), a head_dim of its own
        return tf.Qwen3Config(**common, head_dim=24)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=6)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=6,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=1024,
                             eos_token_id=None, pad_token_id=0, bos_token_id=1)
    raise ValueError(arch)


ARCHS = ["llama", "gpt2", "qwen2", "qwen3", "mistral", "gemma3"]


def tiny_model(arch: str, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def settings_with(**changes) -> Settings:
    """The environment's settings with some changed: how tests switch backends (never the environment)."""
    return current().changed(**changes)


def engine_for(model, *, settings: Settings | None = None, own_forward: bool = True, plan_changes: dict | None = None,
               **options) -> Engine:
    """An engine over a bare model, its plan chosen under `settings` (default: the environment's),
    with `plan_changes` (Plan fields, through dataclasses.replace) on top; own_forward=False: every
    forward on transformers' own (the reference)."""
    window, mixed = sliding_window_layout(model.config)
    plan = replace(select(model, settings), **(plan_changes or {}))
    model_forward = ModelForward(model, plan, sliding_window=window, own=own_forward)
    return Engine(model_forward, sliding_window=window, mixed_layer_types=mixed, **options)


def alone_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([sequence])).logits[0, -1].float()



def random_prompts(prefix_len: int, suffix_lens: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, VOCAB, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in suffix_lens]


def greedy_forest(engine: Engine, prompts: list[list[int]], steps: int, *, drop_at: int | None = None,
                  on_step=None) -> list[list[int]]:
    """Decode all prompts greedily together; optionally drop branch 1 and compact at `drop_at`."""
    results = prefill_prompts(engine, prompts)
    rows = [r.row for r in results]
    logits = torch.stack([r.logits for r in results])
    alive = list(range(len(prompts)))
    generated: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        tokens = logits.argmax(-1).tolist()
        for i, t in zip(alive, tokens):
            generated[i].append(t)
        if on_step:
            on_step(alive, logits, generated)
        if step == steps - 1:
            break
        if drop_at is not None and step == drop_at and len(alive) > 1:
            keep = [j for j, i in enumerate(alive) if i != 1]
            alive, rows, tokens = [alive[j] for j in keep], [rows[j] for j in keep], [tokens[j] for j in keep]
            stacked = engine.compact(torch.stack([pad_rows(r[None], len(engine))[0] for r in rows]))
            rows = list(stacked)
        stacked = torch.stack([pad_rows(r[None], len(engine))[0] for r in rows])
        outs = engine.forward(stacked, [[t] for t in tokens])
        rows = [o.row for o in outs]
        logits = torch.stack([o.logits for o in outs])
    return generated


@pytest.mark.parametrize("cpu_kernels", ["onednn", "torch"])  # both routings, whatever this CPU defaults to
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_branch_matches_its_sequence_run_alone_step_by_step(arch, attn, cpu_kernels):
    model = tiny_model(arch, attn)
    # max_forward_tokens forces a chunked prefill too
    engine = engine_for(model, settings=settings_with(cpu_kernels=cpu_kernels), max_forward_tokens=16)
    assert_each_step_matches_alone(model, engine)


def assert_each_step_matches_alone(model, engine: Engine) -> None:
    """Four branches off a 37-token prefix, ten greedy steps, branch 1 dropped and the cache
    compacted after step 4: every step's logits within 1e-4 of the branch's sequence run alone
    through the plain model, and its greedy token that run's."""
    prompts = random_prompts(37, [3, 9, 1, 5])
    worst = 0.0

    def check(alive, logits, generated):
        nonlocal worst
        for row, i in enumerate(alive):
            reference = alone_logits(model, prompts[i] + generated[i][:-1])
            worst = max(worst, float((reference - logits[row]).abs().max()))
            assert int(reference.argmax()) == generated[i][-1]

    greedy_forest(engine, prompts, steps=10, drop_at=4, on_step=check)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert engine.compactions == 1


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_model_generate_for_every_branch(arch, attn):
    model = tiny_model(arch, attn)
    prompts = random_prompts(50, [4, 4, 12, 2, 7], seed=arch.__len__())
    generated = greedy_forest(engine_for(model), prompts, steps=12, drop_at=3)
    for i, prompt in enumerate(prompts):
        expected = generate_alone(model, prompt, len(generated[i]))
        assert generated[i] == expected, f"branch {i}"


def test_sliding_window_models_stay_exact_far_past_the_window():
    model = tiny_model("mistral", "sdpa")  # window 6: every branch here is many windows long
    prompts = random_prompts(30, [2, 11, 5], seed=3)
    generated = greedy_forest(engine_for(model), prompts, steps=20)
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, 20)


def test_prompts_sharing_deeper_prefixes_enter_the_cache_once():
    model = tiny_model("llama", "sdpa")
    base = random_prompts(20, [0])[0]
    prompts = [base + [5, 6, 7], base + [5, 6, 8, 9], base + [10], base + [5, 6, 7]]
    engine = engine_for(model)
    results = prefill_prompts(engine, prompts)
    # trunk 20 + shared [5, 6] + [7] + [8, 9] + [10]; the duplicate prompt adds nothing
    assert len(engine) == 20 + 2 + 1 + 2 + 1
    for prompt, result in zip(prompts, results):
        assert torch.allclose(result.logits, alone_logits(model, prompt), atol=1e-4)
        assert engine.forest.path_token_ids(result.row) == prompt


def test_independent_roots_share_nothing_and_stay_exact():
    model = tiny_model("llama", "eager")
    prompts = [[7, 8, 9], [20, 21], [7, 30]]
    engine = engine_for(model)
    results = prefill_prompts(engine, prompts)
    for prompt, result in zip(prompts, results):
        assert torch.allclose(result.logits, alone_logits(model, prompt), atol=1e-4)


def test_compaction_drops_every_slot_no_live_branch_attends_to():
    model = tiny_model("llama", "sdpa")
    prompts = random_prompts(10, [6, 6])
    engine = engine_for(model)
    results = prefill_prompts(engine, prompts)
    assert len(engine) == 22
    [row] = engine.compact(results[0].row[None])
    assert len(engine) == 16 and int(row.sum()) == 16
    assert engine.cache.get_seq_length() == 16
    assert engine.forest.path_token_ids(row) == prompts[0]


def test_a_later_prompt_reuses_the_longest_cached_path_and_stays_exact():
    model = tiny_model("llama", "sdpa")
    first, second = random_prompts(30, [5, 8], seed=4)
    engine = engine_for(model)
    [a] = prefill_prompts(engine, [first])
    grown = len(engine)
    [b] = prefill_prompts(engine, [second])
    assert len(engine) == grown + 8  # only the new suffix was fed
    assert torch.allclose(b.logits, alone_logits(model, second), atol=1e-4)
    assert engine.forest.path_token_ids(b.row) == second


def test_a_prompt_already_fully_cached_feeds_only_its_last_token():
    model = tiny_model("qwen2", "eager")
    [prompt] = random_prompts(12, [3])
    engine = engine_for(model)
    prefill_prompts(engine, [prompt])
    [again] = prefill_prompts(engine, [prompt])
    assert len(engine) == len(prompt) + 1
    assert torch.allclose(again.logits, alone_logits(model, prompt), atol=1e-4)


def test_the_prefix_index_follows_compaction():
    model = tiny_model("llama", "eager")
    keep, drop = random_prompts(10, [4, 4], seed=6)
    engine = engine_for(model)
    kept, _ = prefill_prompts(engine, [keep, drop])
    engine.compact(kept.row[None])
    [again] = prefill_prompts(engine, [keep + [9, 9]])
    assert len(engine) == len(keep) + 2
    assert torch.allclose(again.logits, alone_logits(model, keep + [9, 9]), atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_hands_the_cache_over_by_the_keyword_the_model_declares(arch):
    """A chunked prefill through transformers' own forward, with FutureWarnings as errors: the
    cache goes in by the name the installed transformers takes (`cache` since 5.24, whose old
    `past_key_values` warns and goes away in 5.40), so users see no warning and the run survives
    the rename."""
    import warnings

    model = tiny_model(arch, "sdpa")
    engine = engine_for(model, own_forward=False, max_forward_tokens=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        outs = prefill_prompts(engine, random_prompts(13, [5, 3]))
    assert len(engine) == 13 + 5 + 3 and all(o.logits is not None for o in outs)


def test_a_model_without_the_cache_keyword_gets_past_key_values():
    """transformers before 5.24 names it `past_key_values` only; an unknown `cache` would vanish
    into **kwargs and the model would run without its cache."""
    from mdcli.backends.reference import cache_argument

    class OlderForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    marker = object()
    assert cache_argument(OlderForward(), marker) == {"past_key_values": marker}


def test_the_cache_buffer_grows_by_a_quarter_when_full_and_shows_only_its_filled_part():
    cache = new_cache()
    keys = torch.randn(1, 2, GrowingLayer.min_capacity, 4)
    cache.update(keys, keys + 1, 0)
    layer = cache.layers[0]
    assert type(layer) is GrowingLayer and layer._k.shape[-2] == GrowingLayer.min_capacity
    cache.update(keys[..., :1, :], keys[..., :1, :], 0)  # one past full: a quarter more room, not double
    assert layer._k.shape[-2] == GrowingLayer.min_capacity * 5 // 4
    assert cache_length(cache) == GrowingLayer.min_capacity + 1 and layer.keys.shape[-2] == cache_length(cache)
    assert torch.equal(layer.keys[..., :-1, :], keys) and torch.equal(layer.values[..., :-1, :], keys + 1)
