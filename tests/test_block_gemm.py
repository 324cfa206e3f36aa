"""The block kernel's own GEMM for a prefill (gguf_blocks.c, "A prefill's products"; AVX-512 builds):
the products of every kind are float32 products of the blocks' own weights, at any row count and
width, into the columns they are given, the same numbers on any thread count; it runs on torch's
OpenMP threads; the plan takes it only where it was measured; and forwards on it decode `generate`'s
tokens.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mdcli import settings as settings_module
from mdcli.backends.host import cpu_capability, cpu_vendor
from mdcli.backends.native import build as native
from mdcli.backends.select import select
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights.gguf_blocks import BlockWeight, block_linear, gemm_product
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, random_blocks
from mdcli.models.on_blocks import load_on_blocks
from tests.reference import generate_alone
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts
from tests.test_gguf_blocks import rounding_bound
from tests.test_kquant_files import WHOLE, transformers_load, written

# only whether this build has the GEMM decides the skip (AVX-512 builds do): a GEMM that disagreed
# with the blocks' weights must fail these tests, and it would also fail the check at load
needs_gemm = pytest.mark.skipif(gguf_blocks.library() is None or not gguf_blocks.library().wides,
                                reason="the block kernel has its own GEMM in AVX-512 builds only")


@needs_gemm
@pytest.mark.parametrize("kind", KERNEL_KINDS)
@pytest.mark.parametrize("rows", [17, 40, 300])
@pytest.mark.parametrize("shape", [(37, 512), (300, 768)], ids=["one-short-panel", "two-runs-and-a-short-one"])
def test_the_gemm_gives_float32_products_of_every_kinds_weights_into_its_columns(kind, rows, shape):
    """Rows in groups of 14 and a short one (17, 40, 300), weight rows in panels of 32 and runs of 128
    with a short last one, inputs in spans of 256 (768: three; 512: two): within float32 rounding of
    the float64 product of gguf-py's weights, written into the given columns of a wider output and
    nowhere else."""
    out_features, inputs = shape
    rng = np.random.default_rng(rows + out_features)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, out_features, inputs, rng)), inputs)
    weights = gguf_blocks.reference_weights(weight)
    x = torch.from_numpy(rng.standard_normal((rows, inputs)).astype(np.float32))
    out = torch.full((rows, out_features + 5), torch.nan)
    gemm_product(x, weight, out, start=3)
    exact = x.double() @ weights.double().T
    assert bool(((out[:, 3:3 + out_features].double() - exact).abs() <= rounding_bound(x, weights)).all())
    assert bool(out[:, :3].isnan().all() and out[:, 3 + out_features:].isnan().all())


@needs_gemm
def test_legacy_rows_whose_inputs_end_in_a_short_span_are_multiplied_whole():
    """576 inputs (the embedded model's rows: spans of 256, 256 and 64) of Q4_1 and Q8_0."""
    rng = np.random.default_rng(3)
    for kind in ("Q4_1", "Q8_0"):
        weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 70, 576, rng)), 576)
        x = torch.from_numpy(rng.standard_normal((33, 576)).astype(np.float32))
        weights = gguf_blocks.reference_weights(weight)
        ours = block_linear(x, weight, rows_on_kernel=16, own_gemm=True)
        assert bool(((ours.double() - x.double() @ weights.double().T).abs() <= rounding_bound(x, weights)).all())


@needs_gemm
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "BF16"])
def test_the_gemm_gives_the_same_numbers_on_any_thread_count(kind):
    """Each run of 128 weight rows is multiplied by the same code into its own columns, whichever
    thread takes it: bit for bit the one-thread product on 2 and 3 threads."""
    rng = np.random.default_rng(5)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 301, 512, rng)), 512)
    x = torch.from_numpy(rng.standard_normal((45, 512)).astype(np.float32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = block_linear(x, weight, rows_on_kernel=16, own_gemm=True)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(block_linear(x, weight, rows_on_kernel=16, own_gemm=True), alone), threads
    finally:
        torch.set_num_threads(before)


@needs_gemm
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's mappings in /proc")
def test_the_gemms_threads_are_torchs_openmp_threads():
    """Built with OpenMP, the kernel binds the libgomp.so.1 torch loaded: one GNU OpenMP runtime in
    the process, not a second set of threads beside torch's."""
    assert gguf_blocks.library().gemm_parallel() == 1
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith("/libgomp.so.1")}
    assert len(mapped) == 1 and "torch" in next(iter(mapped)), mapped


def test_the_plan_takes_the_gemm_on_avx512_with_mdclis_kernels_only(tmp_path):
    """A model on its blocks multiplies wide forwards on the kernel's own GEMM where torch dispatches
    to AVX-512 on an AMD core (where it was measured), the GEMM passes its check at load and runs
    on torch's threads, and mdcli chooses the CPU kernels, and says so; MDCLI_CPU_KERNELS=torch
    keeps the tiles and torch's GEMM."""
    path = written("Q4_K_M", WHOLE, tmp_path)
    model, why = load_on_blocks(path, transformers_load(path).config, "sdpa")
    assert why is None, why
    plan = select(model)
    expected = (settings_module.current().cpu_kernels == "auto" and cpu_capability() == "AVX512"
                and cpu_vendor() == "AMD" and gguf_blocks.gemm_serves(torch.get_num_threads()))
    assert plan.block_gemm is expected
    assert ("wider on its own GEMM" in plan.describe()) is expected
    assert select(model, settings_module.current().changed(cpu_kernels="torch")).block_gemm is False


@needs_gemm
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_0", "BF16"])
def test_a_prefill_on_the_gemm_decodes_generates_tokens_as_the_tiles_do(kind, tmp_path):
    """A 70-token prompt (wider than the kernel's rows) on the GEMM and on the tiles: each branch
    decodes `generate`'s tokens on transformers' load of the file."""
    path = written(kind, WHOLE, tmp_path)
    reference = transformers_load(path)
    model, why = load_on_blocks(path, reference.config, "sdpa")
    assert why is None, why
    prompts = random_prompts(40, [30, 29], seed=5)
    expected = [generate_alone(reference, prompt, 4) for prompt in prompts]
    for own_gemm in (True, False):
        engine = engine_for(model)
        forward = engine.model_forward
        forward.own = type(forward.own)(model, replace(forward.plan, block_gemm=own_gemm))
        assert forward.own.block_gemm is own_gemm
        assert greedy_forest(engine, prompts, steps=4) == expected, own_gemm


@needs_gemm
def test_without_openmp_the_gemm_runs_on_one_thread_and_serves_only_one(monkeypatch):
    """A compiler without OpenMP builds the same GEMM for the calling thread alone: the same
    products, and the plan takes it only where torch runs one thread."""
    flags = native.X86_FLAGS["AVX512"]  # the build load_any falls back to
    serial = gguf_blocks.bound(native.load(gguf_blocks.SOURCE, flags))
    assert serial.gemm_parallel() == 0
    rng = np.random.default_rng(9)
    weight = BlockWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", 70, 512, rng)), 512)
    x = torch.from_numpy(rng.standard_normal((40, 512)).astype(np.float32))
    threaded = block_linear(x, weight, rows_on_kernel=16, own_gemm=True)
    monkeypatch.setattr(gguf_blocks, "library", lambda: serial)
    gguf_blocks.gemm_works.cache_clear()
    try:
        assert torch.equal(block_linear(x, weight, rows_on_kernel=16, own_gemm=True), threaded)
        assert gguf_blocks.gemm_serves(1) and not gguf_blocks.gemm_serves(2)
    finally:
        gguf_blocks.gemm_works.cache_clear()
