"""The files users download, on their own bytes: K-quant (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K),
Q5_0/Q5_1 and 16-bit .gguf files load on their blocks with no float32 copy, every matrix is
transformers' own float32 load of the same file bit for bit, and every branch of a forest decodes
`generate`'s tokens on that load. The files are written here with random codes
(benchmarks/random_gguf.py, typed tensor by tensor as llama-quantize types them), small enough to
run in seconds.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.random_gguf import MIXES, tensor_kind, write
from mdcli.backends.native import build
from mdcli.backends.select import select
from mdcli.backends.weights import gguf_blocks, gguf_reading
from mdcli.backends.weights.gguf_blocks import BlockWeight, JoinedBlocks, block_linear, dequantize, matches
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, random_blocks, type_name
from mdcli.models.on_blocks import load_on_blocks
from tests.reference import generate_alone
from tests.test_engine_exactness import VOCAB, engine_for, greedy_forest, random_prompts
from tests.test_gguf_blocks import needs_kernel, rounding_bound

# (hidden, layers, intermediate, heads, kv heads): rows of 256 (whole super-blocks), and rows of
# 320, which llama.cpp writes in Q5_0/Q5_1/Q8_0 instead (the down projection's 512 stay K-quants)
WHOLE, FALLBACK = (256, 3, 512, 4, 2), (320, 2, 512, 5, 1)
FILE_KINDS = [*MIXES, "Q5_0", "Q5_1", "F16", "BF16"]


@needs_kernel
@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_every_kind_is_rebuilt_into_gguf_pys_weights_bit_for_bit(kind):
    """Random codes and scales in every field: a code read from the wrong nibble or bit plane, or a
    scale from the wrong byte, would differ from gguf-py's dequantization somewhere."""
    rng = np.random.default_rng(7)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 24, 512, rng)), 512)
    expected = gguf_blocks.reference_weights(weight)
    assert torch.equal(dequantize(weight), expected)
    assert matches(weight, expected)
    nudged = expected.clone()
    nudged[23, 511] = torch.nextafter(nudged[23, 511], torch.tensor(np.inf))  # the very last weight
    assert not matches(weight, nudged)


@needs_kernel
@pytest.mark.parametrize("kind", KERNEL_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40])
def test_products_of_every_kind_are_float32_products_of_its_weights(kind, rows):
    """Every pass size (the narrow passes, among them those that read codes in lane order: Q4_K's
    and Q5_K's at 1-4 rows, one row in 64-byte spans, Q2_K's, Q3_K's and Q6_K's at 1-8; the shared rebuilds, the wide panels
    and the tiles of a prefill) over 768 inputs (three super-blocks; two spans of 24 blocks):
    within float32 rounding of the float64 product."""
    rng = np.random.default_rng(rows)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 37, 768, rng)), 768)
    weights = gguf_blocks.reference_weights(weight)
    x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
    exact = x.double() @ weights.double().T
    for rows_on_kernel in (16, 64):  # 17 and 40 rows: tile by tile, then on the kernel's panels
        ours = block_linear(x, weight, rows_on_kernel=rows_on_kernel)
        assert bool(((ours.double() - exact).abs() <= rounding_bound(x, weights)).all())


@needs_kernel
@pytest.mark.parametrize("kind", KERNEL_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_a_weight_row_gives_the_same_numbers_read_alone_or_beside_its_neighbour(kind, rows):
    """The narrow passes (up to 8 rows of x) take two K-quant weight rows a pass: each output is
    summed as it is with its weight row alone, bit for bit (37 rows: 18 pairs and one left over),
    so that no output depends on where a thread's run of rows begins."""
    rng = np.random.default_rng(rows)
    blocks = torch.from_numpy(random_blocks(kind, 37, 768, rng))
    x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
    together = block_linear(x, BlockWeight(kind, blocks, 768))
    for row in range(37):
        alone = block_linear(x, BlockWeight(kind, blocks[row : row + 1], 768))
        assert torch.equal(together[:, row : row + 1], alone), row


@needs_kernel
def test_a_matrix_joined_from_parts_of_different_kinds_fills_each_parts_columns():
    """q, k and v of a Q4_K_M layer (Q4_K, Q4_K, Q6_K) multiplied as one: the same numbers as each
    part alone, side by side, at a decode step's width and a prefill's, for inputs [in], [M, in]
    and [1, M, in] (a step writes each part straight into its columns of the [..., M, out] output)."""
    rng = np.random.default_rng(3)
    parts = tuple(BlockWeight(kind, torch.from_numpy(random_blocks(kind, rows, 256, rng)), 256)
                  for kind, rows in (("Q4_K", 64), ("Q6_K", 32), ("Q5_0", 32)))
    joined = JoinedBlocks(parts)
    assert joined.shape == (128, 256) and joined.kinds == ("Q4_K", "Q6_K", "Q5_0")
    for rows in (1, 6, 100):
        x = torch.from_numpy(rng.standard_normal((rows, 256)).astype(np.float32))
        alone = torch.cat([block_linear(x, part) for part in parts], dim=1)
        assert torch.equal(block_linear(x, joined), alone)
        assert torch.equal(block_linear(x[None], joined), alone[None])
    lone = torch.from_numpy(rng.standard_normal(256).astype(np.float32))
    assert torch.equal(block_linear(lone, joined), torch.cat([block_linear(lone[None], part)[0] for part in parts]))


def written(kind: str, shape, folder: Path, seed: int = 0) -> Path:
    return write(folder / f"{kind}.gguf", kind, shape, seed=seed, vocab=VOCAB)


def transformers_load(path: Path):
    """transformers' own float32 load of the file: gguf-py's dequantization of every tensor."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@needs_kernel
@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("shape", [WHOLE, FALLBACK], ids=["rows-of-256", "rows-of-320"])
def test_a_downloaded_files_type_loads_on_its_blocks_and_decodes_generates_tokens(kind, shape, tmp_path):
    """The file's every matrix stays in its own type (no float32 projection, head or embedding),
    each one dequantized by the kernel is transformers' float32 weight bit for bit, and a forest
    of branches (a prefill wider than the kernel's rows included) decodes to `generate` on
    transformers' load, branch by branch."""
    path = written(kind, shape, tmp_path)
    reference = transformers_load(path)
    model, why = load_on_blocks(path, reference.config, "sdpa")
    assert why is None, why
    assert model.model.layers[0].mlp.up_proj.weight.is_meta and model.model.embed_tokens.weight.is_meta
    layers, head = gguf_reading.model_blocks(model)
    for layer, theirs in zip(layers, reference.model.layers):
        attention, mlp = theirs.self_attn, theirs.mlp
        for ours, linears in zip(layer, ([attention.q_proj, attention.k_proj, attention.v_proj], [attention.o_proj],
                                         [mlp.gate_proj, mlp.up_proj], [mlp.down_proj])):
            parts = ours.parts if isinstance(ours, JoinedBlocks) else (ours,)
            rebuilt = torch.cat([dequantize(part) for part in parts])
            assert torch.equal(rebuilt, torch.cat([linear.weight for linear in linears]))
    assert torch.equal(dequantize(head), reference.lm_head.weight)
    plan = select(model)
    assert plan.on_blocks and "float32" not in plan.blocks_held and "type " not in plan.blocks_held
    engine = engine_for(model)
    prompts = random_prompts(20, [3, 6, 2, 5], seed=4)
    for prompt, tokens in zip(prompts, greedy_forest(engine, prompts, steps=5)):
        assert tokens == generate_alone(reference, prompt, len(tokens))
    long = random_prompts(40, [30], seed=5)  # 70 tokens: a prefill past the kernel's rows, on its GEMM or tiles
    assert greedy_forest(engine_for(model), long, steps=4)[0] == generate_alone(reference, long[0], 4)


def test_a_q4_k_m_file_is_typed_as_llama_quantize_types_it():
    """Q6_K for the value and down projections of the first and last eighth of the layers and every
    third between, Q4_K elsewhere, Q6_K for the head; Q5_0 (Q8_0 where Q6_K was due) for rows that
    are not whole super-blocks."""
    kinds = [tensor_kind("Q4_K_M", "ffn_down", layer, 16, 2048) for layer in range(16)]
    assert [layer for layer, kind in enumerate(kinds) if kind == "Q6_K"] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert tensor_kind("Q4_K_M", "attn_q", 4, 16, 2048) == "Q4_K"
    assert tensor_kind("Q4_K_M", "token_embd", None, 16, 2048) == "Q6_K"
    assert tensor_kind("Q4_K_M", "attn_q", 4, 16, 576) == "Q5_0"
    assert tensor_kind("Q4_K_M", "attn_v", 0, 16, 576) == "Q8_0"


def test_tensor_types_are_named_as_ggml_names_them():
    assert [type_name(n) for n in (6, 7, 12, 14, 30)] == ["Q5_0", "Q5_1", "Q4_K", "Q6_K", "BF16"]
    assert type_name(999) == "type 999"


def half_folder(arch: str, dtype: torch.dtype, folder: Path, *, tied: bool = True) -> Path:
    """A tiny `arch` model saved as a Hugging Face folder in `dtype` (bf16 or f16), with a tokenizer."""
    from tests.test_engine_exactness import tiny_config
    from tests.tiny_models import tiny_tokenizer

    config = tiny_config(arch)
    config.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@needs_kernel
@pytest.mark.parametrize("arch, dtype, tied", [("llama", torch.bfloat16, True), ("qwen2", torch.bfloat16, False),
                                               ("llama", torch.float16, False)])
def test_a_16_bit_folder_stays_16_bit_and_decodes_the_float32_loads_tokens(arch, dtype, tied, tmp_path):
    """bf16 and f16 safetensors (Qwen2's biases, an untied head) are kept in their own 2 bytes and
    widened in the kernel: no float32 projection, head or embedding exists, the weights held are
    about the file's size, and every branch decodes `generate`'s tokens on transformers' float32
    load of the same folder (the widening is exact)."""
    from mdcli.models.load import load_model

    folder = half_folder(arch, dtype, tmp_path / "model", tied=tied)
    loaded = load_model(str(folder), quiet=True, prompt_cache="off")
    plan = loaded.forward.plan
    assert plan.on_blocks and plan.float32_reason == "", plan.float32_reason
    kind = "BF16" if dtype == torch.bfloat16 else "F16"
    assert plan.blocks == kind and f"head {kind}" in plan.blocks_held
    assert all(p.is_meta for name, p in loaded.model.named_parameters() if name.endswith("proj.weight"))
    held = sum(loaded.forward.weight_bytes().values())
    assert held <= 1.05 * sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    prompts = random_prompts(20, [3, 6, 2, 5], seed=4)
    for prompt, tokens in zip(prompts, greedy_forest(engine_for(loaded.model), prompts, steps=5)):
        assert tokens == generate_alone(reference, prompt, len(tokens))


def test_a_float32_folder_loads_as_before_and_gives_no_reason(tmp_path):
    from mdcli.models.load import load_model

    folder = half_folder("llama", torch.float32, tmp_path / "model")
    plan = load_model(str(folder), quiet=True, prompt_cache="off").forward.plan
    assert not plan.on_blocks and plan.float32_reason == ""


@needs_kernel
def test_a_16_bit_folder_keeps_float32_weights_when_asked_and_says_why(tmp_path):
    from mdcli.models.load import load_model

    folder = half_folder("llama", torch.bfloat16, tmp_path / "model")
    plan = load_model(str(folder), quiet=True, prompt_cache="off", keep_float32=True).forward.plan
    assert not plan.on_blocks and "keep" in plan.float32_reason


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q6_K", "BF16"])
def test_products_are_the_same_numbers_on_any_thread_count(kind):
    """With torch on several threads the kernel splits a product's weight rows among them, each run
    by the same code into its own columns: bit for bit the one-thread product, at a decode step's
    widths and a prefill's."""
    rng = np.random.default_rng(11)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 301, 512, rng)), 512)
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 5, 8, 12, 40):
            x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
            torch.set_num_threads(1)
            alone = block_linear(x, weight, rows_on_kernel=64)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(block_linear(x, weight, rows_on_kernel=64), alone), (rows, threads)
    finally:
        torch.set_num_threads(before)


def test_a_16_bit_folder_loaded_in_bf16_keeps_transformers_weights_and_says_nothing_of_float32(tmp_path):
    from mdcli.models.load import load_model

    folder = half_folder("llama", torch.bfloat16, tmp_path / "model")
    loaded = load_model(str(folder), quiet=True, prompt_cache="off", dtype="bfloat16")
    assert not loaded.forward.plan.on_blocks and loaded.forward.plan.float32_reason == ""
    assert loaded.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


@needs_kernel
def test_mdcli_info_names_what_each_matrix_of_a_q4_k_m_file_is_held_as(tmp_path):
    """The plan a user reads: each matrix by ggml's type name, the file's own bytes, no float32."""
    from typer.testing import CliRunner

    from mdcli.cli.app import app

    path = write(tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M", WHOLE)  # with the embedded model's tokenizer
    result = CliRunner().invoke(app, ["info", "-m", str(path)])
    assert result.exit_code == 0, result.output
    assert "weights held as: q/k/v Q4_K or Q4_K+Q6_K, o Q4_K, gate/up Q4_K, down Q4_K or Q6_K, head Q6_K" in result.output
    assert "type " not in result.output and "float32 weights loaded" not in result.output
    # and, where this host's kernel has them, that a lone token's K-quant products read x in digits
    assert ("K-quant products on x in 23-bit fixed point (MDCLI_BLOCK_DIGITS)" in result.output) == gguf_blocks.reads_digits()


@needs_kernel
@pytest.mark.skipif(build.x86_capability() != "AVX512", reason="the AVX2 build beside this host's own: an AVX-512 host")
def test_the_avx2_build_rebuilds_and_multiplies_every_kind_as_gguf_py_weights_are():
    """The AVX2 build of the same source (8 lanes; no tables, no lane order; Q2_K's, Q3_K's and
    the other K-quants' scales unpacked in its own registers), on an AVX-512 host where the tests
    above run the AVX-512 build: every kind rebuilt into gguf-py's weights bit for bit, and its
    products at 1-9 rows (its passes of up to 4 rows, its shared rebuilds, its panels) within
    float32 rounding of the float64 product (on an AVX2 host the tests above run this build)."""
    lib = gguf_blocks.bound(build.load(gguf_blocks.SOURCE, build.X86_FLAGS["AVX2"]))
    rng = np.random.default_rng(11)
    for kind in KERNEL_KINDS:
        weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 37, 768, rng)), 768)
        expected = gguf_blocks.reference_weights(weight)
        rebuilt = torch.empty(37, 768)
        getattr(lib, f"{kind.lower()}_dequantize")(weight.data.data_ptr(), 37, 768, rebuilt.data_ptr())
        assert torch.equal(rebuilt, expected), kind
        for rows in (1, 2, 3, 4, 5, 9):
            x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
            ours = built_product(lib, kind, weight.data, x)
            exact = x.double() @ expected.double().T
            assert bool(((ours.double() - exact).abs() <= rounding_bound(x, expected)).all()), (kind, rows)


@cache
def digits_build():
    """The block kernel built with one-row products on x in digits (gguf_blocks.c, x_digits), on any
    host whose CPU has AVX-512 VNNI (the default build on a Zen 5 core: build.host_defines); None elsewhere."""
    from mdcli.backends.host import cpuinfo_fields

    if build.x86_capability() != "AVX512" or "avx512_vnni" not in cpuinfo_fields().get("flags", "").split():
        return None
    lib = build.load(gguf_blocks.SOURCE, (*build.X86_FLAGS["AVX512"], "-DX_DIGITS=1", "-mavx512vnni"))
    return None if lib is None else gguf_blocks.bound(lib)


@cache
def avx512_build():
    """The block kernel's AVX-512 build with no host kind's settings: every product in float32."""
    return gguf_blocks.bound(build.load(gguf_blocks.SOURCE, build.X86_FLAGS["AVX512"]))


def built_product(lib, kind: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x ([m, k]) times the weight rows in `blocks`, straight into the build `lib`: [m, rows]."""
    (m, k), rows = x.shape, blocks.shape[0]
    out, scratch = torch.empty(m, rows), torch.empty(lib.scratch_floats(k))
    lib.products[kind](x.data_ptr(), m, k, blocks.data_ptr(), rows, out.data_ptr(), rows, scratch.data_ptr())
    return out


def held_as_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the digits hold it: per block of 32, its nearest multiple (ties to even) of the block's
    unit 2^(e - 22), 2^e above the block's largest |x| (e at least -100); and each input's unit."""
    blocks = x.double().reshape(-1, gguf_blocks.BLOCK)
    largest = blocks.abs().max(dim=1).values.numpy()
    e = np.maximum(np.where(largest > 0, np.frexp(largest)[1], -100), -100)
    unit = torch.from_numpy(np.ldexp(1.0, e - 22))[:, None].expand_as(blocks)
    return (torch.round(blocks / unit) * unit).reshape(x.shape), unit.reshape(x.shape)


DIGIT_KINDS = list(gguf_blocks.DIGIT_KINDS)  # the kinds whose one-row products read x in digits


def awkward_inputs(rng, k: int) -> dict[str, torch.Tensor]:
    """One row each: ordinary inputs, a large feature every 97 (1,000x, as models' activations have),
    a block spanning 2^30, a block of zeros beside one of float32's subnormals, and inputs near 2^100."""
    plain = rng.standard_normal(k).astype(np.float32)
    spiky = np.where(np.arange(k) % 97 == 0, 1000 * plain, plain).astype(np.float32)
    spanning = plain.copy()
    spanning[:32] = np.ldexp(np.sign(plain[:32]), np.arange(32) % 31 - 15)  # 2^-15 .. 2^15 in one block
    quiet = plain.copy()
    quiet[:32], quiet[32:64] = 0.0, 1e-40 * plain[32:64]
    loud = np.ldexp(plain, 100).astype(np.float32)
    named = {"plain": plain, "spiky": spiky, "spanning": spanning, "zeros and subnormals": quiet, "loud": loud}
    return {name: torch.from_numpy(v)[None] for name, v in named.items()}


needs_digits = pytest.mark.skipif(digits_build() is None, reason="the digits build needs AVX-512 VNNI and a C compiler")


@needs_digits
@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_one_row_on_x_in_digits_is_the_weights_product_with_x_rounded_to_its_blocks_unit(kind):
    """Every term of a one-row product in digits reads x rounded to its block's unit, so the product
    is the float32 weights' product with that x within float32 rounding (a digit or a unit in the
    wrong place moves it by about |w x| itself, far past it), and within that rounding plus sum |w| *
    unit / 2 of x's own product: what docs/how-it-works.md promises."""
    lib, rng = digits_build(), np.random.default_rng(17)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 41, 768, rng)), 768)
    weights = gguf_blocks.reference_weights(weight)
    for name, x in awkward_inputs(rng, 768).items():
        ours = built_product(lib, kind, weight.data, x).double()
        rounded, unit = held_as_digits(x)
        assert bool(((ours - rounded @ weights.double().T).abs() <= rounding_bound(rounded, weights)).all()), name
        bound = rounding_bound(x, weights) + (unit / 2) @ weights.double().abs().T
        assert bool(((ours - x.double() @ weights.double().T).abs() <= bound).all()), name


@needs_digits
@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_an_input_far_below_its_blocks_largest_reads_as_zero_in_digits(kind):
    """Inputs 2^24 times smaller than their block's largest fall below half its unit: the product is
    bit for bit that of x with them set to zero, where the float32 passes see them. What the digits
    give up, and all they give up: one of four units counts."""
    lib, rng = digits_build(), np.random.default_rng(5)
    float32 = avx512_build()
    blocks = torch.from_numpy(random_blocks(kind, 9, 512, rng))
    faint = torch.arange(512) % 32 != 0
    x = torch.from_numpy((rng.uniform(1.0, 2.0, 512) * np.sign(rng.standard_normal(512))).astype(np.float32))[None]
    x[0, faint] *= 2.0**-24
    x[0, ~faint] = 1.0  # each block's largest: its unit 2^-21
    silenced = x.clone()
    silenced[0, faint] = 0.0
    assert torch.equal(built_product(lib, kind, blocks, x), built_product(lib, kind, blocks, silenced))
    assert not torch.equal(built_product(float32, kind, blocks, x), built_product(float32, kind, blocks, silenced))
    x[0, 1] = 2.0**-19  # four units: no longer silent
    assert not torch.equal(built_product(lib, kind, blocks, x), built_product(lib, kind, blocks, silenced))


@needs_digits
@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_a_row_holding_an_infinity_or_a_nan_takes_the_float32_products(kind):
    """No digits for a number without a block unit: x with an infinity or a NaN is multiplied by
    the float32 passes, as the build without digits multiplies it (the infinities and NaNs where they fall)."""
    lib, float32 = digits_build(), avx512_build()
    rng = np.random.default_rng(2)
    blocks = torch.from_numpy(random_blocks(kind, 13, 512, rng))
    for odd in (float("inf"), float("-inf"), float("nan")):
        x = torch.from_numpy(rng.standard_normal(512).astype(np.float32))[None]
        x[0, 300] = odd
        ours, theirs = built_product(lib, kind, blocks, x), built_product(float32, kind, blocks, x)
        assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num()), odd


@needs_digits
@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_a_row_in_digits_gives_the_same_numbers_alone_beside_its_neighbour_and_on_any_thread_count(kind):
    """Weight rows are split among threads in runs: each output is summed as its weight row alone
    sums it, bit for bit, so no output depends on where a run begins or how many threads run."""
    lib, rng = digits_build(), np.random.default_rng(23)
    blocks = torch.from_numpy(random_blocks(kind, 301, 512, rng))
    x = torch.from_numpy(rng.standard_normal(512).astype(np.float32))[None]
    before = torch.get_num_threads()
    try:
        build.use_threads(1)
        together = built_product(lib, kind, blocks, x)
        for row in (0, 1, 150, 299, 300):
            assert torch.equal(built_product(lib, kind, blocks[row : row + 1], x), together[:, row : row + 1]), row
        for threads in (2, 3):
            build.use_threads(threads)
            assert torch.equal(built_product(lib, kind, blocks, x), together), threads
    finally:
        build.use_threads(before)


@needs_kernel
def test_block_digits_off_keeps_every_one_row_product_in_float32(monkeypatch):
    """MDCLI_BLOCK_DIGITS=off: the kernel is built without digits on every host kind, so a one-row
    K-quant product is the float32 passes' own (on a host whose default build has digits, not its)."""
    from mdcli.backends.host import cpuinfo_fields

    rng = np.random.default_rng(31)
    weight = BlockWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", 37, 768, rng)), 768)
    x = torch.from_numpy(rng.standard_normal((1, 768)).astype(np.float32))
    float32 = gguf_blocks.bound(build.load_any(gguf_blocks.SOURCE, openmp=True, defines=build.host_defines(
        cpuinfo_fields(), build.x86_capability(), digits=False)))
    monkeypatch.setenv("MDCLI_BLOCK_DIGITS", "off")
    gguf_blocks.library.cache_clear()
    try:
        off = block_linear(x, weight)
        assert torch.equal(off, built_product(float32, "Q4_K", weight.data, x)) and not gguf_blocks.reads_digits()
        if digits_build() is not None:
            assert not torch.equal(off, built_product(digits_build(), "Q4_K", weight.data, x))
    finally:
        monkeypatch.undo()
        gguf_blocks.library.cache_clear()


@needs_kernel
def test_a_host_setting_the_compiler_refuses_leaves_the_kernel_built_without_it(monkeypatch):
    """A host kind's settings are flags for the compiler; where it refuses one (an older compiler
    without -mavx512vnni, say) the kernel is built without them, not lost."""
    monkeypatch.setattr(build, "host_defines", lambda *args, **kwargs: ("-mno-such-flag-anywhere",))
    gguf_blocks.library.cache_clear()
    try:
        lib = gguf_blocks.library()
        assert lib is not None and not gguf_blocks.reads_digits()
        rng = np.random.default_rng(4)
        weight = BlockWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", 5, 256, rng)), 256)
        x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
        exact = x.double() @ gguf_blocks.reference_weights(weight).double().T
        assert bool(((block_linear(x, weight).double() - exact).abs()
                     <= rounding_bound(x, gguf_blocks.reference_weights(weight))).all())
    finally:
        monkeypatch.undo()
        gguf_blocks.library.cache_clear()
