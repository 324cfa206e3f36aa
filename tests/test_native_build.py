"""The C kernels' builds: kept per source, headers and flags, so a changed header is never served stale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdcli.backends.attention import fused
from mdcli.backends.native import build
from mdcli.backends.native.build import library_path
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights.gguf_kinds import random_blocks


def test_a_kernel_build_is_keyed_by_the_headers_beside_its_source_too(tmp_path):
    source, header = tmp_path / "kernel.c", tmp_path / "pool.h"
    source.write_text('#include "pool.h"\nint f(void) { return SPINS; }\n')
    header.write_text("#define SPINS 1\n")
    before = library_path(source, ("-O3",))
    assert library_path(source, ("-O3",)) == before
    header.write_text("#define SPINS 2\n")
    assert library_path(source, ("-O3",)) != before
    assert library_path(source, ("-O2",)) != library_path(source, ("-O3",))


def test_every_kernel_library_runs_its_jobs_on_the_one_pool_of_threads():
    if build.pool() is None or gguf_blocks.library() is None:
        pytest.skip("no C compiler here")
    kernels = [lib for lib in (gguf_blocks.library(), fused.library()) if lib is not None]
    for lib in kernels:  # handed the pool at load, and no workers of its own to start
        assert hasattr(lib, "use_pool") and not hasattr(lib, "set_threads") and not hasattr(lib, "mdcli_pool_set_threads")
    try:
        build.use_threads(3)
        assert build.pool().mdcli_pool_threads() == 3
    finally:
        build.use_threads(torch.get_num_threads())
    assert build.pool().mdcli_pool_threads() == torch.get_num_threads()


ZEN4 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17", "flags": "fpu avx512f avx512_vnni"}
ZEN5 = {**ZEN4, "cpu family": "26", "model": "2"}


def test_each_host_kind_builds_the_block_kernel_with_what_was_measured_on_it():
    """Each setting given to the kind it was measured on alone: Zen 4's nearer hints (notebook/gguf-blocks.md,
    "Nearer hints on Zen 4"), Zen 5's one-row products on x in digits where the core has VNNI ("x in three
    8-bit digits, in the kernel"); Zen 3 (family 25, no AVX-512), Intel cores and the unknown get neither."""
    assert build.host_defines(ZEN4, "AVX512") == ("-DNEAR_HINTS=1",)
    assert build.host_defines({**ZEN4, "model": "33"}, "AVX2") == ()  # Zen 3
    assert build.host_defines(ZEN5, "AVX512") == ("-DX_DIGITS=1", "-mavx512vnni")
    assert build.host_defines(ZEN5, "AVX512", digits=False) == ()  # MDCLI_BLOCK_DIGITS=off
    assert build.host_defines({**ZEN5, "flags": "fpu avx512f"}, "AVX512") == ()  # no VNNI: no vpdpbusd
    assert build.host_defines(ZEN5, "AVX2") == ()  # torch on AVX2: the kernel's AVX2 build
    assert build.host_defines({"vendor_id": "GenuineIntel", "cpu family": "6", "model": "143", "flags": ZEN4["flags"]},
                              "AVX512") == ()
    assert build.host_defines({}, None) == ()


@pytest.mark.parametrize("kind", ["BF16", "Q4_K", "Q6_K", "Q8_0"])
def test_the_nearer_hints_change_no_number(kind):
    """A hint only moves bytes between the caches: the block kernel built with and without
    NEAR_HINTS gives the same products bit for bit, at the one- and two-row passes that take them."""
    if build.x86_capability() not in build.X86_FLAGS:
        pytest.skip("the hints are an x86-64 build's")
    near, far = (build.load_any(gguf_blocks.SOURCE, openmp=True, defines=(f"-DNEAR_HINTS={on}",)) for on in (1, 0))
    if near is None or far is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(random_blocks(kind, 29, 768, rng))
    for rows in (1, 2, 3):
        x = torch.from_numpy(rng.standard_normal((rows, 768)).astype(np.float32))
        outs = []
        for lib in (gguf_blocks.bound(near), gguf_blocks.bound(far)):
            out = torch.empty(rows, 29)
            scratch = torch.empty(lib.scratch_floats(768))
            lib.products[kind](x.data_ptr(), rows, 768, blocks.data_ptr(), 29, out.data_ptr(), 29, scratch.data_ptr())
            outs.append(out)
        assert torch.equal(*outs), rows
