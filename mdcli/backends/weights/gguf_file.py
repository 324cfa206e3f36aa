"""Where each tensor of a .gguf file lies, read without parsing its metadata values.

gguf-py's `GGUFReader` builds every metadata field, the tokenizer's 49,152 strings included, before
it lists a tensor: seconds for the embedded model's file, at every run. mdcli only needs the tensor
table (mdcli.backends.weights.gguf_blocks), so this walks past the metadata by its lengths (a
fraction of a second) and returns each tensor's type and bytes (measured: notebook/gguf-blocks.md,
"The .gguf's own blocks: the same float32 weights in a sixth of the bytes"). The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(versions 2 and 3; version 1's 32-bit counts are not read).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from mdcli.backends.weights.gguf_kinds import KERNEL_KINDS, block_shape, type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by value type
# ggml's type ids and block shapes (weights per block, bytes per block) for the types mdcli reads:
# float32 (norms, biases) and every type the block kernel reads (mdcli.backends.weights.gguf_kinds)
TYPES = {int(GGMLQuantizationType[name]): (name, *block_shape(name)) for name in ("F32", *KERNEL_KINDS)}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str  # ggml's name of its type ("Q4_1", "Q6_K", "F16", ...); `data` is None for a type not in TYPES
    shape: tuple[int, ...]  # torch's order: [rows, ..., inner]
    data: np.ndarray | None  # [rows, bytes per row] uint8, a view of the mapped file; None for another type
    mapped: mmap.mmap | None = None  # the mapping `data` views
    offset: int = 0  # where `data` starts in the file

    def release(self) -> None:
        """Let the kernel drop this tensor's pages from the process (they stay in the file and
        are read again if touched): a tensor copied out of the mapping is not resident twice.
        Whole pages only: a page it shares with a neighbour is dropped too and simply read again."""
        if self.mapped is None or self.data is None:
            return
        start = self.offset - self.offset % mmap.PAGESIZE
        end = min(self.offset + self.data.nbytes, len(self.mapped))
        if hasattr(self.mapped, "madvise") and end > start:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_tensors(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the .gguf at `path` by name; ValueError if it is not a GGUF file mdcli reads."""
    return read_file(path)[0]


def read_file(path: Path) -> tuple[dict[str, TensorEntry], str]:
    """(every tensor by name, the file's `general.architecture`: "llama", "qwen2", ...; "" if unsaid)."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    reader = _Reader(mapped)
    if reader.take(4) != MAGIC:
        raise ValueError("not a GGUF file")
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; mdcli reads versions 2 and 3")
    tensor_count, field_count = reader.unpack("<Q"), reader.unpack("<Q")
    alignment, architecture = DEFAULT_ALIGNMENT, ""
    for _ in range(field_count):
        key = reader.string()
        value_type = reader.unpack("<I")
        if key == "general.alignment" and value_type == 4:
            alignment = reader.unpack("<I")
        elif key == "general.architecture" and value_type == _STRING:
            architecture = reader.string()
        else:
            reader.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name = reader.string()
        dims = [reader.unpack("<Q") for _ in range(reader.unpack("<I"))]  # ggml's order: inner first
        infos.append((name, dims, reader.unpack("<I"), reader.unpack("<Q")))
    start = -(-reader.at // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        shape = tuple(reversed(dims))
        if type_id not in TYPES:
            tensors[name] = TensorEntry(name, type_name(type_id), shape, None)
            continue
        kind, per_block, block_bytes = TYPES[type_id]
        row_bytes = dims[0] // per_block * block_bytes
        rows = 1
        for size in dims[1:]:
            rows *= size
        data = np.frombuffer(mapped, dtype=np.uint8, count=rows * row_bytes, offset=start + offset)
        tensors[name] = TensorEntry(name, kind, shape, data.reshape(rows, row_bytes), mapped, start + offset)
    return tensors, architecture


class _Reader:
    """A cursor over the mapped file, little-endian as GGUF is."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.at = 0

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.buffer):
            raise ValueError("the file ends inside its header")
        chunk = self.buffer[self.at:self.at + size]
        self.at += size
        return chunk

    def unpack(self, layout: str) -> int:
        (value,) = struct.unpack_from(layout, self.buffer, self.at)
        self.at += struct.calcsize(layout)
        return value

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.unpack("<Q")  # read before `self.at +=`, which would add to the old position
            self.at += length
        elif value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_SIZES:
                self.at += count * _SCALAR_SIZES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif value_type in _SCALAR_SIZES:
            self.at += _SCALAR_SIZES[value_type]
        else:
            raise ValueError(f"unknown metadata value type {value_type}")
        if self.at > len(self.buffer):
            raise ValueError("the file ends inside its header")
