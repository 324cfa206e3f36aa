"""The block kernel's plain C build, which CPUs without AVX2 (ARM's NEON among them) run: built here
with no vector flags, it writes gguf-py's weights bit for bit and multiplies within float32 rounding,
for every kind and every pass size, on any thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdcli.backends.native import build as native
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights.gguf_blocks import BlockWeight, reference_weights
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, random_blocks
from tests.test_gguf_blocks import rounding_bound


@pytest.fixture(scope="module")
def plain():
    lib = native.load(gguf_blocks.SOURCE, native.PLAIN_FLAGS)
    if lib is None:
        pytest.skip("no C compiler here")
    return gguf_blocks.bound(lib)


def plain_product(lib, x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    rows, (n, k) = x.shape[0], weight.shape
    y, scratch = torch.empty(rows, n), torch.empty(lib.scratch_floats(k))
    getattr(lib, f"{weight.kind.lower()}_gemm")(x.data_ptr(), rows, k, weight.data.data_ptr(), n, y.data_ptr(), n,
                                                scratch.data_ptr())
    return y


@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_the_plain_build_writes_gguf_pys_weights_and_multiplies_within_rounding(plain, kind):
    rng = np.random.default_rng(7)
    weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 61, 768, rng)), 768)
    expected = reference_weights(weight)
    written = torch.empty(61, 768)
    getattr(plain, f"{kind.lower()}_dequantize")(weight.data.data_ptr(), 61, 768, written.data_ptr())
    assert torch.equal(written, expected)
    for rows in (1, 2, 3, 5, 8, 17):  # the passes of up to 4 rows, the shared rebuilds of 5-8, the panels
        x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
        exact = x.double() @ expected.double().T
        assert bool(((plain_product(plain, x, weight).double() - exact).abs() <= rounding_bound(x, expected)).all())


def test_the_plain_build_gives_the_same_numbers_on_any_thread_count(plain):
    rng = np.random.default_rng(8)
    weight = BlockWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", 301, 512, rng)), 512)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    alone = plain_product(plain, x, weight)
    try:
        for threads in (2, 3):
            native.use_threads(threads)
            assert torch.equal(plain_product(plain, x, weight), alone), threads
    finally:
        native.use_threads(torch.get_num_threads())


def test_cpus_without_avx2_take_the_plain_build_and_its_rows():
    assert native.build_kind("AVX512") == "AVX512" and native.build_kind("AVX2") == "AVX2"
    assert native.build_kind("DEFAULT") == native.build_kind("SVE256") == native.build_kind(None) == "PLAIN"
    assert gguf_blocks.kernel_rows(1, "DEFAULT") == gguf_blocks.kernel_rows(2, "SVE256") == 16
