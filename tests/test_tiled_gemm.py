"""mdcli's small-row kernel (mdcli.backends.weights.tiled) computes x @ W.T, and the forward on it is exact.

Evidence: the kernel against torch's product on every row count it branches on, partial last
tiles and biases (hypothesis); the same forest decoded on transformers' forward and on mdcli's with
the tiled copy, logits within float32 rounding at every step and each branch's greedy tokens those
of `generate`, on tiny models of every supported family and the real embedded model; without a
C compiler mdcli keeps its other kernels and stays exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdcli.backends.llama import FastForward
from mdcli.backends.select import select
from mdcli.backends.weights import tiled as tiled_gemm
from mdcli.backends.weights.tiled import TILED_MAX_ROWS
from tests.reference import generate_alone
from tests.test_engine_exactness import (
    engine_for,
    greedy_forest,
    random_prompts,
    settings_with,
    tiny_model,
)
from tests.test_llama_forward import SUPPORTED, lockstep_logits

# Only the CPU or a missing compiler decides the skip: a kernel that builds but computes wrongly fails.
needs_kernel = pytest.mark.skipif(not tiled_gemm._cpu_has_avx2_fma() or tiled_gemm.library() is None,
                                  reason="needs an x86-64 CPU with AVX2 and a C compiler")


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), inner=st.integers(1, 70), out=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tiled_product_equals_torchs_for_any_rows_sizes_and_bias(rows, inner, out, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inner, generator=generator)
    b = torch.randn(out, generator=generator) if bias else None
    x = torch.randn(2, rows, inner, generator=generator)[1]  # a view: the kernel must not assume its base
    got = tiled_gemm.tiled_linear(x, tiled_gemm.tile(weight), b)
    expected = x @ weight.T + (b if bias else 0)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_tiles_hold_the_weight_column_blocks_padded_with_zeros():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # 20 outputs: a full tile and 4 of the next
    tiled = tiled_gemm.tile(weight)
    assert tiled.tiles.shape == (2, 3, tiled_gemm.TILE) and tiled.out_features == 20
    assert torch.equal(tiled.tiles[0], weight[:16].T)
    assert torch.equal(tiled.tiles[1, :, :4], weight[16:].T) and not tiled.tiles[1, :, 4:].any()


@needs_kernel
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_tiled_forwards_give_transformers_logits_and_generate_tokens(arch, packed):
    """Forwards of 2-16 tokens (prefill pieces, three branches, then two after a compaction) on the
    tiled copy; a lone branch's steps on it too (no transposed copy)."""
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(41, [6, 2, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=8, drop_at=3, packed=packed, transposed=False,
                               max_forward_tokens=TILED_MAX_ROWS, tiled=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    alone = random_prompts(40, [5], seed=7)
    worst, generated = lockstep_logits(model, alone, steps=8, packed=packed, transposed=False, tiled=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert generated[0] == generate_alone(model, alone[0], 8)


@needs_kernel
def test_real_model_branches_on_the_tiled_copy_give_generate_tokens(embedded_float32):
    """The embedded_float32 SmolLM2, four questions over one document: every step's products on the tiled
    copy, logits within float32 rounding of transformers' forward, each branch's tokens generate's
    (up to its end of text: the lockstep decodes on past it)."""
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    questions = ["Who is Mara?", "What did Mara climb?", "When did she climb?", "How many steps?"]
    prompts = [embedded_float32.tokenizer(f"{document}\nQuestion: {q}\nAnswer:")["input_ids"] for q in questions]
    worst, generated = lockstep_logits(embedded_float32.model, prompts, steps=8, transposed=False,
                                       tiled=True, blocks=None)  # the tiled copy, not the .gguf's blocks
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    compared = 0
    for prompt, tokens in zip(prompts, generated):
        expected = generate_alone(embedded_float32.model, prompt, len(tokens))  # stops at the end of the answer
        assert tokens[: len(expected)] == expected
        compared += len(expected)
    assert compared >= 12


def test_without_a_compiler_the_forward_keeps_its_other_kernels_and_stays_exact(monkeypatch, tmp_path):
    """No C compiler (CC names none) and an empty cache folder: nothing to load, no tiled copy, even
    when asked for with MDCLI_TILED_GEMM=always; every branch still decodes generate's tokens."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    always = settings_with(tiled_gemm="always")
    tiled_gemm.library.cache_clear()
    try:
        assert tiled_gemm.library() is None and not tiled_gemm.tiled_works()
        model = tiny_model("llama", "sdpa")
        plan = select(model, always)
        assert not plan.tiled and "tiled kernel" not in plan.describe()
        assert not FastForward(model, plan).tiled
        engine = engine_for(model, settings=always)
        assert not engine.model_forward.own.tiled
        prompts = random_prompts(30, [5, 9], seed=4)
        generated = greedy_forest(engine, prompts, steps=6)
        for prompt, tokens in zip(prompts, generated):
            assert tokens == generate_alone(model, prompt, len(tokens))
    finally:
        monkeypatch.undo()
        tiled_gemm.library.cache_clear()


@needs_kernel
def test_the_kernel_is_compiled_once_into_the_cache_folder_and_reloaded(monkeypatch, tmp_path):
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path))
    tiled_gemm.library.cache_clear()
    try:
        assert tiled_gemm.library() is not None
        built = list((tmp_path / "kernels").glob("tiled_gemm-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob(".tmp-*"))
        stamp = built[0].stat().st_mtime_ns
        tiled_gemm.library.cache_clear()
        assert tiled_gemm.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        monkeypatch.undo()
        tiled_gemm.library.cache_clear()


def test_the_kernel_refuses_anything_but_float32_cpu_tensors():
    """It reads raw float32 memory: another dtype must fail loudly, never be multiplied wrongly."""
    weight = torch.randn(16, 8)
    with pytest.raises(ValueError, match="float32 CPU"):
        tiled_gemm.tiled_linear(torch.randn(2, 8, dtype=torch.float64), tiled_gemm.tile(weight))


def test_mdcli_tiled_gemm_always_and_off_decide_on_this_host():
    """=always makes the tiled copy wherever the kernel runs here (this host's own probe), =off never."""
    model = tiny_model("llama", "sdpa")
    always = select(model, settings_with(tiled_gemm="always"))
    assert always.tiled == tiled_gemm.tiled_works() == FastForward(model, always).tiled
    off = select(model, settings_with(tiled_gemm="off"))
    assert not off.tiled and not FastForward(model, off).tiled and "tiled kernel" not in off.describe()
