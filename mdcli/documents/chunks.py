"""Documents -> chunks of at most N tokens, cut on paragraph boundaries, then on line boundaries,
then (a line longer than the budget) between words, each knowing where it came from.

Tokens are counted by the model's tokenizer, handed in as a callable (`text -> count`, no
special tokens), so a chunk's budget is the model's own. A chunk's text is the lines it covers,
verbatim; blank lines between paragraphs belong to no chunk.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mdcli.documents.inputs import Document
from mdcli.errors import UsageError

TokenCounter = Callable[[str], int]
DEFAULT_CHUNK_TOKENS = 256
MIN_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class Chunk:
    """A passage of one document: `id` numbers the corpus' chunks from 1 in corpus order (file,
    then position) and is the chunk's `[n]` tag; lines are 1-based and inclusive."""

    id: int
    path: str
    first_line: int
    last_line: int
    text: str

    @property
    def tag(self) -> str:
        return f"[{self.id}] {self.path}:{self.first_line}-{self.last_line}"


@dataclass(frozen=True)
class _Piece:
    """Consecutive lines (a paragraph, a line, or part of a line) with their token count."""

    first_line: int
    last_line: int
    text: str
    tokens: int


def check_chunk_tokens(value: int) -> None:
    if value < MIN_CHUNK_TOKENS:
        raise UsageError(
            f"chunk tokens must be at least {MIN_CHUNK_TOKENS} (got {value})", fix="give a larger --chunk-tokens"
        )


def chunk_documents(documents: Sequence[Document], max_tokens: int, count_tokens: TokenCounter) -> list[Chunk]:
    """Every document's chunks, in corpus order, numbered from 1."""
    check_chunk_tokens(max_tokens)
    chunks: list[Chunk] = []
    for document in documents:
        for piece in _packed(_pieces(document.text, max_tokens, count_tokens), max_tokens, count_tokens):
            chunks.append(Chunk(len(chunks) + 1, document.path, piece.first_line, piece.last_line, piece.text))
    return chunks


def _paragraphs(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each run of non-blank lines."""
    paragraphs: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 1
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            if not current:
                start = number
            current.append(line)
        elif current:
            paragraphs.append((start, current))
            current = []
    if current:
        paragraphs.append((start, current))
    return paragraphs


def _pieces(text: str, max_tokens: int, count: TokenCounter) -> list[_Piece]:
    """Paragraphs that fit; a paragraph that does not, as its lines; a line that does not, as
    runs of words that do (a word longer than the budget, in character runs that do)."""
    pieces: list[_Piece] = []
    for start, lines in _paragraphs(text):
        paragraph = "\n".join(lines)
        tokens = count(paragraph)
        if tokens <= max_tokens:
            pieces.append(_Piece(start, start + len(lines) - 1, paragraph, tokens))
            continue
        for offset, line in enumerate(lines):
            number = start + offset
            tokens = count(line)
            if tokens <= max_tokens:
                pieces.append(_Piece(number, number, line, tokens))
            else:
                pieces.extend(_Piece(number, number, part, count(part)) for part in _split_line(line, max_tokens, count))
    return pieces


def _split_line(line: str, max_tokens: int, count: TokenCounter) -> list[str]:
    parts: list[str] = []
    current = ""
    for word in re.findall(r"\S+\s*", line):
        if count(current + word) <= max_tokens:
            current += word
            continue
        if current:
            parts.append(current.rstrip())
        current = word
        while count(current) > max_tokens:  # one word longer than the budget: cut it by characters
            cut = len(current)
            while cut > 1 and count(current[:cut]) > max_tokens:
                cut = cut * 3 // 4
            parts.append(current[:cut])
            current = current[cut:]
    if current.strip():
        parts.append(current.rstrip())
    return parts


def _packed(pieces: list[_Piece], max_tokens: int, count: TokenCounter) -> list[_Piece]:
    """Consecutive pieces joined while the whole still fits: a chunk is the lines it covers."""
    packed: list[_Piece] = []
    for piece in pieces:
        if packed and piece.first_line > packed[-1].last_line:
            last = packed[-1]
            gap = "\n" * (piece.first_line - last.last_line)  # the blank lines between them, kept
            joined = last.text + gap + piece.text
            tokens = count(joined) if last.tokens + piece.tokens <= max_tokens + 2 else max_tokens + 1
            if tokens <= max_tokens:
                packed[-1] = _Piece(last.first_line, piece.last_line, joined, tokens)
                continue
        packed.append(piece)
    return packed
