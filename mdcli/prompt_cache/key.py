"""What a prompt-cache entry is keyed by, and which folder holds the entries.

An entry's keys and values are only the ones a run would compute if everything that changes the
numbers is the same: the weights (a content digest of the weight files), the config, the dtype,
the device kind, the kernel plan that computed the prefill, the thread count, the torch and
transformers versions and this cache's format. The thread count stays in the key: a GEMM library
may split a product's sums by thread (on a 2-core AVX-512 AMD EPYC one and two threads wrote the same
bytes on every CPU plan, which no library promises), so entries of another thread count are kept apart and `mdcli
cache list` names the thread count, or whatever else, that sets them apart. Those facts
hash to the *namespace*, a sub-folder of the cache folder: a run reads only its own namespace, so
a different model, dtype or plan never reads another's entry. The token ids then pick the entry
inside it (mdcli.prompt_cache.store).

Hashing weights costs a read of every byte (about a second per GB), so each file's digest is
remembered in `digests.json` in the cache folder by (path, size, modification time) and computed
again only when one of them changes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from mdcli.cache_files import json_digest, remembered_sha256s
from mdcli.errors import UsageError
from mdcli.settings import Settings

FORMAT_VERSION = 1  # bump when an entry's layout or meaning changes: old entries then miss
DIGESTS_FILE = "digests.json"


def cache_folder(option: str, settings: Settings) -> Path | None:
    """The folder `--prompt-cache` names: auto is MDCLI_PROMPT_CACHE_DIR or mdcli's cache folder's
    prompts/, off is None, anything else a folder of the user's (made when first written)."""
    value = option.strip()
    if value.lower() == "off":
        return None
    if value.lower() == "auto":
        return settings.prompt_cache_folder
    if not value:
        raise UsageError("--prompt-cache is empty", fix="give auto, off or a folder")
    folder = Path(value).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--prompt-cache '{value}' is a file, not a folder", fix="give auto, off or a folder")
    return folder


def namespace(facts: dict) -> str:
    """The namespace of these facts: a hex digest of their canonical JSON (with FORMAT_VERSION)."""
    return json_digest({"format": FORMAT_VERSION, **facts})


def files_digest(paths: list[Path], folder: Path | None) -> str:
    """One digest of the contents of `paths` (and their names), each file's digest remembered in
    `folder`/digests.json by (path, size, mtime) when a folder is given (mdcli.cache_files)."""
    digests = remembered_sha256s(paths, folder / DIGESTS_FILE if folder is not None else None)
    combined = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        combined.update(f"{path.name}:{digests[path]};".encode())
    return combined.hexdigest()


def tensors_digest(named) -> str:
    """A digest of named tensors' bytes: for a model with no weight files to hash (its state dict)."""
    combined = hashlib.sha256()
    for name, tensor in named:
        combined.update(name.encode())
        combined.update(tensor_bytes(tensor))
    return combined.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order, whatever its dtype (bf16 included)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
