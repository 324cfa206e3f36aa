"""The C kernels' builds: kept per source, headers and flags, so a changed header is never served stale."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention import fused
from mdcli.backends.native import build
from mdcli.backends.native.build import library_path
from mdcli.backends.weights import gguf_blocks


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
