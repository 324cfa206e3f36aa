"""Many inputs, one list of documents: files, folders (walked recursively, sorted), shell globs
and `-` for stdin, each document keeping its path.

A file named on its own must be readable UTF-8 text with something in it, or the run is refused
(UsageError, one line). Inside a folder or a glob, a file that is binary (a NUL byte), not UTF-8 or
empty is skipped and reported as data (`Inputs.skipped`): the caller says so, one line per file.
Hidden folders inside a folder (`.git`) are skipped the same way, one line each.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mdcli.errors import UsageError

GLOB_CHARACTERS = frozenset("*?[")
SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file (as git and grep decide)


@dataclass(frozen=True)
class Document:
    """One input: the path it was read from (as the user wrote it, or under the folder they
    named; "stdin" for `-`) and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class Skipped:
    """A file inside a folder or glob that was not read, and why; `before`: how many documents
    were read ahead of it (its place in the input order, which --each's output keeps)."""

    path: str
    reason: str
    before: int = 0

    def line(self) -> str:
        return f"skipped '{self.path}': {self.reason}"


@dataclass
class Inputs:
    documents: list[Document] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def read_inputs(
    sources: Sequence[str], *, read_stdin: Callable[[], bytes] | None = None, base: Path | None = None,
    lenient: bool = False,
) -> Inputs:
    """Every source in order -> its documents. `read_stdin` reads the bytes piped in (for `-`);
    `base`: the folder relative paths and globs start from (a recipe's), shown paths stay as
    written. Raises UsageError for a named file or folder that cannot give any text; `lenient`
    (--each, where every file is its own job): a named file that is not text is skipped like one
    found in a folder, and a run with only such files is not refused here."""
    if not sources:
        raise UsageError("no document given", fix="name a file, a folder, a glob, or - for stdin")
    if list(sources).count("-") > 1:
        raise UsageError("stdin (-) is given more than once", fix="pipe one document and name the others")
    inputs = Inputs()
    for source in sources:
        if source == "-":
            if read_stdin is None:
                raise UsageError("'-' (stdin) cannot be read here", fix="name a file instead")
            inputs.documents.append(Document("stdin", named_text(read_stdin(), "stdin")))
            continue
        where = _located(source, base)
        if not where.exists() and looks_like_a_question(source):
            raise UsageError(f"'{source}' is no file, folder or glob; a question goes after -q", fix=f'-q "{source}"')
        if where.is_dir():
            _walk(source, where, inputs)
        elif where.exists() and lenient:
            _add_found(where, source, inputs)
        elif where.exists():
            inputs.documents.append(Document(source, named_text(_read_bytes(where, source), f"'{source}'")))
        elif GLOB_CHARACTERS & set(source):
            _expand_glob(source, base, inputs)
        else:
            raise UsageError(f"document '{source}' does not exist", fix="check the path, or use - for stdin")
    if not inputs.documents and not (lenient and inputs.skipped):
        named = ", ".join(f"'{s}'" for s in sources)
        raise UsageError(f"no text file found in {named}", fix="name a folder or glob that holds UTF-8 text files")
    return inputs


def looks_like_a_question(source: str) -> bool:
    """Whether a document argument that names nothing is a question typed without -q: words
    separated by spaces, ending in '?' or without a file extension or path separator."""
    words = source.split()
    return len(words) >= 3 and (source.rstrip().endswith("?") or ("/" not in source and "." not in words[-1]))


def named_text(data: bytes, name: str) -> str:
    """A document named on its own: UTF-8 text (a BOM dropped) with something in it, or an error."""
    problem = text_problem(data)
    if problem is not None:
        raise UsageError(f"{name} is {problem}", fix=_fix(problem))
    return data.decode("utf-8-sig")


def _fix(problem: str) -> str:
    if problem == "empty":
        return "give a document with some text"
    if problem.startswith("binary"):
        return "give a text file"
    if problem.startswith("UTF-16"):
        return "convert it, e.g. iconv -f UTF-16 -t UTF-8"
    return "convert it, e.g. iconv -f latin1 -t utf-8"


def text_problem(data: bytes) -> str | None:
    """Why these bytes are not a document (None: they are UTF-8 text with something in it)."""
    utf16 = _utf16_bom(data)
    if utf16 is not None:  # before the NUL check: UTF-16 text is mostly NUL bytes
        return f"{utf16} text (it starts with a {utf16} byte-order mark), not UTF-8"
    if b"\x00" in data[:SNIFF_BYTES]:
        return "binary (it holds NUL bytes)"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        return f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})"
    return None if text.strip() else "empty"


def _utf16_bom(data: bytes) -> str | None:
    """"UTF-16LE" or "UTF-16BE" when `data` starts with that byte-order mark (Windows editors write
    it), else None: such a file fails as UTF-8 at byte 0xff or 0xfe, which names no encoding."""
    if data.startswith(b"\xff\xfe"):
        return "UTF-16LE"
    if data.startswith(b"\xfe\xff"):
        return "UTF-16BE"
    return None


def _located(source: str, base: Path | None) -> Path:
    path = Path(source).expanduser()
    return path if base is None or path.is_absolute() else base / path


def _read_bytes(path: Path, shown: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read '{shown}': {error.strerror}", fix="check its permissions") from error


def _walk(shown: str, folder: Path, inputs: Inputs) -> None:
    """A folder's files, recursively, in sorted order of their path; hidden folders skipped."""
    for path in sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).parts):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts[:-1]):
            continue  # inside a hidden folder, reported once below
        name = (Path(shown) / relative).as_posix()
        if path.is_dir():
            if path.name.startswith("."):
                inputs.skipped.append(Skipped(name + "/", "hidden folder", len(inputs.documents)))
            continue
        _add_found(path, name, inputs)


def _expand_glob(pattern: str, base: Path | None, inputs: Inputs) -> None:
    root = str(base) if base is not None and not Path(pattern).is_absolute() else None
    matches = sorted(glob.glob(pattern, root_dir=root, recursive=True))
    if not matches:
        raise UsageError(f"'{pattern}' matches no file", fix="check the pattern (quote it to let mdcli expand it)")
    for match in matches:
        where = _located(match, base)
        if where.is_dir():
            _walk(match, where, inputs)
        else:
            _add_found(where, match, inputs)


def _add_found(path: Path, name: str, inputs: Inputs) -> None:
    """A file found in a folder or by a glob: read, or skipped with the reason."""
    try:
        data = path.read_bytes()
    except OSError as error:
        inputs.skipped.append(Skipped(name, f"cannot read it ({error.strerror})", len(inputs.documents)))
        return
    problem = text_problem(data)
    if problem is not None:
        inputs.skipped.append(Skipped(name, problem, len(inputs.documents)))
    else:
        inputs.documents.append(Document(name, data.decode("utf-8-sig")))


def joined_text(documents: Sequence[Document]) -> str:
    """What the model reads without retrieval: one document is its text as it is; several are each
    a `# path` header line, a blank line and the text, in order, separated by a blank line."""
    if len(documents) == 1:
        return documents[0].text
    return "\n\n".join(f"# {d.path}\n\n{d.text.strip()}" for d in documents)
