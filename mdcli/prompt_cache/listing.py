"""`mdcli cache list` and `mdcli cache clear`: the prompt cache's entries, read by their headers.

An entry's *age* is the time since it was last used (written, or read by a run: its file's
modification time), which is also what eviction and `clear --older-than` go by.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from mdcli.errors import UsageError
from mdcli.prompt_cache.store import BadEntry, entry_files, namespace_folders, read_header

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class Entry:
    """One entry as `mdcli cache list` shows it (`problem`: why it is not a good entry, if so)."""

    path: Path
    model: str  # its name and dtype
    tokens: int
    bytes: int
    age_seconds: float
    first_words: str
    problem: str | None = None

    def as_dict(self) -> dict:
        return {"file": str(self.path), "model": self.model, "tokens": self.tokens, "bytes": self.bytes,
                "age_seconds": round(self.age_seconds, 1), "first_words": self.first_words, "problem": self.problem}


def entries(folder: Path) -> list[Entry]:
    """Every entry file in the folder's namespaces, most recently used first."""
    now = time.time()
    found = []
    for space in namespace_folders(folder):
        for path in entry_files(space):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append(_entry(path, stat.st_size, max(0.0, now - stat.st_mtime)))
    return sorted(found, key=lambda entry: entry.age_seconds)


def clear(folder: Path, older_than_seconds: float | None = None) -> tuple[int, int]:
    """Remove the entries (all, or those unused for longer than `older_than_seconds`): (count, bytes)."""
    removed = freed = 0
    for entry in entries(folder):
        if older_than_seconds is not None and entry.age_seconds <= older_than_seconds:
            continue
        entry.path.unlink(missing_ok=True)
        removed, freed = removed + 1, freed + entry.bytes
    return removed, freed


def parse_age(text: str) -> float:
    """`7d`, `12h`, `30m`, `2w` or `90s` in seconds; anything else is a one-line UsageError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if match is None:
        raise UsageError(f"--older-than '{text}' is not a duration", fix="write it like 7d, 12h, 30m, 2w or 90s")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _entry(path: Path, size: int, age: float) -> Entry:
    try:
        header = read_header(path)
        meta = header.metadata
        model = meta.get("model", "?") + (f", {meta['dtype']}" if meta.get("dtype") else "")
        return Entry(path, model, len(header.tokens), size, age, meta.get("first_words", ""))
    except (BadEntry, KeyError, ValueError, TypeError) as problem:
        return Entry(path, "?", 0, size, age, "", problem=str(problem))
