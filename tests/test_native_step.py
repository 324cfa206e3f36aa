"""A step's layers in one native call (mdcli.backends.native_step): the same products and attention
as the Python forward around them, so a step of one branch or of a few gives that forward's logits
to float32 rounding, writes the same keys and values into the cache, and every branch decodes
`generate`'s tokens, on the real embedded model and on tiny .gguf files of Llama, Qwen2 (biased
q, k and v) and a Q4_K_M mix (q, k and v of two kinds). Layers it does not serve keep the Python
forward and say why. The plan is forced on here, so the tests run on every x86 host kind (the
selector takes it on AMD's)."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends import native_step
from mdcli.backends.attention import fused
from mdcli.backends.weights import gguf_blocks
from mdcli.models.on_blocks import load_on_blocks
from tests.reference import generate_alone, plain
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts
from tests.test_kquant_files import WHOLE, transformers_load, written
from tests.test_on_blocks import on_blocks

needs_native_step = pytest.mark.skipif(
    not (native_step.builds() and gguf_blocks.library() is not None and fused.fused_works()),
    reason="the one-call step, the block kernel or the attention kernel does not build on this CPU")
ONE_CALL = {"fused_attention": True, "native_step": True}
PYTHON = {"fused_attention": True, "native_step": False}


def decoded(model, prompt: list[int], steps: int, plan_changes: dict, **engine_options):
    """(greedy tokens, each step's logits [V], the engine) of one branch decoding alone."""
    generated, seen, engine = forest(model, [prompt], steps, plan_changes, **engine_options)
    return generated[0], [logits[0] for logits in seen], engine


def forest(model, prompts: list[list[int]], steps: int, plan_changes: dict, **options):
    """(each branch's greedy tokens, each step's logits [B, V], the engine) of branches decoding together."""
    drop_at = options.pop("drop_at", None)
    engine = engine_for(model, plan_changes=plan_changes, **options)
    seen: list[torch.Tensor] = []
    generated = greedy_forest(engine, prompts, steps, drop_at=drop_at,
                              on_step=lambda alive, logits, generated: seen.append(logits.clone()))
    return generated, seen, engine


def own(engine):
    return engine.model_forward.own


@needs_native_step
def test_the_embedded_models_lone_branch_steps_in_one_call_give_the_python_forwards_logits_and_generates_tokens(embedded):
    """Eight steps after a 300-token prompt: every step but the prefill's runs in one call, each
    step's logits within float32 rounding of the Python forward's, and the tokens are generate's."""
    prompt = random_prompts(300, [1], seed=21)[0]
    tokens, logits, engine = decoded(embedded.model, prompt, 8, ONE_CALL)
    python_tokens, python_logits, python_engine = decoded(embedded.model, prompt, 8, PYTHON)
    assert own(engine).native_forwards == 7 and own(python_engine).native_forwards == 0
    worst = max((ours - theirs).abs().max().item() for ours, theirs in zip(logits, python_logits))
    assert worst < 1e-4, worst
    assert tokens == python_tokens == generate_alone(embedded.model, prompt, 8)


@needs_native_step
def test_the_keys_and_values_written_in_one_call_are_the_python_forwards(embedded):
    prompt = random_prompts(60, [1], seed=22)[0]
    caches = []
    for changes in (ONE_CALL, PYTHON):
        _, _, engine = decoded(embedded.model, prompt, 4, changes)
        caches.append([layer.buffers for layer in engine.cache.layers])
        assert engine.cache.get_seq_length() == len(prompt) + 3
    filled = len(prompt) + 3
    for (keys, values), (python_keys, python_values) in zip(*caches):
        assert torch.allclose(keys[..., :filled, :], python_keys[..., :filled, :], rtol=1e-4, atol=1e-5)
        assert torch.allclose(values[..., :filled, :], python_values[..., :filled, :], rtol=1e-4, atol=1e-5)


@needs_native_step
def test_a_step_that_grows_the_caches_buffer_writes_into_the_new_one(embedded):
    """A cache made with room for the prompt alone (256 slots, the least a buffer holds): the first
    step's reserve moves every layer's buffer, and the call writes and reads the moved one."""
    prompt = random_prompts(255, [1], seed=23)[0]
    tokens, _, engine = decoded(embedded.model, prompt, 3, ONE_CALL, capacity=len(prompt))
    assert own(engine).native_forwards == 2 and engine.cache.layers[0].buffers[0].shape[-2] > len(prompt)
    assert tokens == generate_alone(embedded.model, prompt, 3)


@needs_native_step
def test_one_and_two_threads_give_the_same_logits(embedded):
    prompt = random_prompts(120, [1], seed=24)[0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one, _ = decoded(embedded.model, prompt, 3, ONE_CALL)
        torch.set_num_threads(2)
        _, two, _ = decoded(embedded.model, prompt, 3, ONE_CALL)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@needs_native_step
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_ggufs_lone_branches_decode_generates_tokens_in_one_call(arch, tmp_path):
    """Llama's permuted q and k rows, Qwen2's biases on q, k and v."""
    reference, model, why = on_blocks(arch, tmp_path)
    assert why is None, why
    for prompt in random_prompts(30, [4, 9], seed=6):
        tokens, _, engine = decoded(model, prompt, 6, ONE_CALL)
        assert own(engine).native_forwards == 5
        assert tokens == generate_alone(reference, prompt, 6)


@needs_native_step
def test_a_q4_k_m_files_joined_parts_of_two_kinds_decode_generates_tokens_in_one_call(tmp_path):
    path = written("Q4_K_M", WHOLE, tmp_path)
    reference = transformers_load(path)
    model, why = load_on_blocks(path, reference.config, "sdpa")
    assert why is None, why
    prompt = random_prompts(25, [3], seed=7)[0]
    tokens, _, engine = decoded(model, prompt, 6, ONE_CALL)
    assert {len(getattr(layer.qkv, "parts", ())) for layer in own(engine).native_step.layers} >= {2}
    assert own(engine).native_forwards == 5
    assert tokens == generate_alone(reference, prompt, 6)


@needs_native_step
def test_layers_with_per_head_norms_keep_the_python_forward_and_say_why(tmp_path):
    reference, model, why = on_blocks("qwen3", tmp_path)
    assert why is None, why
    prompt = random_prompts(30, [5], seed=8)[0]
    tokens, _, engine = decoded(model, prompt, 5, ONE_CALL)
    assert own(engine).native_step is None and "q_norm" in own(engine).native_step_reason
    assert own(engine).native_forwards == 0
    assert tokens == generate_alone(reference, prompt, 5)


@needs_native_step
def test_a_forest_of_eight_branches_steps_in_one_call_with_the_python_forwards_logits_and_generates_tokens(embedded):
    """Eight questions over one document, one dropped after the third step (the cache compacted):
    every step's forward is masked, dense, in one call; each step's logits are the Python
    forward's to float32 rounding, and each branch decodes generate's tokens."""
    prompts = random_prompts(200, [3, 6, 2, 5, 4, 7, 1, 3], seed=9)
    generated, logits, engine = forest(embedded.model, prompts, 6, ONE_CALL, drop_at=2)
    python_generated, python_logits, python_engine = forest(embedded.model, prompts, 6, PYTHON, drop_at=2)
    assert own(engine).native_forwards == 5 and own(python_engine).native_forwards == 0
    worst = max((ours - theirs).abs().max().item() for ours, theirs in zip(logits, python_logits))
    assert worst < 1e-4, worst
    assert generated == python_generated
    for prompt, tokens in zip(prompts, generated):
        assert tokens == generate_alone(embedded.model, prompt, len(tokens))


@needs_native_step
def test_a_step_wider_than_the_kernels_rows_keeps_the_python_forward(embedded):
    """Twenty branches: a step of 20 tokens multiplies on the blocks' GEMM, not the narrow kernel."""
    prompts = random_prompts(40, [2] * 20, seed=10)
    engine = engine_for(embedded.model, plan_changes=ONE_CALL | {"block_kernel_rows": 16})
    counts: list[int] = []  # native forwards before each step's forward
    generated = greedy_forest(engine, prompts, 3, on_step=lambda *_: counts.append(own(engine).native_forwards))
    assert counts[0] == counts[-1] == own(engine).native_forwards  # two steps of 20 tokens, neither in one call
    assert generated[:3] == [generate_alone(embedded.model, p, 3) for p in prompts[:3]]


def test_the_plan_takes_the_one_call_step_only_with_the_blocks_and_the_attention_kernel(embedded):
    plan = embedded.forward.plan
    assert plan.native_step == (plan.fused_attention and bool(plan.blocks) and native_step.builds())
    assert ("tokens' layers in one native call" in plan.describe()) == plan.native_step
    assert plain(embedded.model) is not embedded.model  # the reference above is transformers' own load
