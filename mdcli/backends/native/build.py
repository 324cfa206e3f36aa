"""mdcli's own C kernels: compiled once per machine with the system's C compiler, loaded with ctypes.

Nothing is built at install and nothing is downloaded: the first run that wants a kernel compiles
its source (next to the module that uses it) with `$CC`, else `cc`, into mdcli's cache folder
(`$MDCLI_CACHE_DIR/kernels`, see mdcli.models.embedded), named after the source, the flags and the compiler,
so a change of any builds anew. Without a compiler, or if the build fails, `load` returns None and
the caller keeps torch's kernels (slower, the same tokens).

Every kernel library is handed one pool of threads at load (pool.c, built the same way; pool.h is
the kernels' side): one set of workers for all kernels, its thread count set by `use_threads`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from mdcli import settings
from mdcli.backends.host import cpu_capability

COMPILE_SECONDS = 120
# The x86-64 kernels (the .gguf block kernel, the attention kernel) are built for the vector width
# torch's own kernels dispatch to: AVX-512, else AVX2, with FMA and F16C either way.
_X86_COMMON = ("-O3", "-mfma", "-mf16c", "-pthread")  # -pthread: the block kernel's worker threads
X86_FLAGS = {"AVX512": (*_X86_COMMON, "-mavx512f"), "AVX2": (*_X86_COMMON, "-mavx2")}
# Other CPUs (ARM's NEON; x86-64 without AVX2) build the block kernel's plain C, GCC's and Clang's
# vector extensions, vectorized as the compiler can (gguf_blocks.c's last branch). Its speed is
# unmeasured on such a host; its numbers are checked at load as the x86 builds' are (blocks_work).
PLAIN_FLAGS = ("-O3", "-pthread", "-Wno-psabi")
# A kernel built with OpenMP runs its parallel regions on torch's OpenMP threads: it needs
# libgomp.so.1, and in a process that imported torch that name is already torch's own copy (torch's
# wheels ship GNU OpenMP under it), so the dynamic loader binds that one, not a second runtime.
OPENMP_FLAG = "-fopenmp"


def x86_capability() -> str | None:
    """"AVX512" or "AVX2" (or another of torch's names) on x86-64; None on other machines."""
    return cpu_capability() if platform.machine().lower() in {"x86_64", "amd64"} else None


def build_kind(capability: str | None) -> str:
    """The block kernel's build for a CPU whose torch kernels dispatch to `capability`: "AVX512" or
    "AVX2" (X86_FLAGS), anything else "PLAIN" (PLAIN_FLAGS)."""
    return capability if capability in X86_FLAGS else "PLAIN"


def load_any(source: Path, *, openmp: bool = False, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` built for this CPU, x86-64 vector widths or plain C (build_kind), with `defines`
    added; None where it cannot be. openmp: with OPENMP_FLAG first, without it where the compiler
    refuses it."""
    flags = (*X86_FLAGS.get(build_kind(x86_capability()), PLAIN_FLAGS), *defines)
    return (openmp and load(source, (*flags, OPENMP_FLAG))) or load(source, flags)


def host_defines(fields: dict[str, str], capability: str | None, *, digits: bool = True) -> tuple[str, ...]:
    """The block kernel's settings for a host kind, from its /proc/cpuinfo `fields` and vector
    `capability`, each measured on the kind it is given to:
    - on a Zen 4 core (AMD, family 25 with AVX-512; Zen 3, the family's other cores, has none)
      -DNEAR_HINTS=1, the one- and two-row passes' hints temporal (prefetcht2), not non-temporal
      (gguf_blocks.c's hint: a 1B model's Q6_K products 0.85-0.87x at one row;
      notebook/gguf-blocks.md, "Nearer hints on Zen 4");
    - on a Zen 5 core (AMD, family 26) with AVX-512 VNNI, -DX_DIGITS=1: one-row K-quant products
      on x in three 8-bit digits (gguf_blocks.c's x_digits: a 1B Q4_K_M file's one-row products
      0.78x the time at one thread, 0.93x at two; notebook/gguf-blocks.md, "x in three 8-bit
      digits, in the kernel"), unless `digits` is off (MDCLI_BLOCK_DIGITS: every product float32).
    Nothing elsewhere: Intel cores were not measured so, nor the digits on Zen 4 (only in
    standalone loops)."""
    amd = fields.get("vendor_id") == "AuthenticAMD" and capability == "AVX512"
    if amd and fields.get("cpu family") == "25":
        return ("-DNEAR_HINTS=1",)
    if digits and amd and fields.get("cpu family") == "26" and "avx512_vnni" in fields.get("flags", "").split():
        return ("-DX_DIGITS=1", "-mavx512vnni")
    return ()


POOL_SOURCE = Path(__file__).parent / "pool.c"
POOL_FLAGS = ("-O2", "-pthread")
_asked: dict[str, int] = {}  # the thread count last asked of the pool, and by which process ("pid")


def use_threads(threads: int) -> None:
    """Split every kernel's jobs over `threads` threads (pool.c's mdcli_pool_set_threads; torch's
    count, the cores its own operations use between the kernels' calls), calling into the pool only
    when the count changes, or in a forked child (which has none of its parent's workers)."""
    shared = pool()
    if shared is not None and (_asked.get("threads"), _asked.get("pid")) != (threads, os.getpid()):
        shared.mdcli_pool_set_threads(threads)
        _asked.update(threads=threads, pid=os.getpid())


@cache
def pool() -> ctypes.CDLL | None:
    """The one pool of threads every kernel library runs its jobs on (built on first use); None where
    it cannot be built (each kernel then runs its jobs on the calling thread)."""
    lib = _load_built(POOL_SOURCE, POOL_FLAGS)
    if lib is None:
        return None
    lib.mdcli_pool_set_threads.argtypes, lib.mdcli_pool_set_threads.restype = [ctypes.c_int], ctypes.c_int
    lib.mdcli_pool_threads.argtypes, lib.mdcli_pool_threads.restype = [], ctypes.c_int
    return lib


def load_x86(source: Path) -> ctypes.CDLL | None:
    """`source` built for this x86-64 CPU's vector width (X86_FLAGS); None on other CPUs or where it cannot be built."""
    flags = X86_FLAGS.get(x86_capability())
    return load(source, flags) if flags else None


def load(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built from `source` with `flags` (built on first use), handed the pool of threads
    where it takes one (pool.h's use_pool); None if it cannot be built."""
    lib = _load_built(source, flags)
    return None if lib is None else handed_pool(lib)


def handed_pool(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, its jobs from now on on the one pool of threads, where it takes one (pool.h's use_pool)
    and the pool builds here."""
    shared = pool()
    if shared is not None and hasattr(lib, "use_pool"):
        address = ctypes.c_void_p
        lib.use_pool.argtypes, lib.use_pool.restype = [address, address], None
        lib.use_pool(ctypes.cast(shared.mdcli_pool_parallel, address), ctypes.cast(shared.mdcli_pool_threads, address))
    return lib


def _load_built(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built from `source` with `flags`, built first where it is not yet; None if it cannot be."""
    path = library_path(source, flags)
    if not path.exists() and not _compile(source, flags, path):
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def library_path(source: Path, flags: tuple[str, ...]) -> Path:
    """Where the build of `source` (with the headers beside it, which it may include) and `flags` is kept."""
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode() + str(_compiler()).encode())
    return settings.current().mdcli_cache / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _compiler() -> str | None:
    return shutil.which(settings.current().cc)


def _compile(source: Path, flags: tuple[str, ...], path: Path) -> bool:
    """cc into a temporary file beside `path`, then renamed: concurrent first runs never load half a file."""
    compiler = _compiler()
    if compiler is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=path.parent)
        os.close(handle)
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", partial, str(source)],
                              capture_output=True, timeout=COMPILE_SECONDS, check=False)
        if done.returncode != 0:
            os.unlink(partial)
            return False
        os.replace(partial, path)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
