"""The .gguf weight types the block kernel reads, by name, with their block shapes.

Rule: a type is read where `gguf_blocks.c` rebuilds its blocks into exactly the float32 weights
gguf-py's `dequantize` makes (transformers' GGUF loader runs it): the legacy blocks of 32 (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0), the K-quants' super-blocks of 256 (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: every
tensor of a Q2_K, Q3_K_M, Q4_K_M, Q5_K_M or Q6_K file) and the 16-bit numbers (F16, BF16), read 32
at a time. Shapes come from gguf-py's own table (`GGML_QUANT_SIZES`), names from its enum, so a
type is named as llama.cpp names it ("Q5_0", never "type 6").
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# the kernel's kinds, in the order gguf_blocks.c numbers them (its `kind` argument)
KERNEL_KINDS = ("Q4_1", "Q8_0", "Q4_0", "F16", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
HALF_KINDS = ("F16", "BF16")  # 2-byte numbers, widened exactly
# where each block keeps its float16 scales (d, and dmin or m where it has one): the bytes a random
# block must hold as real float16 numbers, not random bits (random_blocks)
_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                  "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# a K-quant's weight is its float16 scale times a sub-block scale (up to 15, 63 or 127) times a code:
# its float16 scales are this much smaller, so that its weights are of the size asked for too
_SUB_SCALE = {"Q2_K": 8, "Q3_K": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 64}


def type_name(type_id: int) -> str:
    """ggml's name of a tensor type ("Q5_0" for 6), or "type N" for a number gguf-py does not know."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def block_shape(kind: str) -> tuple[int, int]:
    """(weights, bytes) of one block of `kind` as the file stores it (F16: (1, 2); Q4_K: (256, 144))."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


def inner_of(kind: str, row_bytes: int) -> int:
    """Weights in a row of `row_bytes` bytes of `kind`."""
    weights, size = block_shape(kind)
    return row_bytes // size * weights


def whole_blocks(kind: str, inner: int) -> bool:
    """A row of `inner` weights is whole blocks of `kind` and whole passes of the kernel's 32."""
    return inner % max(block_shape(kind)[0], 32) == 0


def random_blocks(kind: str, rows: int, inner: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """[rows, row bytes] uint8: `kind` blocks of random codes whose float16 scales are near
    `scale` / 8 (F16 and BF16: normal numbers of that spread), as a file quantized from weights of
    about that size holds; written directly, so a 1B model's worth takes seconds (tests and
    benchmarks/random_gguf.py)."""
    if kind in HALF_KINDS:
        values = (rng.standard_normal((rows, inner)) * scale).astype(np.float32)
        halves = values.astype(np.float16) if kind == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        return halves.view(np.uint8).reshape(rows, -1)
    weights, size = block_shape(kind)
    blocks = rng.integers(0, 256, size=(rows, inner // weights, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        spread = scale / 8 / _SUB_SCALE.get(kind, 1)
        scales = (rng.uniform(0.5, 1.5, size=(rows, inner // weights)) * spread).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, inner // weights, 2)
    return blocks.reshape(rows, -1)
