"""`mdcli cache list` and `mdcli cache clear`: the prompt cache's entries, read by their headers.

An entry's *age* is the time since it was last used (written, or read by a run: its file's
modification time), which is also what eviction and `clear --older-than` go by.

Entries of one model and dtype in different namespaces (another thread count, kernel plan,
device, ...: mdcli.prompt_cache.key) never share their keys and values, so the list tells them
apart: each one's model is followed by the facts that differ between them ("2 threads"), or, where
no fact the entries recorded differs (the weights or config changed, or an entry older than these
facts), by its namespace's first eight characters.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, replace
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
    namespace: str = ""
    numerics: dict[str, str] = field(default_factory=dict)  # facts of its namespace (threads, device, ...)

    def as_dict(self) -> dict:
        return {"file": str(self.path), "model": self.model, "tokens": self.tokens, "bytes": self.bytes,
                "age_seconds": round(self.age_seconds, 1), "first_words": self.first_words, "problem": self.problem,
                "numerics": self.numerics}


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
    return sorted(told_apart(found), key=lambda entry: entry.age_seconds)


def told_apart(found: list[Entry]) -> list[Entry]:
    """The entries, each model named with what sets its namespace apart from others of that model."""
    spaces: dict[str, dict[str, dict[str, str]]] = {}  # model -> namespace -> its facts
    for entry in found:
        if entry.problem is None:
            spaces.setdefault(entry.model, {})[entry.namespace] = entry.numerics
    labelled = []
    for entry in found:
        others = spaces.get(entry.model, {})
        if entry.problem is None and len(others) > 1:
            recorded = [facts for facts in others.values() if facts]  # entries older than the facts record none
            keys = dict.fromkeys(key for facts in recorded for key in facts)
            differing = [key for key in keys if len({facts.get(key) for facts in recorded}) > 1]
            shown = [_fact(key, entry.numerics[key]) for key in differing if key in entry.numerics]
            entry = replace(entry, model=f"{entry.model}, " + (", ".join(shown) or f"namespace {entry.namespace[:8]}"))
        labelled.append(entry)
    return labelled


def _fact(key: str, value: str) -> str:
    if key == "threads":
        return f"{value} thread{'' if value == '1' else 's'}"
    return f"{key} {value}"


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
        numerics = json.loads(meta.get("numerics", "{}"))
        if not isinstance(numerics, dict):
            raise ValueError("its numerics are not a table")
        return Entry(path, model, len(header.tokens), size, age, meta.get("first_words", ""),
                     namespace=meta.get("namespace", path.parent.name), numerics={k: str(v) for k, v in numerics.items()})
    except (BadEntry, KeyError, ValueError, TypeError) as problem:
        return Entry(path, "?", 0, size, age, "", problem=str(problem))
