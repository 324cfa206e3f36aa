"""The process's resident memory: its peak so far, for the `done` event and the benchmarks.

One probe, `peak_rss_bytes`: getrusage's `ru_maxrss` for this process, a high-water mark the kernel
keeps (it never goes down, so it covers the model's load as well as the run). Linux counts it in
KiB, macOS in bytes (`maxrss_bytes` converts any rusage, a child's from `os.wait4` too); Windows has
no getrusage, and the probe says 0 there. Issue 39 compares it with llama.cpp's on the same .gguf
(notebook/memory.md).
"""

from __future__ import annotations

import sys

try:  # POSIX only
    import resource
except ImportError:
    resource = None

# ru_maxrss's unit: bytes on macOS, KiB on Linux and the BSDs
MAXRSS_UNIT_BYTES = 1 if sys.platform == "darwin" else 1024


def maxrss_bytes(usage) -> int:
    """A `resource.struct_rusage`'s peak resident set, in bytes."""
    return usage.ru_maxrss * MAXRSS_UNIT_BYTES


def peak_rss_bytes() -> int:
    """The peak resident set of this process so far, in bytes (0 where there is no getrusage)."""
    if resource is None:
        return 0
    return maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF))
