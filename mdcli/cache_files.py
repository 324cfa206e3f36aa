"""The small JSON files mdcli keeps in its caches, and the digests that key them.

The model loader (the .gguf's sha256, the record of its bit-for-bit check: mdcli.models) and the
prompt cache (the weight files' digests, an entry's namespace: mdcli.prompt_cache) keep JSON files
that other mdcli processes may read while one writes. The rules they share:

* a file is written whole to a temporary file beside it, then renamed over it, so a reader never
  sees half of one; a cache that cannot be written only costs the work again next time;
* a file that is missing, unreadable or not a JSON object reads as empty;
* a file's sha256 costs a read of every byte (about a second per GB), so it is remembered by
  (path, size, modification time) in a JSON file of the caller's and computed again only when one
  of them changes; entries of files since removed are dropped when that file is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

_CHUNK = 1 << 22
_PARTIAL_PREFIX = ".tmp-"  # hidden: a listing of the folder skips a write in progress


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; {} where the file is missing, unreadable or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def replace_json(path: Path, data) -> bool:
    """Write `data` as JSON to a temporary file beside `path`, then rename it over `path`, so a
    reader never sees half of it. Best effort: False where it could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=_PARTIAL_PREFIX, suffix=".part", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle, indent=1)
            os.replace(partial, path)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    except OSError:
        return False
    return True


def json_digest(data) -> str:
    """A key for `data`: the first 32 hex digits of the sha256 of its canonical JSON (keys sorted,
    anything JSON cannot hold written as its str)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def remembered_sha256s(paths: Iterable[Path], memo: Path | None) -> dict[Path, str]:
    """Each file's sha256, as remembered in the JSON file `memo` under its resolved path while its
    size and modification time match ({"size", "mtime_ns", "sha256"}), else read and remembered;
    memo None: every file read, nothing remembered. Raises OSError for a file that cannot be read."""
    remembered = read_json_object(memo) if memo is not None else {}
    digests, changed = {}, False
    for path in paths:
        stat = path.stat()
        key = str(path.resolve())
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        entry = remembered.get(key)
        if not (isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items())
                and isinstance(entry.get("sha256"), str) and entry["sha256"]):
            entry = remembered[key] = {**stamp, "sha256": file_sha256(path)}
            changed = True
        digests[path] = entry["sha256"]
    if changed and memo is not None:
        replace_json(memo, {name: entry for name, entry in remembered.items() if os.path.exists(name)})
    return digests
