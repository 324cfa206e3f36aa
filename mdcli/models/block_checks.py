"""What a .gguf's bit-for-bit check found, kept so that the next load of the same file skips it.

mdcli.models.on_blocks loads a .gguf on its blocks only after every block matrix is shown to be,
bit for bit, the float32 weights transformers' own loader would make of it (gguf-py's
dequantization, then the loader's tensor processor). That check dequantizes the whole file in
numpy: 2.4 of the 3.6 s a load of the embedded model took on a Zen 3 core (2026-11-27,
docs/performance.md, "Start-up"). Its outcome depends only on

* the file's bytes (its sha256, remembered per path, size and mtime: mdcli.cache_files),
* the model's config, as transformers read it from the file,
* the block kernel's build (its library is named after its source, flags and compiler),
* the gguf-py, transformers and numpy versions that make the reference weights,

so a record under a key over all of them, written after a check passed, is as good as the check:
which candidate layout (as stored, or with llama.cpp's rotary permutation undone) each tensor
matched. A record that cannot be read, or names a layout a tensor does not have, is ignored and
the check runs again. Records are JSON in `<mdcli cache>/gguf-checks/`, written atomically; the
oldest beyond MAX_RECORDS are removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from mdcli import settings as settings_module
from mdcli.backends.weights import gguf_blocks
from mdcli.cache_files import json_digest, read_json_object, replace_json
from mdcli.models.embedded import gguf_sha256
from mdcli.models.prompt_identity import numerics_config

FORMAT = 1
FOLDER = "gguf-checks"
MAX_RECORDS = 64  # a record is a few KB; tests write one per tiny file they make


def record_path(path: Path, config) -> Path | None:
    """Where the record of `path` loaded with `config` lives; None where no key can be made (the
    file cannot be hashed, or the kernel is not built here)."""
    library = gguf_blocks.library()
    try:
        digest = gguf_sha256(path)
    except OSError:
        return None
    if library is None:
        return None
    key = {
        "format": FORMAT,
        "gguf_sha256": digest,
        "config": numerics_config(config),
        "kernel": Path(library._name).name,
        "versions": {name: _version(name) for name in ("gguf", "transformers", "numpy")},
    }
    return settings_module.current().mdcli_cache / FOLDER / f"{json_digest(key)}.json"


def read(record: Path | None) -> dict[str, int] | None:
    """The layout index each tensor matched when the check last passed, or None."""
    if record is None:
        return None
    data = read_json_object(record)
    layouts = data.get("layouts") if data.get("format") == FORMAT else None
    if not isinstance(layouts, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in layouts.values()):
        return None
    return layouts


def write(record: Path | None, layouts: Mapping[str, int]) -> None:
    """Keep what a passed check found (best effort: a read-only cache only costs the check next time)."""
    if record is not None and replace_json(record, {"format": FORMAT, "layouts": dict(layouts)}):
        _keep_newest(record.parent)


def _keep_newest(folder: Path) -> None:
    try:
        records = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in records[MAX_RECORDS:]:
            old.unlink(missing_ok=True)
    except OSError:  # another process removed one first
        pass


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"
