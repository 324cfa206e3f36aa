"""Cut documents into segments of at most N tokens, losing nothing: `"".join(segments) == text`.

Writing in the Margins reads a long document segment by segment. Where a segment ends matters
(a margin is written about what it holds), so cuts are made at the strongest boundary that fits:

1. paragraphs (a blank line; the blank lines stay with the paragraph before them),
2. sentences and lines (after . ! ? … and their CJK forms, plus closing quotes and brackets, with
   the whitespace that follows; after a single line break; CJK sentence ends need no space),
3. whitespace between words (the whitespace stays with the word before it),
4. characters, inside a word longer than the whole budget (a URL, a run of CJK without
   punctuation, a base64 blob). Cuts avoid landing before a combining mark, a zero-width joiner,
   a variation selector or the "\\n" of "\\r\\n" when they can.

Every piece keeps its separators, so the pieces always concatenate back to the input: no
whitespace is normalized, no line ending converted, no sentence dropped. (The published WiM
chunker drops the sentence that overflows a segment; this one splits it instead and says so:
`Segment.ends_inside_sentence`.)

Budgets are counted with a callable (`count_tokens(text) -> int`), normally the model's tokenizer
without special tokens (`token_counter`). Pieces are packed greedily with their summed counts,
then each segment is counted whole and re-packed strictly if BPE merges at the seams made it
longer than the budget, so the guarantee below holds for any tokenizer.

Guarantee: every segment has at most `max_tokens` tokens unless it is a single character (one
Unicode code point) that alone tokenizes to more: the one unit that cannot be split. With a
byte-level BPE a code point is at most 4 tokens, hence MIN_SEGMENT_TOKENS.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from mdcli.errors import UsageError
from mdcli.strategies.job import FieldError

TokenCounter = Callable[[str], int]
Boundary = Literal["end", "paragraph", "sentence", "word", "character"]

MIN_SEGMENT_TOKENS = 16
DEFAULT_SEGMENT_TOKENS = 512
"""The knee of the margins stage's cost: larger segments save nothing (the stage is
prefill-bound), smaller ones cost more (more margins, more instruction tokens), and what the
margins recover does not depend on the size; so 512 gives the smallest segments, each margin
summarising the least text, at no extra cost (measured: notebook/margins.md, "Choosing
`--segment-tokens`"; `python -m mdcli.bench.margins --sweep`)."""

# Where each level may cut: after the end of every match. Separators stay with the piece before.
_PARAGRAPH_END = re.compile(r"(?:[ \t\f\v]*\r?\n){2,}|(?:[ \t\f\v]*\r){2,}")
_SENTENCE_END = re.compile(
    r"[.!?…]+[\"'”’»)\]}]*[ \t\f\v\u00a0\u3000]+"  # Latin punctuation needs whitespace after it
    r"|[。！？]+[」』”’)\]）】]*[ \t\f\v\u00a0\u3000]*"  # CJK punctuation does not
    r"|\r?\n|\r"  # a single line break ends a line (lists, headings, verse)
)
_WORD_END = re.compile(r"\s+")
_LEVELS: list[tuple[Boundary, re.Pattern[str] | None]] = [
    ("paragraph", _PARAGRAPH_END),
    ("sentence", _SENTENCE_END),
    ("word", _WORD_END),
    ("character", None),
]


@dataclass(frozen=True)
class Segment:
    """One segment of one document.

    `ends_at` is the boundary the segment ends on: "end" (of its document), "paragraph",
    "sentence", or "word"/"character" when a sentence longer than the budget had to be cut.
    """

    text: str
    tokens: int
    ends_at: Boundary
    document: int = 0  # index of the document (segment group) it comes from
    name: str = ""  # that document's name (file name, "stdin", "document 2")

    @property
    def ends_inside_sentence(self) -> bool:
        return self.ends_at in ("word", "character")


@dataclass(frozen=True)
class _Piece:
    text: str
    ends_at: Boundary


def token_counter(tokenizer) -> TokenCounter:
    """Count tokens as the model sees a piece of text: no BOS/EOS or other special tokens."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def split_text(text: str, max_tokens: int, count_tokens: TokenCounter) -> list[Segment]:
    """One document -> segments of at most `max_tokens` tokens whose texts join back to `text`."""
    check_segment_tokens(max_tokens)
    if not text:
        return []
    count_tokens = _memoized(count_tokens)
    pieces = _split_piece(_Piece(text, "end"), 0, max_tokens, count_tokens)
    segments = _pack(pieces, max_tokens, count_tokens, exact=False)
    return [strict for segment in segments for strict in _enforce_budget(segment, max_tokens, count_tokens)]


def split_documents(
    documents: Sequence[str], max_tokens: int, count_tokens: TokenCounter, names: Sequence[str] | None = None
) -> list[Segment]:
    """Several documents -> their segments in order; a segment never spans two documents."""
    names = list(names) if names is not None else _default_names(len(documents))
    if len(names) != len(documents):
        raise ValueError(f"{len(names)} names for {len(documents)} documents")
    for name, text in zip(names, documents):
        if not text.strip():
            raise UsageError(f"{name} is empty", fix="give a document with some text")
    return [
        Segment(s.text, s.tokens, s.ends_at, document=index, name=name)
        for index, (name, text) in enumerate(zip(names, documents))
        for s in split_text(text, max_tokens, count_tokens)
    ]


def check_segment_tokens(max_tokens: int) -> None:
    if max_tokens < MIN_SEGMENT_TOKENS:
        raise FieldError(
            f"{{segment_tokens}} {max_tokens} is too small",
            fix=f"use at least {MIN_SEGMENT_TOKENS} (a margin needs some text to read)",
        )


def _default_names(count: int) -> list[str]:
    return ["document"] if count == 1 else [f"document {i}" for i in range(1, count + 1)]


# -- splitting: a piece too long for the budget is cut at the next, weaker level ----------------


def _split_piece(piece: _Piece, level: int, max_tokens: int, count: TokenCounter) -> list[_Piece]:
    """Pieces that each fit the budget (or are single characters), concatenating to `piece`."""
    if count(piece.text) <= max_tokens or len(piece.text) <= 1:
        return [piece]
    boundary, pattern = _LEVELS[level]
    if pattern is None:
        return _split_characters(piece, max_tokens, count)
    parts = _cut_after_matches(piece.text, pattern)
    if len(parts) == 1:
        return _split_piece(piece, level + 1, max_tokens, count)
    pieces = [_Piece(text, boundary) for text in parts[:-1]] + [_Piece(parts[-1], piece.ends_at)]
    return [small for p in pieces for small in _split_piece(p, level + 1, max_tokens, count)]


def _cut_after_matches(text: str, pattern: re.Pattern[str]) -> list[str]:
    """Cut `text` after every (non-empty) match of `pattern`: the separators stay with the text
    before them, and the parts concatenate back to `text`."""
    parts, start = [], 0
    for match in pattern.finditer(text):
        end = match.end()
        if end < len(text) and text[start:end].strip():  # leading whitespace joins the next part
            parts.append(text[start:end])
            start = end
    parts.append(text[start:])
    return parts


def _split_characters(piece: _Piece, max_tokens: int, count: TokenCounter) -> list[_Piece]:
    """Cut a word longer than the budget into the longest prefixes that fit."""
    pieces, rest = [], piece.text
    while rest and count(rest) > max_tokens and len(rest) > 1:
        cut = _soft_cut(rest, _longest_fitting_prefix(rest, max_tokens, count))
        pieces.append(_Piece(rest[:cut], "character"))
        rest = rest[cut:]
    if rest:
        pieces.append(_Piece(rest, piece.ends_at))
    return pieces


def _longest_fitting_prefix(text: str, max_tokens: int, count: TokenCounter) -> int:
    """Binary search for the longest prefix within the budget (at least one character)."""
    low, high = 1, min(len(text) - 1, 64 * max_tokens)  # no real token is 64 characters long
    while low < high:
        middle = (low + high + 1) // 2
        if count(text[:middle]) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    return low


def _soft_cut(text: str, cut: int) -> int:
    """Move a cut left so it does not separate a character from what attaches to it."""
    soft = cut
    while soft > 1 and _attaches_to_previous(text, soft):
        soft -= 1
    return soft if not _attaches_to_previous(text, soft) else cut


def _attaches_to_previous(text: str, index: int) -> bool:
    char, before = text[index], text[index - 1]
    return (
        unicodedata.combining(char) != 0
        or char in "\u200d\ufe0e\ufe0f"
        or before == "\u200d"
        or "\U0001f3fb" <= char <= "\U0001f3ff"  # skin-tone modifiers
        or (before == "\r" and char == "\n")
    )


# -- packing: neighbouring pieces share a segment while they fit --------------------------------


def _pack(pieces: list[_Piece], max_tokens: int, count: TokenCounter, *, exact: bool) -> list[Segment]:
    """Greedy packing. Not exact: a piece joins while the summed piece counts fit (fast, and
    BPE merges at seams rarely add tokens). Exact: the candidate segment is counted whole."""
    segments: list[Segment] = []
    text, used, ends_at = "", 0, "end"
    for piece in pieces:
        tokens = count(piece.text)
        if text and _fits(text, used, piece.text, tokens, max_tokens, count, exact):
            text, used, ends_at = text + piece.text, used + tokens, piece.ends_at
            continue
        if text:
            segments.append(Segment(text, count(text), ends_at))  # type: ignore[arg-type]
        text, used, ends_at = piece.text, tokens, piece.ends_at
    if text:
        segments.append(Segment(text, count(text), ends_at))  # type: ignore[arg-type]
    return segments


def _fits(text: str, used: int, addition: str, tokens: int, max_tokens: int, count: TokenCounter, exact: bool) -> bool:
    if exact:
        return count(text + addition) <= max_tokens
    return used + tokens <= max_tokens


def _enforce_budget(segment: Segment, max_tokens: int, count: TokenCounter) -> list[Segment]:
    """A segment the summed counts let through but that counts longer whole: re-pack it exactly."""
    if segment.tokens <= max_tokens or len(segment.text) <= 1:
        return [segment]
    pieces = _split_piece(_Piece(segment.text, segment.ends_at), 0, max_tokens, count)
    # each piece fits alone (or is one character), so every exactly packed segment fits
    return _pack(pieces, max_tokens, count, exact=True)


def _memoized(count: TokenCounter) -> TokenCounter:
    """Pieces are counted while splitting and again while packing: count each text once."""
    seen: dict[str, int] = {}

    def cached(text: str) -> int:
        if text not in seen:
            seen[text] = count(text)
        return seen[text]

    return cached
