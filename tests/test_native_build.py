"""The C kernels' builds: kept per source, headers and flags, so a changed header is never served stale."""

from __future__ import annotations

from mdcli.backends.native.build import library_path


def test_a_kernel_build_is_keyed_by_the_headers_beside_its_source_too(tmp_path):
    source, header = tmp_path / "kernel.c", tmp_path / "pool.h"
    source.write_text('#include "pool.h"\nint f(void) { return SPINS; }\n')
    header.write_text("#define SPINS 1\n")
    before = library_path(source, ("-O3",))
    assert library_path(source, ("-O3",)) == before
    header.write_text("#define SPINS 2\n")
    assert library_path(source, ("-O3",)) != before
    assert library_path(source, ("-O2",)) != library_path(source, ("-O3",))
