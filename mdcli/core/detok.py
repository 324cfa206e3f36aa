"""Streaming detokenization, one per branch.

Token-by-token decoding would split multi-byte characters and BPE word pieces; instead the whole
generated sequence is decoded and only the new, settled part is released. Text is held back while
it ends in an incomplete UTF-8 character (U+FFFD) or could still turn into a stop string, so the
concatenated `Token.text` of a branch always equals its final `Finish.text`.

A stop string is cut from the answer with the whitespace before it ("Harriet Plumb" stopped at
"Plumb" is "Harriet", not "Harriet "), so with stop strings trailing whitespace is held back too
until something else follows it or the branch ends.
"""

from __future__ import annotations


class StreamingDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.text = ""  # everything decodable so far (special tokens skipped)
        self.released = 0  # characters of `text` already handed out
        self.stopped_at: int | None = None  # index in `text` where a stop string begins

    def add(self, token_id: int) -> str:
        """Add one token; return the newly releasable text (maybe empty)."""
        self.token_ids.append(token_id)
        self.text = self.tokenizer.decode(
            self.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        if self.stop and self.stopped_at is None:
            self.stopped_at = self._find_stop()
        return self._release(final=False)

    def finish(self) -> str:
        """The branch ended: release whatever is still held back (up to a stop string)."""
        return self._release(final=True)

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at].rstrip()

    def _find_stop(self) -> int | None:
        # a stop string can only have been completed by the text added since the last check
        window_start = max(0, self.released - max(len(s) for s in self.stop))
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        return min(hits) if hits else None

    def _release(self, *, final: bool) -> str:
        end = len(self.final_text)
        if not final and self.stopped_at is None:
            if self.text.endswith("\ufffd"):
                end = len(self.text.rstrip("\ufffd"))
            end = min(end, len(self.text) - self._possible_stop_prefix())
            if self.stop:  # whitespace that a stop string may yet follow
                end = len(self.text[:end].rstrip())
        chunk = self.final_text[self.released : max(end, self.released)]
        self.released += len(chunk)
        return chunk

    def _possible_stop_prefix(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
