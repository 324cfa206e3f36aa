"""A decode step on the .gguf's own blocks (mdcli.backends.weights.gguf_blocks) multiplies by the model's own float32
weights: the kernel writes gguf-py's dequantized weights bit for bit, its products agree with
float32's to rounding, and a forest over the blocks gives transformers' logits and `generate`'s
tokens, on the embedded model and on tiny Llama, Qwen2, Qwen3 and Mistral models written to real
.gguf files. A file whose blocks are not the model's weights is never used.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from mdcli.backends.forward import ModelForward
from mdcli.backends.llama import FastForward
from mdcli.backends.select import Host, select
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights.gguf_blocks import (
    BlockWeight,
    block_linear,
    dequantize,
    matches,
    remember_source,
)
from mdcli.backends.weights.gguf_file import read_tensors
from mdcli.cli.common import header
from mdcli.models.embedded import embedded_gguf_path
from tests.reference import generate_alone
from tests.test_engine_exactness import (
    engine_for,
    greedy_forest,
    random_prompts,
    settings_with,
    tiny_model,
)
from tests.test_llama_forward import lockstep_logits

# only whether the kernel builds decides the skip: a kernel that disagreed with gguf-py must fail these tests
needs_kernel = pytest.mark.skipif(gguf_blocks.library() is None, reason="the block kernel does not build on this CPU")
KINDS = ["Q4_1", "Q8_0", "Q4_0", "F16", "BF16"]
# where llama.cpp's converter stores q and k rows permuted for its rotary layout (transformers'
# GGUF loader undoes it), and where it stores them as they are
PERMUTED = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False}


def quantized(values: np.ndarray, kind: str) -> tuple[np.ndarray, torch.Tensor]:
    """values [N, K] float32 -> (codes [N, K / 32 * bytes] uint8, gguf-py's dequantized weights [N, K])."""
    kind_id = GGMLQuantizationType[kind]
    codes = np.ascontiguousarray(quants.quantize(values.astype(np.float32), kind_id))
    weights = torch.from_numpy(quants.dequantize(codes, kind_id).astype(np.float32))
    return codes.view(np.uint8).reshape(values.shape[0], -1), weights  # F16 / BF16 come as 2-byte numbers


def llama_cpp_permuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows in the order llama.cpp's converter writes them (convert_hf_to_gguf's `permute`)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def own_forward(model, settings=None, host: Host | None = None) -> FastForward:
    """mdcli's own forward as a plan chosen at load builds it (under `settings`, on `host`)."""
    return FastForward(model, select(model, settings, host))


def gguf_backed(model, path: Path, *, kind: str = "Q4_1", head_kind: str = "Q8_0", permute: bool = True) -> Path:
    """Round every projection of `model` to `kind` and its head to `head_kind`, in place, as a GGUF
    load would leave them, and write those blocks to a real .gguf at `path` (llama.cpp's names; q
    and k rows permuted as its converter writes Llama's when `permute`); the model remembers it."""
    config = model.config
    writer = GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            for name, module, heads in (
                    ("attn_q", attention.q_proj, config.num_attention_heads),
                    ("attn_k", attention.k_proj, config.num_key_value_heads), ("attn_v", attention.v_proj, None),
                    ("attn_output", attention.o_proj, None), ("ffn_gate", mlp.gate_proj, None),
                    ("ffn_up", mlp.up_proj, None), ("ffn_down", mlp.down_proj, None)):
                codes, weights = quantized(module.weight.numpy(), kind)
                module.weight.copy_(weights)
                if permute and heads:
                    codes = llama_cpp_permuted(codes, heads)
                writer.add_tensor(f"blk.{index}.{name}.weight", codes, raw_dtype=GGMLQuantizationType[kind])
        codes, weights = quantized(model.lm_head.weight.numpy(), head_kind)
        model.lm_head.weight.copy_(weights)  # tied: the input embedding too
        writer.add_tensor("token_embd.weight", codes, raw_dtype=GGMLQuantizationType[head_kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    remember_source(model, path)
    return path


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_writes_gguf_pys_weights_bit_for_bit(kind):
    """d * q + m in float32, as gguf-py computes it, over weights of many magnitudes (each block's
    own scale and minimum): a code read from the wrong nibble or a scale from the wrong byte would
    differ."""
    generator = np.random.default_rng(1)
    values = generator.standard_normal((64, 256)) * np.exp(generator.uniform(-12, 4, (64, 1)))
    codes, expected = quantized(values, kind)
    weight = BlockWeight(kind, torch.from_numpy(codes), 256)
    assert torch.equal(dequantize(weight), expected)
    assert matches(weight, expected)  # the check at load, which writes nothing out
    nudged = expected.clone()
    nudged[63, 255] = torch.nextafter(nudged[63, 255], torch.tensor(np.inf))  # the very last weight
    assert not matches(weight, nudged)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("inputs", [576, 1600])
def test_products_agree_with_float32_for_every_row_count(kind, rows, inputs):
    """Every pass size (8 rows at a time on AVX-512, 4 on AVX2, one rebuild for 5-8 rows on AVX2,
    the wide panels of 3 weight rows beyond that, and the remainders: 37 outputs are 12 panels and
    one left over; 1,600 inputs are two spans of 24 blocks and one of 2): within float32 rounding
    of the float64 product, the bound that holds for any order of summation, and as close as
    torch's own float32 product is."""
    generator = np.random.default_rng(rows)
    codes, weights = quantized(generator.standard_normal((37, inputs)), kind)
    x = torch.from_numpy(generator.standard_normal((rows, inputs)).astype(np.float32))
    bias = torch.from_numpy(generator.standard_normal(37).astype(np.float32))
    ours = block_linear(x, BlockWeight(kind, torch.from_numpy(codes), inputs), bias)
    exact = x.double() @ weights.double().T + bias.double()
    torchs = float((torch.nn.functional.linear(x, weights, bias).double() - exact).abs().max())
    assert bool(((ours.double() - exact).abs() <= rounding_bound(x, weights, bias)).all())
    assert float((ours.double() - exact).abs().max()) <= 4 * torchs + 1e-6


def rounding_bound(x, weights, bias=None) -> torch.Tensor:
    """How far any float32 sum of k products (and a bias) may lie from the exact one, elementwise:
    (k + 1) * 2^-24 * (sum |x w| + |bias|). A code read from the wrong nibble or a scale from the
    wrong byte moves a product by about |x w| itself, far past it."""
    k = x.shape[-1]
    magnitude = x.double().abs() @ weights.double().abs().T + (0 if bias is None else bias.double().abs())
    return (k + 1) * 2.0**-24 * magnitude


# wide products: 1,101 outputs of 608 inputs (19 blocks) are tiles of 551 and 550 weight rows
WIDE_OUT, WIDE_IN = 1101, 608


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, "narrow", "wide", 37, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows_on_kernel", [None, 64])
def test_products_of_any_width_are_float32_products_of_the_blocks_weights(kind, rows, with_bias, rows_on_kernel):
    """Up to max_rows() rows (or `rows_on_kernel`: 64 on one AVX2 thread) the block kernel
    multiplies, beyond it a tile of weight rows at a time (`tiled_product`): on either side of the
    switch, for 2-D and 3-D inputs, with and without a bias, the product is x @ W.T in float32 of the
    blocks' own weights, within float32 rounding of the float64 product, as close as torch's own
    float32 product is."""
    rows = {"narrow": gguf_blocks.max_rows(), "wide": gguf_blocks.max_rows() + 1}.get(rows, rows)
    generator = np.random.default_rng(rows + 100 * with_bias)
    codes, weights = quantized(generator.standard_normal((WIDE_OUT, WIDE_IN)), kind)
    weight = BlockWeight(kind, torch.from_numpy(codes), WIDE_IN)
    assert gguf_blocks.tile_rows(WIDE_OUT) == 551  # two tiles of at most TILE_ROWS, the last one short
    x = torch.from_numpy(generator.standard_normal((1, rows, WIDE_IN)).astype(np.float32))  # [1, M, in]
    bias = torch.from_numpy(generator.standard_normal(WIDE_OUT).astype(np.float32)) if with_bias else None
    exact = x.double() @ weights.double().T + (0 if bias is None else bias.double())  # [1, M, out]
    torchs = float((torch.nn.functional.linear(x, weights, bias).double() - exact).abs().max())
    for shaped in (x, x[0]):  # [1, M, in] and [M, in]
        ours = block_linear(shaped, weight, bias, rows_on_kernel=rows_on_kernel)
        assert ours.shape == (*shaped.shape[:-1], WIDE_OUT)
        assert bool(((ours.double() - exact.view(ours.shape)).abs() <= rounding_bound(shaped, weights, bias)).all())
        assert float((ours.double() - exact.view(ours.shape)).abs().max()) <= 4 * torchs + 1e-6


def test_the_block_kernel_takes_forwards_up_to_64_tokens_only_on_one_avx2_thread():
    """The tiles' GEMM runs on every torch thread, the kernel on one: past a step's 16 tokens the
    kernel takes a forward only with torch on one thread, and only where that was measured (AVX2)."""
    assert gguf_blocks.kernel_rows(1, "AVX2") == 64
    assert gguf_blocks.kernel_rows(2, "AVX2") == gguf_blocks.kernel_rows(1, "AVX512") == 16
    assert gguf_blocks.kernel_rows(1, "DEFAULT") == 16  # the plain C build: a step's width


@needs_kernel
def test_a_wide_forward_takes_the_kernel_or_the_tiles_as_rows_on_kernel_says(monkeypatch):
    """37 rows: the kernel when the plan allows 64 rows on it, the tiles when it allows 16."""
    codes, _ = quantized(np.random.default_rng(5).standard_normal((64, 96)), "Q8_0")
    weight, x = BlockWeight("Q8_0", torch.from_numpy(codes), 96), torch.ones(37, 96)
    taken = []

    def noted(name):  # the real product, its name noted when it runs
        product = getattr(gguf_blocks, name)

        def run(*args, **kwargs):
            taken.append(name)
            return product(*args, **kwargs)
        return run

    for name in ("narrow_product", "tiled_product"):
        monkeypatch.setattr(gguf_blocks, name, noted(name))
    block_linear(x, weight, rows_on_kernel=64)
    block_linear(x, weight, rows_on_kernel=16)
    assert taken == ["narrow_product", "tiled_product"]


def test_a_wide_product_writes_out_one_tile_of_float32_weights_at_a_time():
    """A wide product's float32 weights are a tile of at most TILE_ROWS rows, never the whole
    matrix (the blocks replace the float32 copies), in as few tiles as can hold the rows, of one size."""
    assert gguf_blocks.TILE_ROWS == 1024
    assert [gguf_blocks.tile_rows(n) for n in (960, 3072, 49152, 1024, 1025, 100, 1)] == [
        960, 1024, 1024, 1024, 513, 100, 1]
    assert gguf_blocks.tile_rows(250, most=41) == 36  # 7 tiles: 6 of 36 and one of 34


def test_a_tile_of_wide_weights_holds_at_most_tile_bytes_of_float32():
    """Rows of 576 inputs (the embedded model) come 1,024 to a tile; a 1B model's 2,048 and 8,192
    inputs 512 and 128, so that no tile passes TILE_BYTES; never fewer than 16 rows."""
    assert gguf_blocks.TILE_BYTES == 4 << 20
    assert [gguf_blocks.tile_limit(k) for k in (576, 1536, 2048, 8192, 1 << 20)] == [1024, 682, 512, 128, 16]
    for k in (576, 2048, 8192):
        assert gguf_blocks.tile_limit(k) * k * 4 <= max(gguf_blocks.TILE_BYTES, 16 * k * 4)


@needs_kernel
def test_the_kernel_refuses_anything_but_float32_cpu_rows_of_its_width():
    codes, _ = quantized(np.ones((4, 64)), "Q4_1")
    weight = BlockWeight("Q4_1", torch.from_numpy(codes), 64)
    with pytest.raises(ValueError, match="float32 CPU"):
        block_linear(torch.ones(1, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="64 inputs"):
        block_linear(torch.ones(1, 96), weight)


def test_the_tensor_table_is_read_as_gguf_py_reads_it():
    """mdcli's own reader of the embedded .gguf (no metadata values parsed): every tensor's name,
    shape and bytes as gguf-py's full reader gives them."""
    ours = read_tensors(embedded_gguf_path())
    theirs = {t.name: t for t in GGUFReader(str(embedded_gguf_path())).tensors}
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].kind == tensor.tensor_type.name
        assert ours[name].shape == tuple(int(d) for d in reversed(tensor.shape))
        assert np.array_equal(ours[name].data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_a_file_that_is_not_gguf_is_refused_by_the_reader(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensors(path)


@needs_kernel
def test_the_embedded_models_forward_reads_its_gguf_blocks_and_stays_exact(embedded_float32):
    """The embedded_float32 SmolLM2 loads with its .gguf remembered; every projection and the head are its
    Q4_1 / Q8_0 blocks bit for bit (checked at load, and here for the head), the header says so, and
    three branches on the blocks give transformers' logits and generate's tokens."""
    assert embedded_float32.forward.plan.blocks == "Q4_1/Q8_0" and embedded_float32.forward.plan.blocks_reason is None
    assert embedded_float32.forward.own.blocks is not None  # the forward the loaded model carries reads them
    forward = own_forward(embedded_float32.model)
    assert forward.blocks is not None and forward.blocks_reason is None
    assert torch.equal(dequantize(forward.block_head), embedded_float32.model.lm_head.weight)
    assert "the .gguf's own blocks (q/k/v Q4_1, o Q4_1, gate/up Q4_1, down Q4_1, head Q8_0)" in header(embedded_float32, verbose=True)
    assert "blocks" not in header(embedded_float32)  # the short header names model, device and dtype only
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    questions = ("Who is Mara?", "How many steps are there?", "When does she climb?")
    prompts = [embedded_float32.tokenizer(f"{document}\nQuestion: {q}\nAnswer:")["input_ids"] for q in questions]
    worst, generated = lockstep_logits(embedded_float32.model, prompts, steps=8, drop_at=3)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for i in (0, 2):
        expected = generate_alone(embedded_float32.model, prompts[i], len(generated[i]))
        assert len(expected) >= 4 and generated[i][: len(expected)] == expected, f"branch {i}"


@needs_kernel
@pytest.mark.parametrize("arch", list(PERMUTED))
def test_tiny_gguf_models_decode_on_their_blocks_to_generates_tokens(arch, tmp_path):
    """A tiny model of each family mdcli's forward takes, its weights rounded to Q4_1 blocks written
    to a real .gguf (q and k rows as llama.cpp stores them for that family): the forward finds every
    matrix in the file, a forest with forks and a compaction gives transformers' logits at every step,
    and each branch decodes generate's tokens, on one branch and several."""
    model = tiny_model(arch, "sdpa")
    gguf_backed(model, tmp_path / f"{arch}.gguf", permute=PERMUTED[arch])
    forward = own_forward(model)
    assert forward.blocks is not None, forward.blocks_reason
    prompts = random_prompts(30, [4, 7, 2, 9, 5, 3, 6, 8, 2, 4, 7, 5], seed=3)  # 12 rows: more than one pass
    assert len(prompts) <= forward.block_rows or forward.block_rows == 8  # the AVX2 build takes 8
    worst, _ = lockstep_logits(model, prompts, steps=6, drop_at=2)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    engine = engine_for(model)
    assert engine.model_forward.own.blocks is not None and engine.model_forward.plan.blocks == "Q4_1/Q8_0"
    generated = greedy_forest(engine, prompts, steps=6)
    for prompt, tokens in zip(prompts, generated):
        assert tokens == generate_alone(model, prompt, len(tokens))
    alone = random_prompts(40, [5], seed=8)
    assert greedy_forest(engine_for(model), alone, steps=6)[0] == generate_alone(model, alone[0], 6)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_the_kernel_reads_decodes_to_generates_tokens(kind, tmp_path):
    """A tiny Llama whose projections and head are all `kind` in a real .gguf (llama.cpp's Q8_0,
    Q4_0, F16 and BF16 files are of this sort): the forward reads every matrix from the file, and
    each branch of a forest decodes generate's tokens with transformers' logits."""
    model = tiny_model("llama", "sdpa")
    gguf_backed(model, tmp_path / f"{kind}.gguf", kind=kind, head_kind=kind)
    forward = own_forward(model)
    assert forward.blocks is not None, forward.blocks_reason
    assert select(model).blocks == kind
    assert {w.kind for w in (*forward.blocks[0][0], forward.block_head)} == {kind}
    prompts = random_prompts(30, [4, 7, 2, 9], seed=6)
    worst, generated = lockstep_logits(model, prompts, steps=6)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for prompt, tokens in zip(prompts, generated):
        assert tokens == generate_alone(model, prompt, len(tokens))


@needs_kernel
def test_a_gguf_whose_blocks_are_not_the_models_weights_is_never_read(tmp_path):
    """One weight one float32 step off its block's value (a different model than the file): the
    check at load finds it, the forward keeps its float32 kernels, and the branches still decode
    generate's tokens."""
    model = tiny_model("llama", "sdpa")
    gguf_backed(model, tmp_path / "llama.gguf")
    with torch.no_grad():
        weight = model.model.layers[1].mlp.down_proj.weight
        weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(1.0))
    forward = own_forward(model)
    assert forward.blocks is None and forward.blocks_reason == "blk.1.ffn_down.weight is not the model's float32 weight"
    plan = select(model)
    assert plan.blocks is None and plan.blocks_reason == forward.blocks_reason and "blocks" not in plan.describe()
    prompts = random_prompts(30, [4, 7], seed=5)
    for prompt, tokens in zip(prompts, greedy_forest(engine_for(model), prompts, steps=6)):
        assert tokens == generate_alone(model, prompt, len(tokens))


@needs_kernel
def test_blocks_that_would_not_fit_in_half_the_free_memory_are_not_read(tmp_path):
    """The memory rule of the other weight copies (mdcli.backends.weights.packed): a machine with less free memory
    than twice the blocks (a host stated so: this test machine has plenty) keeps the float32 kernels."""
    model = tiny_model("llama", "sdpa")
    gguf_backed(model, tmp_path / "llama.gguf")
    read = Host.read()
    small = Host(read.machine, read.capability, read.vendor, read.threads, free_memory=lambda device: 2**10)
    plan = select(model, settings_with(), small)  # its blocks: ~0.1 MiB
    assert plan.blocks is None and "do not fit in half the free memory" in plan.blocks_reason
    assert "blocks" not in plan.describe()
    forward = FastForward(model, plan)
    assert forward.blocks is None and "do not fit in half the free memory" in forward.blocks_reason


@needs_kernel
def test_block_kinds_the_kernel_does_not_read_give_no_copy_and_say_which(tmp_path):
    model = tiny_model("llama", "sdpa")
    gguf_backed(model, tmp_path / "llama.gguf", head_kind="F32")
    forward = own_forward(model)
    assert forward.blocks is None and forward.blocks_reason == (
        "token_embd.weight is F32; mdcli's kernel reads Q4_1, Q8_0, Q4_0, F16, BF16, Q5_0, Q5_1, Q2_K, Q3_K, "
        "Q4_K, Q5_K, Q6_K")


@needs_kernel
def test_the_opt_out_and_other_settings_keep_the_float32_kernels(embedded_float32):
    """MDCLI_GGUF_BLOCKS=0, or transformers' own forward (MDCLI_FORWARD=transformers): no blocks read,
    and the header does not claim them."""
    off = select(embedded_float32.model, settings_with(gguf_blocks=False))
    assert off.blocks is None and off.blocks_reason is None
    assert FastForward(embedded_float32.model, off).blocks is None
    without = replace(embedded_float32, forward=ModelForward(embedded_float32.model, off, sliding_window=embedded_float32.sliding_window))
    assert without.forward.own.blocks is None
    assert "blocks" not in header(without, verbose=True) and "kernels" in header(without, verbose=True)
    reference = select(embedded_float32.model, settings_with(forward="transformers"))
    assert reference.blocks is None and not reference.own_forward
    assert "blocks" not in reference.describe()
    assert select(embedded_float32.model).blocks == "Q4_1/Q8_0"  # the model's own plan is untouched by either


def test_without_a_compiler_there_is_no_kernel_and_the_forward_stays_exact(monkeypatch, tmp_path):
    """No C compiler and an empty cache folder: nothing to build, no blocks, generate's tokens."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama", "sdpa")
    gguf_blocks.library.cache_clear()
    gguf_blocks.blocks_work.cache_clear()
    try:
        assert gguf_blocks.library() is None and not gguf_blocks.blocks_work()
        remember_source(model, tmp_path / "unread.gguf")  # never opened: no kernel
        plan = select(model)
        assert plan.blocks is None and FastForward(model, plan).blocks is None
        assert FastForward(model, replace(plan, blocks="Q4_1/Q8_0")).blocks is None  # even when the plan names them
        prompts = random_prompts(30, [5, 9], seed=4)
        for prompt, tokens in zip(prompts, greedy_forest(engine_for(model), prompts, steps=6)):
            assert tokens == generate_alone(model, prompt, len(tokens))
    finally:
        monkeypatch.undo()
        gguf_blocks.library.cache_clear()
        gguf_blocks.blocks_work.cache_clear()
