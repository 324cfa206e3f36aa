"""A .gguf loads on its blocks (mdcli.models.on_blocks): no float32 copy of its projections, head or
embedding exists, every forward (a causal prefill included) multiplies by the file's blocks, and
every branch still decodes transformers' tokens with transformers' logits, on the embedded model
and on tiny Llama, Qwen2 and Qwen3 models written to complete .gguf files. What the loader does not
cover loads its float32 weights as before, and the plan says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from mdcli.backends.forward import causal_mask
from mdcli.backends.select import select
from mdcli.backends.weights import gguf_reading
from mdcli.models import block_checks
from mdcli.models.load import LoadOptions, load_model
from mdcli.models.on_blocks import load_on_blocks, refusal
from tests.reference import generate_alone, plain
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts, tiny_model
from tests.test_gguf_blocks import PERMUTED, llama_cpp_permuted, needs_kernel, quantized

# llama.cpp's tensor names for each part of a layer, and the file's architecture for each family
PARTS = (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
         ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
         ("ffn_down", "mlp.down_proj"))
ARCHITECTURE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def complete_gguf(model, path: Path, arch: str, *, kind: str = "Q4_1", head_kind: str = "Q8_0",
                  float_part: str | None = None) -> Path:
    """Write every tensor of a tiny model to a real .gguf as llama.cpp names and lays them out:
    projections in `kind` blocks (q and k rows permuted where llama.cpp permutes that family), the
    tied embedding in `head_kind`, norms and biases float32. The model's own weights are rounded in
    place to what the blocks hold, so it stays the reference. float_part: one projection written
    as plain float32 instead (a type the kernel does not read)."""
    config = model.config
    writer = GGUFWriter(str(path), ARCHITECTURE[arch])
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for name, attribute in PARTS:
                module = layer.get_submodule(attribute)
                if name == float_part:
                    writer.add_tensor(f"blk.{index}.{name}.weight", module.weight.numpy().copy())
                else:
                    codes, weights = quantized(module.weight.numpy(), kind)
                    module.weight.copy_(weights)
                    if PERMUTED[arch] and name in heads:
                        codes = llama_cpp_permuted(codes, heads[name])
                    writer.add_tensor(f"blk.{index}.{name}.weight", codes, raw_dtype=GGMLQuantizationType[kind])
                if module.bias is not None:
                    bias = module.bias.numpy().copy()
                    writer.add_tensor(f"blk.{index}.{name}.bias",
                                      llama_cpp_permuted(bias, heads[name]) if PERMUTED[arch] and name in heads else bias)
            writer.add_tensor(f"blk.{index}.attn_norm.weight", layer.input_layernorm.weight.numpy().copy())
            writer.add_tensor(f"blk.{index}.ffn_norm.weight", layer.post_attention_layernorm.weight.numpy().copy())
            for norm in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, norm):
                    writer.add_tensor(f"blk.{index}.attn_{norm}.weight",
                                      getattr(layer.self_attn, norm).weight.numpy().copy())
        codes, weights = quantized(model.lm_head.weight.numpy(), head_kind)
        model.lm_head.weight.copy_(weights)
        model.model.embed_tokens.weight.copy_(weights)  # one tensor in the file: the tied embedding too
        writer.add_tensor("token_embd.weight", codes, raw_dtype=GGMLQuantizationType[head_kind])
        writer.add_tensor("output_norm.weight", model.model.norm.weight.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def on_blocks(arch: str, tmp_path: Path, **written):
    """(the tiny float32 reference, the same model loaded on its .gguf's blocks, or why not)."""
    reference = tiny_model(arch, "sdpa")
    path = complete_gguf(reference, tmp_path / f"{arch}.gguf", arch, **written)
    model, why = load_on_blocks(path, reference.config, "sdpa")
    return reference, model, why


def test_the_embedded_model_holds_no_float32_projections_head_or_embedding(embedded):
    model = embedded.model
    plan = embedded.forward.plan
    assert plan.on_blocks and plan.float32_reason == ""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    assert "model.embed_tokens.weight" in meta
    assert all(any(f".{part}.weight" in name for _, part in PARTS) or name == "model.embed_tokens.weight"
               for name in meta)
    assert len(meta) == 1 + 7 * model.config.num_hidden_layers
    held = embedded.forward.weight_bytes()
    float32_bytes = sum(p.numel() * 4 for p in model.parameters())  # the float32 copy that is not made
    assert sum(held.values()) < float32_bytes / 4, held
    assert set(held) == {"the model's own parameters", "file blocks"}


@needs_kernel
def test_the_embedded_models_causal_prefill_on_its_blocks_gives_transformers_logits(embedded):
    """A prefill of 300 tokens after 40 cached ones, on the own forward with the causal mask: every
    row's logits are transformers' on its own float32 load of the same file."""
    from mdcli.core.cache import new_cache

    tokens = torch.tensor(random_prompts(340, [340], seed=11)[0][:340]) % embedded.model.config.vocab_size
    positions = torch.arange(340)
    cache = new_cache()
    forward = embedded.forward
    forward(tokens[:40], positions[:40], None, cache, None)
    ours = forward(tokens[40:], positions[40:], None, cache, torch.arange(300))  # [300, V]
    with torch.inference_mode():
        theirs = plain(embedded.model)(tokens[None]).logits[0, 40:]
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), (ours - theirs).abs().max()


def test_the_causal_mask_lets_each_new_token_see_the_cache_and_the_new_tokens_before_it():
    mask = causal_mask(3, 2, torch.float32)[0, 0]  # [3, 5]
    seen = mask == 0
    assert seen.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


@needs_kernel
@pytest.mark.parametrize("arch", list(ARCHITECTURE))
def test_tiny_ggufs_load_on_their_blocks_and_decode_generates_tokens(arch, tmp_path):
    """A complete .gguf of each family: the loader builds the model on the meta device, finds every
    matrix bit for bit, and a forest over it (prefill and steps on the blocks alone) decodes each
    branch to transformers' tokens on the float32 model the file was written from."""
    reference, model, why = on_blocks(arch, tmp_path)
    assert why is None, why
    assert model.model.layers[0].mlp.up_proj.weight.is_meta and model.model.embed_tokens.weight.is_meta
    assert select(model).on_blocks
    engine = engine_for(model)
    prompts = random_prompts(30, [4, 7, 2, 9, 5, 3, 6, 8, 2, 4, 7, 5], seed=3)
    for prompt, tokens in zip(prompts, greedy_forest(engine, prompts, steps=6)):
        assert tokens == generate_alone(reference, prompt, len(tokens))
    long = random_prompts(30, [40], seed=4)  # a prefill wider than the narrow kernel's rows
    assert greedy_forest(engine_for(model), long, steps=6)[0] == generate_alone(reference, long[0], 6)


@needs_kernel
def test_a_projection_the_kernel_cannot_read_keeps_the_float32_load_and_says_which(tmp_path):
    _, model, why = on_blocks("llama", tmp_path, float_part="ffn_down")
    assert model is None and "ffn_down" in why and "F32" in why


def test_what_the_loader_does_not_cover_is_said_before_any_weight_is_read(embedded):
    config = embedded.model.config
    cpu, f32 = torch.device("cpu"), torch.float32
    assert refusal(config, cpu, f32, "float32") is None
    assert refusal(config, cpu, f32, "int8") == "only float32 CPU models multiply by the blocks"
    assert refusal(config, cpu, torch.bfloat16, "float32") == "only float32 CPU models multiply by the blocks"
    assert "keep" in refusal(config, cpu, f32, "float32", keep_float32=True)


def test_keeping_the_float32_weights_is_an_option_and_the_plan_says_so():
    kept = load_model(LoadOptions(quiet=True, keep_float32=True))
    assert not kept.forward.plan.on_blocks and "keep" in kept.forward.plan.float32_reason
    assert not kept.model.model.layers[0].mlp.up_proj.weight.is_meta
    assert kept.forward.plan.blocks == "Q4_1/Q8_0"  # a few tokens still read the blocks


def records_in(cache: Path) -> list[Path]:
    return sorted((cache / block_checks.FOLDER).glob("*.json"))


def loaded_counting_checks(path: Path, config, monkeypatch) -> tuple[torch.nn.Module | None, str | None, list[str]]:
    """load_on_blocks, and the tensors the whole bit-for-bit check ran on (gguf_reading._matching)."""
    checked, whole_check = [], gguf_reading._matching

    def counted(candidates, weight):
        checked.append(candidates[0].shape)
        return whole_check(candidates, weight)

    monkeypatch.setattr(gguf_reading, "_matching", counted)
    model, why = load_on_blocks(path, config, "sdpa")
    monkeypatch.setattr(gguf_reading, "_matching", whole_check)
    return model, why, checked


@needs_kernel
def test_a_passed_check_is_recorded_and_the_next_load_of_the_file_skips_it_with_the_same_tokens(tmp_path, monkeypatch):
    """The first load checks every matrix and writes one JSON record of the layouts it found (q and
    k with llama.cpp's permutation undone); the second load of the same file checks none of them
    whole, takes the recorded layouts, and still decodes transformers' tokens."""
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    reference = tiny_model("llama", "sdpa")
    path = complete_gguf(reference, tmp_path / "llama.gguf", "llama")
    first, why, checked_first = loaded_counting_checks(path, reference.config, monkeypatch)
    assert why is None and len(checked_first) == 7 * reference.config.num_hidden_layers + 1  # every matrix, the head
    [record] = records_in(tmp_path / "cache")
    layouts = json.loads(record.read_text())["layouts"]
    assert layouts["blk.0.attn_q.weight"] == 1 and layouts["blk.0.attn_v.weight"] == 0
    second, why, checked_second = loaded_counting_checks(path, reference.config, monkeypatch)
    assert why is None and checked_second == []
    for mine, theirs in zip(gguf_reading.model_blocks(second)[0][0], gguf_reading.model_blocks(first)[0][0]):
        assert mine.kind == theirs.kind and torch.equal(mine.data, theirs.data)
    prompts = random_prompts(30, [4, 7, 2, 9], seed=5)
    for prompt, tokens in zip(prompts, greedy_forest(engine_for(second), prompts, steps=5)):
        assert tokens == generate_alone(reference, prompt, len(tokens))


@needs_kernel
@pytest.mark.parametrize("spoil", ["the other layout", "no layout there", "not json"])
def test_a_record_that_is_wrong_for_the_file_is_caught_and_the_check_runs_again(spoil, tmp_path, monkeypatch):
    """A record naming the wrong layout for q fails the first rows' check, one naming a layout the
    tensor does not have or that cannot be read is ignored: those tensors are checked whole, the
    model gets the right layout and the record is put right."""
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    reference = tiny_model("llama", "sdpa")
    path = complete_gguf(reference, tmp_path / "llama.gguf", "llama")
    load_on_blocks(path, reference.config, "sdpa")
    [record] = records_in(tmp_path / "cache")
    right = json.loads(record.read_text())
    wrong = {**right["layouts"], "blk.0.attn_q.weight": {"the other layout": 0, "no layout there": 7}.get(spoil, 1)}
    record.write_text("{not json" if spoil == "not json" else json.dumps({**right, "layouts": wrong}))
    model, why, checked = loaded_counting_checks(path, reference.config, monkeypatch)
    assert why is None and len(checked) == (1 if spoil != "not json" else 7 * reference.config.num_hidden_layers + 1)
    assert json.loads(record.read_text()) == right
    prompt = random_prompts(30, [6], seed=6)[0]
    assert greedy_forest(engine_for(model), [prompt], steps=5)[0] == generate_alone(reference, prompt, 5)


@needs_kernel
def test_another_file_or_config_has_its_own_record(tmp_path, monkeypatch):
    """The key covers the file's bytes and the config: a second file (other blocks) and the same
    file read with another config each get a record of their own, never another's; where the
    config was read from is no part of it."""
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    one = tiny_model("llama", "sdpa")
    first = complete_gguf(one, tmp_path / "q4_1.gguf", "llama")
    second = complete_gguf(tiny_model("llama", "sdpa"), tmp_path / "q8_0.gguf", "llama", kind="Q8_0")
    assert block_checks.record_path(first, one.config) != block_checks.record_path(second, one.config)
    other_config = type(one.config)(**{**one.config.to_dict(), "rms_norm_eps": 1e-3})
    assert block_checks.record_path(first, one.config) != block_checks.record_path(first, other_config)
    read_elsewhere = type(one.config)(**{**one.config.to_dict(), "_name_or_path": "/somewhere/else"})
    assert block_checks.record_path(first, one.config) == block_checks.record_path(first, read_elsewhere)
