"""`PromptStore`: the prompt cache of one namespace (mdcli.prompt_cache.key), on disk.

An entry is ONE safetensors file, `<folder>/<namespace>/<sha256 of the token ids>.safetensors`:
tensors `k.<layer>` and `v.<layer>` ([1, kv_heads, n, head_dim] each, the cache's own dtype),
and in the header's metadata the token ids, the model's name, when it was made, its first words
and a sha256 of the tensor bytes. The rules:

* **Longest prefix.** A lookup reads only the headers of its namespace (no tensors) and takes the
  entry sharing the most leading tokens with the prompts' shared prefix, cut to that length: a
  longer template, a new question, other retrieved chunks after the same first ones all reuse
  what they share. Fewer than `MIN_TOKENS` shared is not worth a file read.
* **Which prefix is kept.** The tokens every prompt of a run's first prefill starts with, when at
  least `MIN_TOKENS` of them are not already in the entry it started from: 64 tokens is about
  what a CPU prefills in the time a file is opened and checked, and below it every short
  question would leave a file behind.
* **Atomic.** Written to a temporary file in the same folder, then renamed over the entry's name:
  a reader sees a whole entry or none, and two runs writing one entry leave one good entry.
* **Checked.** A file that cannot be parsed, whose metadata is not this format and namespace,
  whose tensors' shapes disagree with its token count, or whose bytes fail the checksum is
  skipped with ONE line (a `note` event on stderr), and a bad entry of this format is removed.
  Nothing makes a run fail or change its tokens: a skipped entry is a miss.
* **Bounded.** After a write, the least recently used entries of the whole folder (every
  namespace) go until it is under the cap (MDCLI_PROMPT_CACHE_MB). A hit marks its file used.
* **Contained.** Only regular files inside the folder are read, written or removed; links are
  ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from mdcli.prefixes import common_prefix_length
from mdcli.core.prefix_store import PrefixHit
from mdcli.prompt_cache.key import FORMAT_VERSION, tensor_bytes

FORMAT = "mdcli-prompt-cache"
SUFFIX = ".safetensors"
MIN_TOKENS = 64
_HEADER_LIMIT = 64 << 20  # a header larger than this is not one of ours
_STALE_TEMPORARY_SECONDS = 3600


class BadEntry(Exception):
    """An entry file that is not a good entry of this namespace (the message says why)."""


@dataclass
class EntryHeader:
    """What a lookup or a listing reads of an entry without its tensors."""

    path: Path
    metadata: dict[str, str]
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}

    @property
    def tokens(self) -> list[int]:
        return json.loads(self.metadata["tokens"])


class PromptStore:
    """The prompt cache of one namespace: mdcli.core.prefix_store.PrefixStore on files."""

    min_tokens = MIN_TOKENS

    def __init__(self, folder: Path, namespace: str, *, model: str, dtype: torch.dtype, cap_bytes: int,
                 describe=None, numerics: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.namespace = namespace
        self.model = model
        self.dtype = dtype
        self.cap_bytes = cap_bytes
        self.describe = describe  # token ids -> their first words, for `mdcli cache list`
        self.numerics = numerics or {}  # the namespace's facts a reader can tell apart (threads, ...), for the list
        self.notes: list[str] = []

    @property
    def entries(self) -> Path:
        return self.folder / self.namespace

    # -- PrefixStore ---------------------------------------------------------------------------

    def longest(self, ids: list[int]) -> PrefixHit | None:
        """The entry sharing the most leading tokens with `ids` (at least min_tokens), cut to them."""
        candidates = []
        for path in entry_files(self.entries):
            try:
                header = read_header(path)
                shared = common_prefix_length(header.tokens, ids)
            except (BadEntry, KeyError, ValueError, TypeError) as problem:
                self._skip(path, problem)
                continue
            if shared >= self.min_tokens:
                candidates.append((shared, path))
        for shared, path in sorted(candidates, reverse=True):
            try:
                kv = self._read(path, shared)
            except (BadEntry, OSError, ValueError, KeyError, TypeError, RuntimeError) as problem:
                self._skip(path, problem)
                continue
            _touch(path)
            return PrefixHit(tokens=shared, kv=kv)
        return None

    def save(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `kv` as the entry of `ids`, then evict down to the cap. A failed write is a note."""
        tensors = {}
        for index, (keys, values) in enumerate(kv):
            tensors[f"k.{index}"] = keys.detach().to("cpu").contiguous()
            tensors[f"v.{index}"] = values.detach().to("cpu").contiguous()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.cap_bytes:
            self.notes.append(f"a prefix of {len(ids):,} tokens ({size / 2**20:,.0f} MiB) is over the cache's cap; "
                              "not kept (raise MDCLI_PROMPT_CACHE_MB)")
            return
        metadata = {
            "format": FORMAT, "version": str(FORMAT_VERSION), "namespace": self.namespace, "model": self.model,
            "dtype": str(self.dtype).removeprefix("torch."), "tokens": json.dumps(ids), "layers": str(len(kv)), "created": f"{time.time():.3f}",
            "first_words": self.describe(ids) if self.describe is not None else "",
            "sha256": _checksum(tensors, len(kv)), "numerics": json.dumps(self.numerics, sort_keys=True),
        }
        target = self.entries / f"{entry_name(ids)}{SUFFIX}"
        temporary = self.entries / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(temporary), metadata=metadata)
            os.replace(temporary, target)
        except OSError as error:
            self.notes.append(f"could not write an entry in {self.entries}: {error.strerror or error}")
            temporary.unlink(missing_ok=True)
            return
        evict(self.folder, self.cap_bytes, keep=target)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    # -- reading one entry ---------------------------------------------------------------------

    def _read(self, path: Path, shared: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The entry's keys and values cut to `shared` tokens, after every check."""
        data = _read_regular(path)
        header = parse_header(path, data)
        meta = header.metadata
        if meta.get("namespace") != self.namespace:
            raise BadEntry("it belongs to another model or numerics")
        tensors = _tensors(data, header)
        layers = int(meta["layers"])
        n = len(header.tokens)
        if sorted(tensors) != sorted([f"k.{i}" for i in range(layers)] + [f"v.{i}" for i in range(layers)]):
            raise BadEntry("its tensors are not one key and one value per layer")
        shape = tensors["k.0"].shape if layers else None
        for name, tensor in tensors.items():
            if tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[2] != n or tensor.shape != shape:
                raise BadEntry(f"tensor {name} has shape {tuple(tensor.shape)}, not [1, H, {n}, D] like the others")
            if tensor.dtype != self.dtype:
                raise BadEntry(f"tensor {name} is {tensor.dtype}, not {self.dtype}")
        if _checksum(tensors, layers) != meta.get("sha256"):
            raise BadEntry("its bytes do not match its checksum")
        return [(tensors[f"k.{i}"][..., :shared, :], tensors[f"v.{i}"][..., :shared, :]) for i in range(layers)]

    def _skip(self, path: Path, problem: Exception) -> None:
        """One note for a file that is not a good entry; an entry of this format is removed."""
        ours = isinstance(problem, BadEntry) and problem.args and problem.args[0] != FOREIGN
        if ours:
            path.unlink(missing_ok=True)
        action = "removed" if ours else "ignored"
        self.notes.append(f"{action} {path.name} in {path.parent}: {_reason(problem)}; prefilling without it")


# -- files -----------------------------------------------------------------------------------------

FOREIGN = "it is not an mdcli prompt-cache entry"


def entry_name(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:40]


def entry_files(folder: Path) -> list[Path]:
    """The entry files directly in `folder` (regular files, never links)."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    return sorted(p for p in children if p.suffix == SUFFIX and not p.name.startswith(".") and _regular(p))


def namespace_folders(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    except OSError:
        return []


def read_header(path: Path) -> EntryHeader:
    """The header of an entry file, read without its tensors."""
    try:
        with path.open("rb") as file:
            head = file.read(8)
            if len(head) == 8:
                length = struct.unpack("<Q", head)[0]
                head += file.read(min(length, _HEADER_LIMIT))
    except OSError as error:
        raise BadEntry(f"it cannot be read ({error.strerror})") from error
    return parse_header(path, head)


def parse_header(path: Path, data: bytes) -> EntryHeader:
    """A safetensors header (8-byte little-endian length, then JSON) that is one of ours."""
    if len(data) < 8:
        raise BadEntry("it is truncated")
    length = struct.unpack("<Q", data[:8])[0]
    if length > _HEADER_LIMIT:
        raise BadEntry(FOREIGN)
    if len(data) < 8 + length:
        raise BadEntry("it is truncated")
    try:
        header = json.loads(data[8:8 + length])
    except ValueError:
        raise BadEntry(FOREIGN) from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BadEntry(FOREIGN)
    if metadata.get("version") != str(FORMAT_VERSION):
        raise BadEntry(f"it is format version {metadata.get('version')}, not {FORMAT_VERSION}")
    if not isinstance(json.loads(metadata.get("tokens", "null")), list):
        raise BadEntry("its token ids are missing")
    return EntryHeader(path=path, metadata=metadata, tensors=header)


def evict(folder: Path, cap_bytes: int, keep: Path | None = None) -> None:
    """Remove the least recently used entries of every namespace until the folder's entries fit
    `cap_bytes` (`keep`, the entry just written, goes last); stale temporary files go too."""
    files = []
    for space in namespace_folders(folder):
        _remove_stale_temporaries(space)
        for path in entry_files(space):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((path == keep, stat.st_mtime, stat.st_size, path))
    total = sum(size for _, _, size, _ in files)
    for _, _, size, path in sorted(files):
        if total <= cap_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def _remove_stale_temporaries(space: Path) -> None:
    """Temporary files a killed run left behind (an hour old: no writer takes that long)."""
    now = time.time()
    for path in space.glob(".*.tmp"):
        try:
            if _regular(path) and now - path.stat().st_mtime > _STALE_TEMPORARY_SECONDS:
                path.unlink(missing_ok=True)
        except OSError:
            continue


def _tensors(data: bytes, header: EntryHeader) -> dict[str, torch.Tensor]:
    """The tensors of a whole entry file; a file cut short or damaged is a BadEntry."""
    length = struct.unpack("<Q", data[:8])[0]
    ends = [info.get("data_offsets", [0, 0])[1] for info in header.tensors.values() if isinstance(info, dict)]
    if len(data) < 8 + length + max(ends, default=0):
        raise BadEntry("it is truncated")
    try:
        return load_tensors(data)
    except Exception as error:  # safetensors' own error type is no OSError or ValueError
        raise BadEntry(f"its tensors cannot be read ({' '.join(str(error).split())[:100]})") from error


def _read_regular(path: Path) -> bytes:
    if not _regular(path):
        raise BadEntry("it is not a regular file")
    return path.read_bytes()


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _touch(path: Path) -> None:
    """Mark an entry used (its modification time is its last use, for eviction)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _checksum(tensors: dict[str, torch.Tensor], layers: int) -> str:
    digest = hashlib.sha256()
    for index in range(layers):
        for name in (f"k.{index}", f"v.{index}"):
            digest.update(tensor_bytes(tensors[name]))
    return digest.hexdigest()


def _reason(problem: Exception) -> str:
    if isinstance(problem, BadEntry):
        return str(problem)
    return f"it cannot be read ({' '.join(str(problem).split())[:120]})"
