"""A safetensors file's tensors read one at a time into memory of their own, never mapped.

Rule: a model kept in its file's own 16-bit numbers (mdcli.models.on_blocks) reads each tensor with
`readinto` straight into the tensor that keeps it. `safe_open` maps the file and copies out of the
mapping, and the mapped pages it touched stay resident until the file is closed, so a bf16 folder's
peak held its weights twice. The format: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data (https://github.com/huggingface/safetensors).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # safetensors' name: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]
    start: int  # where its bytes start in the file
    size: int


def entries(path: Path) -> dict[str, Entry]:
    """Every tensor of the file by name, from its header alone; ValueError if it is no safetensors file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8) or b"\0" * 8)
        if not 0 < length <= MAX_HEADER:
            raise ValueError(f"{path.name} is not a safetensors file")
        header = json.loads(handle.read(length))
    found = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        found[name] = Entry(name, info["dtype"], tuple(info["shape"]), 8 + length + begin, end - begin)
    return found


def read_tensors(path: Path, names) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each of `names` the file holds, in file order, each read into a tensor
    of its own."""
    table = entries(path)
    chosen = sorted((table[name] for name in names if name in table), key=lambda entry: entry.start)
    with open(path, "rb", buffering=0) as handle:
        for entry in chosen:
            if entry.dtype not in DTYPES:
                raise ValueError(f"{entry.name} is {entry.dtype}, a type mdcli does not read")
            data = torch.empty(entry.size, dtype=torch.uint8)
            handle.seek(entry.start)
            if handle.readinto(memoryview(data.numpy())) != entry.size:
                raise ValueError(f"{path.name} ends inside {entry.name}")
            yield entry.name, data.view(DTYPES[entry.dtype]).reshape(entry.shape)
