"""Forwards multiply by the .gguf file's own blocks: the same float32 weights in a sixth of the bytes.

Rule: where a model's float32 weights are exactly its .gguf's blocks (checked bit for bit) and the
block kernel builds here, `block_linear` multiplies by the blocks at any width: up to kernel_rows()
tokens (16: MAX_ROWS_BY_CAPABILITY; 64 with torch on one AVX2 thread: ONE_THREAD_ROWS_BY_CAPABILITY)
the block kernel rebuilds each weight once, in registers or, past a pass's rows, into a panel of
three float32 weight rows every row of the forward reads. Above that (a prefill), on AMD's AVX-512
cores, the kernel's own GEMM (`gemm_product`) rebuilds panels of 32 weight rows and 256 inputs into each
thread's scratch and multiplies every row by them, on torch's OpenMP threads (the plan's
block_gemm; notebook/gguf-blocks.md, "A prefill on the kernel's own GEMM"); elsewhere a tile of up
to TILE_ROWS weight rows at a time is written out as float32 by the same code and multiplied by
the plan's float32 GEMM (oneDNN's where linears run on it, else torch's) (notebook/gguf-blocks.md,
"Wide forwards on the blocks"). The kernel splits a step's product's weight rows over torch's
threads (`narrow_product`). The selector (mdcli.backends.select) decides which forwards take the
blocks and, from torch's threads, up to how many tokens the kernel multiplies
(Plan.block_kernel_rows); `MDCLI_GGUF_BLOCKS=0` turns them off.

The embedded model ships as a Q4_1 GGUF (its output head Q8_0), and so does any `.gguf` a user
passes: transformers dequantizes every block to float32 at load (gguf-py's `dequantize`), so the
model mdcli runs has float32 weights that are exactly `d * q + m` (Q4_1) or `d * q` (Q8_0) of the
file's codes and float16 scales. A CPU decode step of a few tokens is bound by reading those
weights: 538 MB of float32 for the embedded model, where the file's blocks hold the same numbers in
96 MB.

`gguf_blocks.c` (mdcli/backends/native/) multiplies by the blocks directly: each block is turned back
into its 32 float32 weights in registers, rounded as gguf-py rounds them (d * q is exact in float32,
so its sum with m rounds once either way), then multiplied and summed in float32 like any other
float32 kernel. So the
products are float32 products of the model's own float32 weights, summed in another order than
MKL's or oneDNN's: logits agree with theirs to float32 rounding, the same kind of difference as
between those two, and nothing about the model changes (unlike `--cpu-weights int8`, which rounds
weights and activations).

A bf16/f16 safetensors folder is held the same way (mdcli.models.on_blocks): its 2-byte numbers are
F16/BF16 "blocks" of 32, widened exactly.

Every type of the files users download is read the same way (mdcli.backends.weights.gguf_kinds):
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks of 32, the K-quants' super-blocks of 256 (Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K: the mixed Q3_K_M, Q4_K_M, Q5_K_M files) read 32 weights at a time, and F16/BF16 numbers
widened. Each kind's weights are rebuilt exactly as gguf-py computes them (a scale times a code is
exact in float32, and where gguf-py then adds or subtracts, one fused multiply-add rounds the same),
so every one is the model's float32 weights bit for bit. Where a layer's q, k and v (or gate and
up) are of different types, as in the "_M" mixes, their product is one JoinedBlocks, each part
filling its own columns of the output.

Before a copy is used it is checked: every matrix the kernel would read is dequantized by the
kernel's own code and compared bit for bit with the model's float32 weight (`read_blocks`); a file
whose blocks are not the model's weights (another model, a transposition mdcli does not know, a
block type the kernel does not read), or whose blocks would not fit in half the free memory (the
rule of mdcli.backends.weights.packed's copies), gives no copy, with the reason, and the step keeps its float32
kernels. (measured: notebook/gguf-blocks.md, "The .gguf's own blocks: the same float32 weights in a
sixth of the bytes")

Built with mdcli.backends.native.build: AVX-512 where torch found it, else AVX2 + FMA + F16C, else
plain C; with OpenMP where the compiler has it (the GEMM's threads).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from mdcli import settings
from mdcli.backends.host import cpuinfo_fields
from mdcli.backends.native import build as native
from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, random_blocks

SOURCE = Path(__file__).parent.parent / "native" / "gguf_blocks.c"
BLOCK = 32  # weights the kernel rebuilds at a time, every kind (a K-quant's super-block is 8 of them)
# block_linear multiplies forwards of up to this many tokens by the block kernel, wider ones (a
# prefill) tile by tile (TILE_ROWS). The kernel passes over ROWS rows of x at a time with each block
# rebuilt in registers (8 on AVX-512, 4 on AVX2: its 16 registers); beyond that it writes 3 weight
# rows out as float32 once and multiplies every row by them (gguf_blocks.c, "Wider products"), so a
# block is rebuilt once per forward, not once per pass. The rule: the kernel takes the widths at which
# a whole step's products beat the tiles (AVX2) and oneDNN's packed copy (AVX-512), 16 rows on both
# (notebook/gguf-blocks.md, "One rebuild for every row").
MAX_ROWS_BY_CAPABILITY = {"AVX512": 16, "AVX2": 16, "PLAIN": 16}  # PLAIN: unmeasured, AVX2's (its width)
# With torch on one thread, where the tiles' GEMM gets no second core, the kernel's panels multiply
# wider forwards too, up to the width where every run still found them faster than the tiles: 64 rows
# on AVX2 (a question's prefill and a speculative step's guesses are 17-64 tokens; notebook/gguf-blocks.md,
# "The kernel past 16 rows on one thread"). Not measured on AVX-512: 16 there.
ONE_THREAD_ROWS_BY_CAPABILITY = {"AVX2": 64}
# Wider forwards (a prefill) without the kernel's own GEMM (AVX2 and plain builds, Intel cores, or
# MDCLI_CPU_KERNELS=torch) multiply by the blocks a tile at a time: up to TILE_ROWS of a weight's
# rows, and no more than TILE_BYTES of float32, written out into a scratch (this thread's, kept),
# then multiplied by torch's float32 GEMM. Each GEMM call packs all of its input rows again and, on
# several threads, waits for them all, so tiles are few and large: the fewest that measured fastest
# on the embedded model (notebook/gguf-blocks.md, "Wide forwards on the blocks"). Wider weights
# take fewer rows: a 1B model's tiles of 1,024 rows were 8 and 32 MB, which the GEMM read back from
# memory, and its 567-token prefill took 0.95x the time (two threads; 0.96x on one) with tiles of
# 4 MB (Zen 5; notebook/gguf-blocks.md, "Tiles by bytes").
TILE_ROWS = 1024
TILE_BYTES = 4 << 20
# Beside each model, never on it (keyed weakly: they go when the model does): the .gguf file its
# float32 weights were dequantized from, and its blocks read from that file (or why there are none).
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SPOT_ROWS = 64  # a recorded layout is confirmed on this many first rows (a q or k head's rows tell the layouts apart)
_SCRATCH = threading.local()  # each thread's float32 scratch for the tiles of wide products


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """An [out, in] weight as GGUF blocks: data [out, row bytes] uint8, each row its blocks."""

    kind: str  # a name of gguf_kinds.KERNEL_KINDS: "Q4_1", "Q6_K", "BF16", ...
    data: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.kind,)


@dataclass(frozen=True, slots=True)
class JoinedBlocks:
    """Several weights of one input width multiplied as one [sum of outs, in] matrix, each in its
    own kind: a K-quant file's q, k and v are often Q4_K, Q4_K and Q6_K (its "_M" mixes), which
    mdcli fuses into one product (mdcli.backends.llama). Each part fills its columns of the output."""

    parts: tuple[BlockWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(part.kind for part in self.parts)


def max_rows() -> int:
    """Forwards of up to this many tokens (a decode step's widths) multiply by the block kernel with
    torch on any number of threads (MAX_ROWS_BY_CAPABILITY; 0 where the kernel does not build)."""
    return MAX_ROWS_BY_CAPABILITY[_capability()] if library() is not None else 0


def kernel_rows(threads: int, capability: str | None = None) -> int:
    """Forwards of up to this many tokens multiply by the block kernel with torch on `threads`
    threads, wider ones tile by tile (the kernel runs on one thread; the tiles' GEMM on all):
    ONE_THREAD_ROWS_BY_CAPABILITY on one thread where measured, else MAX_ROWS_BY_CAPABILITY.
    capability: the ISA torch dispatches to ("AVX2", "AVX512"; any other takes the plain C build),
    this CPU's when None."""
    kind = _capability() if capability is None else native.build_kind(capability)
    if threads == 1 and kind in ONE_THREAD_ROWS_BY_CAPABILITY:
        return ONE_THREAD_ROWS_BY_CAPABILITY[kind]
    return MAX_ROWS_BY_CAPABILITY[kind]


def remember_source(model, path: Path | str) -> None:
    """Note the .gguf file the model's float32 weights were dequantized from (mdcli.models.load)."""
    _SOURCES[model] = str(path)


def adopt(model, path: Path | str, found: tuple[list[tuple[BlockWeight, ...]], BlockWeight],
          embedding: BlockWeight) -> None:
    """Keep `found` (read_blocks' answer for `path`) as the blocks of `model`, a model whose
    projections, head and embedding hold no float32 weights (mdcli.models.on_blocks), and
    `embedding` as the blocks its token embeddings are read from."""
    _SOURCES[model] = str(path)
    _BLOCKS[model] = found
    _EMBEDDINGS[model] = embedding


def kept_blocks(model):
    """The blocks read for `model` (or why there are none), or None where none were read yet."""
    return _BLOCKS.get(model)


def keep_blocks(model, found) -> None:
    """Keep `found` (gguf_reading.read_blocks' answer) beside `model`."""
    _BLOCKS[model] = found


def embedding_blocks(model) -> BlockWeight | None:
    """The blocks a model adopted for its token embeddings (None: it holds them in float32)."""
    return _EMBEDDINGS.get(model)


ROLES = ("q/k/v", "o", "gate/up", "down")  # the fused matrices of a layer, in model_blocks' order


def held_as(layers: list[tuple], head, embedding: BlockWeight | None = None) -> str:
    """What each matrix is held as, by type name, over all layers: "q/k/v Q4_K or Q4_K+Q6_K, o Q4_K,
    gate/up Q4_K, down Q4_K or Q6_K, head Q6_K" (a joined matrix's parts with "+"; the embedding
    where it is read from blocks of its own)."""
    def kinds(weights) -> str:
        return " or ".join(dict.fromkeys("+".join(w.kinds) for w in weights))

    held = [f"{role} {kinds(layer[index] for layer in layers)}" for index, role in enumerate(ROLES)]
    held.append(f"head {kinds([head])}")
    if embedding is not None and embedding is not head:
        held.append(f"embedding {embedding.kind}")
    return ", ".join(held)


def embedded_rows(weight: BlockWeight, tokens: torch.Tensor) -> torch.Tensor:
    """[M, hidden] float32: the rows `tokens` [M] of an embedding in blocks, as the float32
    embedding holds them (each row's blocks gathered, then turned back into float32 by the
    kernel's own code, bit for bit gguf-py's)."""
    return dequantize(BlockWeight(weight.kind, weight.data[tokens], weight.in_features))


def on_blocks_only(model) -> bool:
    """The model's projections hold no float32 weights (they are on the meta device): every forward
    multiplies by the .gguf's blocks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    weight = getattr(getattr(getattr(layers[0], "mlp", None), "up_proj", None), "weight", None) if layers else None
    return weight is not None and weight.is_meta and model in _BLOCKS


def source_of(model) -> Path | None:
    """The .gguf file the model's weights come from, if it was loaded from one."""
    return Path(_SOURCES[model]) if model in _SOURCES else None


def source_known(model) -> bool:
    """The model was loaded from a .gguf whose blocks its float32 weights may be."""
    return model in _SOURCES


def block_linear(x: torch.Tensor, weight: BlockWeight | JoinedBlocks, bias: torch.Tensor | None = None, *,
                 rows_on_kernel: int | None = None, tile_matmul: Callable | None = None,
                 own_gemm: bool = False) -> torch.Tensor:
    """x @ W.T (+ bias) for W in blocks, any number of rows. x: [..., in] float32 CPU -> [..., out].

    Up to `rows_on_kernel` rows (the plan's block_kernel_rows; None: max_rows()) the block kernel
    multiplies; wider inputs (a prefill) on the kernel's own GEMM where `own_gemm` (the plan's
    block_gemm: `gemm_product`), else tile by tile (`tiled_product`, each tile by `tile_matmul(x,
    tile) = x @ tile.T`: the plan's float32 GEMM; None: torch's). A JoinedBlocks multiplies part by
    part, each into its columns of the output."""
    if x.dtype != torch.float32 or x.device.type != "cpu":  # the kernel reads raw float32 memory
        raise ValueError(f"the block kernel multiplies float32 CPU tensors, not {x.dtype} on {x.device}")
    out_features, inner = weight.shape
    if inner != x.shape[-1]:
        raise ValueError(f"a weight of {inner} inputs cannot multiply rows of {x.shape[-1]}")
    flat = x.reshape(-1, inner).contiguous()  # [rows, in]
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)  # [..., out]: rows of out_features
    wide = flat.shape[0] > max(max_rows() if rows_on_kernel is None else rows_on_kernel, 1)
    # a step's products write straight into their columns of `out` (a step makes about a hundred: no view
    # each); the tiles take a [rows, out] view's column slices
    rows_out = out.view(-1, out_features) if wide or out.dim() == 1 else out
    start = 0
    for part in weight.parts if isinstance(weight, JoinedBlocks) else (weight,):
        if wide and own_gemm:
            gemm_product(flat, part, rows_out, start)
        elif wide:
            tiled_product(flat, part, rows_out[:, start:start + part.shape[0]], matmul=tile_matmul)
        else:
            narrow_product(flat, part, rows_out, start)
        start += part.shape[0]
    if bias is not None:
        out += bias
    return out


def narrow_product(flat: torch.Tensor, weight: BlockWeight, out: torch.Tensor, start: int = 0) -> None:
    """out[..., start:start + W's rows] = flat @ W.T by the block kernel (flat [rows, in] contiguous
    float32; out float32, [rows, out] or [..., rows, out], its last dimension of unit stride and its
    rows evenly spaced: columns of a wider output may be filled), on as many threads as torch is
    given, each on its run of W's rows (the same numbers at any count)."""
    lib = library()
    native.use_threads(torch.get_num_threads())
    rows, inner = flat.shape
    scratch = _scratch(lib.scratch_floats_of(inner)).data_ptr()  # wide panels; a narrow pass's inputs in lane order
    lib.products[weight.kind](flat.data_ptr(), rows, inner, weight.data.data_ptr(), weight.data.shape[0],
                              out.data_ptr() + start * 4, out.stride(-2), scratch)


def gemm_product(flat: torch.Tensor, weight: BlockWeight, out: torch.Tensor, start: int = 0) -> None:
    """out[:, start:start + W's rows] = flat @ W.T on the kernel's own GEMM (flat [rows, in]
    contiguous float32, out [rows, out] float32 with unit column stride): panels of W rebuilt from
    its blocks into each thread's scratch, never a float32 tile in memory (gguf_blocks.c, "A
    prefill's products"), on torch's OpenMP threads where the library was built with OpenMP
    (gemm_parallel), else on this thread. AVX-512 builds only (gemm_works)."""
    lib = library()
    rows, inner = flat.shape
    packed = _scratch(lib.gemm_packed_floats(rows, inner), "packed").data_ptr()  # flat's rows as the GEMM reads them
    if lib.wides[weight.kind](flat.data_ptr(), rows, inner, weight.data.data_ptr(), weight.data.shape[0],
                              out.data_ptr() + start * 4, out.stride(0), packed) != 0:
        raise MemoryError("no memory for the block kernel's scratch")


def tiled_product(flat: torch.Tensor, weight: BlockWeight, out: torch.Tensor, most: int | None = None, *,
                  matmul: Callable | None = None) -> None:
    """out = flat @ W.T (flat [rows, in] contiguous float32, out [rows, out] float32), a tile of
    W's rows (at most `most`; None: tile_limit's) at a time: the tile's weights written out as
    float32 by the kernel's own code (`*_dequantize`, gguf-py's weights bit for bit) into this
    thread's scratch, then multiplied by `matmul(flat, tile)` (the plan's float32 GEMM: oneDNN's
    where linears run on it, 2.1-3.1x torch's on a Zen 5 core) or, for None, torch's, into the
    tile's columns of `out`."""
    out_features, inner = weight.shape
    tile = tile_rows(out_features, tile_limit(inner) if most is None else most)
    scratch = _scratch(tile * inner)[: tile * inner].view(tile, inner)
    expand = getattr(library(), f"{weight.kind.lower()}_dequantize")
    row_bytes, start_of = weight.data.stride(0), weight.data.data_ptr()
    with torch.no_grad():  # products with out= record no gradient
        for start in range(0, out_features, tile):
            rows = min(tile, out_features - start)
            expand(start_of + start * row_bytes, rows, inner, scratch.data_ptr())
            if matmul is None:
                torch.mm(flat, scratch[:rows].t(), out=out[:, start:start + rows])
            else:
                out[:, start:start + rows] = matmul(flat, scratch[:rows])


def tile_limit(inner: int) -> int:
    """Most weight rows of a tile of weights with `inner` inputs: TILE_ROWS, fewer where their float32
    would pass TILE_BYTES (2,048 inputs: 512 rows; 8,192: 128), never under 16."""
    return max(16, min(TILE_ROWS, TILE_BYTES // (4 * inner)))


def tile_rows(out_features: int, most: int = TILE_ROWS) -> int:
    """Weight rows a tile of `tiled_product`: the weight's rows in as few tiles of at most `most` as
    can hold them, all of one size but the last (3072 rows of at most 1024: 3 of 1024; 1025: 513 and 512)."""
    tiles = -(-out_features // most)  # ceil
    return -(-out_features // tiles)


def _scratch(size: int, use: str = "buffer") -> torch.Tensor:
    """This thread's float32 scratch for `use` ("buffer": the kernel's and the tiles'; "packed": the
    GEMM's packed rows), of at least `size` values, kept for the next product."""
    held = getattr(_SCRATCH, use, None)
    if held is None or held.numel() < size:
        held = torch.empty(size, dtype=torch.float32)
        setattr(_SCRATCH, use, held)
    return held


def matches(weight: BlockWeight, expected: torch.Tensor) -> bool:
    """Whether the weights the kernel multiplies by are `expected` ([out, in] float32), bit for bit."""
    if tuple(expected.shape) != weight.shape or expected.dtype != torch.float32 or expected.device.type != "cpu":
        return False
    expected = expected.detach().contiguous()
    compare = getattr(library(), f"{weight.kind.lower()}_matches")
    return bool(compare(weight.data.data_ptr(), weight.shape[0], weight.in_features, expected.data_ptr()))


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 weights [out, in] the kernel multiplies by, written out by the kernel's own code."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    expand = getattr(library(), f"{weight.kind.lower()}_dequantize")
    expand(weight.data.data_ptr(), weight.shape[0], weight.in_features, out.data_ptr())
    return out


@cache
def library() -> ctypes.CDLL | None:
    """The kernel for this CPU (built on first use, with OpenMP where the compiler has it:
    mdcli.backends.native.build), with its host kind's settings (build.host_defines), or without
    them where the compiler refuses them (an older one without -mavx512vnni, say); None where it
    cannot be built at all."""
    defines = native.host_defines(cpuinfo_fields(), native.x86_capability(), digits=settings.current().block_digits)
    lib = native.load_any(SOURCE, openmp=True, defines=defines)
    if lib is None and defines:
        lib = native.load_any(SOURCE, openmp=True)
    return None if lib is None else bound(lib)


def bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, a build of gguf_blocks.c, with its functions' argument and result types declared."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.scratch_floats.argtypes, lib.scratch_floats.restype = [size], size
    lib.scratch_floats_of = cache(lib.scratch_floats)  # a step asks it for each product: a lookup, not a call into C
    lib.digits_built.argtypes, lib.digits_built.restype = [], ctypes.c_int
    lib.products = {}  # kind -> <kind>_gemm, looked up once
    lib.wides = {}  # kind -> <kind>_wide (AVX-512 builds only)
    if hasattr(lib, "gemm_packed_floats"):
        lib.gemm_packed_floats.argtypes, lib.gemm_packed_floats.restype = [size, size], size
        lib.gemm_parallel.argtypes, lib.gemm_parallel.restype = [], ctypes.c_int
    for kind in KERNEL_KINDS:
        if hasattr(lib, f"{kind.lower()}_wide"):
            wide = lib.wides[kind] = getattr(lib, f"{kind.lower()}_wide")
            wide.argtypes, wide.restype = [pointer, size, size, pointer, size, pointer, size, pointer], ctypes.c_int
        product, expand, compare = (getattr(lib, f"{kind.lower()}_{job}") for job in ("gemm", "dequantize", "matches"))
        product.argtypes, product.restype = [pointer, size, size, pointer, size, pointer, size, pointer], None
        expand.argtypes, expand.restype = [pointer, size, size, pointer], None
        compare.argtypes, compare.restype = [pointer, size, size, pointer], ctypes.c_int
        lib.products[kind] = product
    return lib


DIGIT_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def reads_digits() -> bool:
    """True where this host's kernel multiplies a lone token by DIGIT_KINDS' blocks on x in 8-bit
    digits, 23-bit fixed point per block of 32 (gguf_blocks.c's x_digits; build.host_defines,
    MDCLI_BLOCK_DIGITS)."""
    lib = library()
    return lib is not None and bool(lib.digits_built())


def reference_weights(weight: BlockWeight) -> torch.Tensor:
    """[out, in] float32: gguf-py's dequantization of the blocks (what transformers' loader makes)."""
    codes = weight.data.numpy().view(np.uint8)
    return torch.from_numpy(quants.dequantize(codes, GGMLQuantizationType[weight.kind]).astype(np.float32))


def rounded_to(values, kind: str) -> BlockWeight:
    """values [out, in] float32 (numpy) as `kind`, by gguf-py's quantizer, as a .gguf would hold them."""
    codes = np.ascontiguousarray(quants.quantize(values, GGMLQuantizationType[kind]))  # F16 / BF16: 2-byte numbers
    return BlockWeight(kind, torch.from_numpy(codes.view(np.uint8).reshape(values.shape[0], -1)), values.shape[1])


@cache
def blocks_work() -> bool:
    """The kernel built here writes gguf-py's weights bit for bit and multiplies as torch does, for
    every kind it reads."""
    if library() is None:
        return False
    generator = np.random.default_rng(0)
    for kind in KERNEL_KINDS:
        weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 19, 256, generator)), 256)
        expected = reference_weights(weight)  # [19, 256]
        if not torch.equal(dequantize(weight), expected) or not matches(weight, expected):
            return False
        if matches(weight, torch.nextafter(expected, torch.tensor(np.inf))):  # one float32 step off
            return False
        for rows in (1, 3, 8, 11):
            x = torch.from_numpy(generator.standard_normal((rows, 256)).astype(np.float32))
            if not torch.allclose(block_linear(x, weight), x @ expected.T, rtol=1e-5, atol=1e-5):
                return False
    return True


@cache
def gemm_works() -> bool:
    """The kernel built here has its own GEMM for wide forwards (AVX-512 builds) and it multiplies
    as torch does, for every kind, with a last panel and a last group of rows cut short."""
    lib = library()
    if lib is None or not lib.wides or not blocks_work():
        return False
    generator = np.random.default_rng(1)
    for kind in KERNEL_KINDS:
        weight = BlockWeight(kind, torch.from_numpy(random_blocks(kind, 37, 512, generator)), 512)
        x = torch.from_numpy(generator.standard_normal((31, 512)).astype(np.float32))
        out = torch.full((31, 40), torch.nan)
        gemm_product(x, weight, out, start=2)
        if not torch.allclose(out[:, 2:39], x @ reference_weights(weight).T, rtol=1e-5, atol=1e-4):
            return False
        if not (out[:, :2].isnan().all() and out[:, 39:].isnan().all()):  # columns past the weight's untouched
            return False
    return True


def gemm_serves(threads: int) -> bool:
    """The kernel's own GEMM works here (gemm_works) and runs on `threads` threads: one, or as many
    as torch's where the library was built with OpenMP (a build without it runs the GEMM on one)."""
    return gemm_works() and (threads == 1 or bool(library().gemm_parallel()))


def _capability() -> str:
    """This CPU's build of the kernel: "AVX512", "AVX2" or "PLAIN"."""
    return native.build_kind(native.x86_capability())
