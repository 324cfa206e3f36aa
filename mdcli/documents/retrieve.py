"""BM25 over a corpus' chunks (bm25s): each question's top K chunks, laid out in corpus order.

Words are lowercased runs of letters and digits, minus English stop words (bm25s' fuller list,
STOPWORDS_EN_PLUS: question words such as "who" and "how" included, which its 33-word Lucene list
leaves in, so "Who conducts the choir?" no longer retrieves a passage for its "who won"); no
stemmer.
A question's context is its K best chunks by BM25 score (ties: the earlier chunk), among the
chunks that share a word with it (a chunk scoring 0 is unrelated: passing it to the model as a
source only misleads it, so a question may get fewer than K), then put back in corpus order (file, then position), each under its tag `[n] path:first-last`. Corpus order is
what makes retrieval cheap here: two questions that retrieved the same leading chunks have
prompts that begin with the same tokens, and the forest's radix prefill stores those tokens once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from mdcli.documents.chunks import Chunk
from mdcli.errors import UsageError
from mdcli.events import Source

_WORD = re.compile(r"[0-9a-z]+")
CHUNK_SEPARATOR = "\n\n"


@cache
def _stopwords() -> frozenset[str]:
    # bm25s is imported only when retrieval is asked for: where jax is installed, importing bm25s
    # imports jax and runs a jax op, which takes seconds and, on a GPU machine, most of the GPU's memory
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    return frozenset(STOPWORDS_EN_PLUS)


def words(text: str) -> list[str]:
    """The terms BM25 matches on."""
    stopwords = _stopwords()
    return [w for w in _WORD.findall(text.lower()) if w not in stopwords]


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float

    def source(self) -> Source:
        c = self.chunk
        return Source(path=c.path, first_line=c.first_line, last_line=c.last_line, chunk=c.id,
                      score=round(self.score, 4))


class ChunkIndex:
    """A BM25 index of chunks, built once, asked once per question."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        if not chunks:
            raise UsageError("the documents hold no text to retrieve from", fix="give documents with some text")
        import bm25s  # only when retrieval is asked for (see _stopwords)

        self.chunks = list(chunks)
        self._bm25 = bm25s.BM25()
        # the path's words count too (a question may name the file); a chunk with no indexable word
        # (only stopwords or punctuation) still takes a row
        self._bm25.index([words(f"{c.path}\n{c.text}") or ["\u2063"] for c in self.chunks], show_progress=False)

    def top(self, question: str, k: int) -> list[Hit]:
        """The question's `k` best chunks that share a word with it, in corpus order."""
        if k < 1:
            raise UsageError(f"retrieve must be at least 1 (got {k})", fix="use a positive number")
        terms = words(question)
        scores = self._bm25.get_scores(terms) if terms else np.zeros(len(self.chunks))
        related = [i for i in range(len(self.chunks)) if scores[i] > 0]
        best = sorted(related, key=lambda i: (-float(scores[i]), i))[:k]
        return [Hit(self.chunks[i], float(scores[i])) for i in sorted(best)]


def context_text(hits: Sequence[Hit]) -> str:
    """The retrieved passages as the model reads them: each under its tag, in corpus order."""
    return CHUNK_SEPARATOR.join(f"{hit.chunk.tag}\n{hit.chunk.text}" for hit in hits)
