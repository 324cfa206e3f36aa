"""Draft sources for speculative decoding: guesses of a branch's next tokens, without a model.

A draft source makes one `Drafter` per branch from everything the branch attends to (its prompt,
the shared document); the decoder tells the drafter each token the branch accepts (`add`) and asks
it for candidate continuations (`candidates`). Candidates are merged into a token tree
(`DraftTree`) whose nodes carry an estimated probability of being accepted, so a budget can keep
the likeliest nodes. Whatever the drafts are, the branch's tokens do not change: the model
verifies every guess (mdcli/speculative/planner.py), drafts only decide how many forwards it takes.

`PromptLookup` is Hugging Face's prompt lookup decoding (`prompt_lookup_num_tokens`) and the
n-gram idea of Lookahead decoding, over a per-branch index: the branch's last n tokens (n from 3
down to 1) are looked up in everything it attends to, and the tokens that followed each earlier
occurrence are the candidates. Answers about a document quote it, so these guesses are often right.
A second, smaller draft model would be another `DraftSource`.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Protocol

from mdcli.prefixes import common_prefix_length


@dataclass(frozen=True)
class Candidate:
    """A guessed continuation; `strength` is how many tokens of context matched (1-3)."""

    tokens: tuple[int, ...]
    strength: int


class Drafter(Protocol):
    def add(self, tokens: list[int]) -> None:
        """The branch accepted these tokens (in order)."""

    def candidates(self, depth: int) -> list[Candidate]:
        """Guessed continuations of at most `depth` tokens, best first."""


class DraftSource(Protocol):
    def drafter(self, context: list[int]) -> Drafter:
        """A drafter for a branch that attends to `context` (root first)."""


class PromptLookup:
    """Candidates from earlier occurrences of the branch's last n tokens (n = max_ngram..1).

    Branches of one run mostly read the same document, so the first branch's index serves every
    later branch for the tokens they share, and each branch indexes only its own rest (measured:
    notebook/gpu.md, "Eight questions on the GPU: every branch guessing").
    """

    shared_at_least = 64  # a shorter common prefix is indexed again rather than shared

    def __init__(self, max_ngram: int = 3, max_candidates: int = 4, max_occurrences: int = 64) -> None:
        self.max_ngram = max_ngram
        self.max_candidates = max_candidates
        self.max_occurrences = max_occurrences  # per n: the most recent ones are looked at
        self._first: _LookupDrafter | None = None

    def drafter(self, context: list[int]) -> _LookupDrafter:
        context = list(context)
        first = self._first
        if first is None:
            self._first = _LookupDrafter(self, context)
            return self._first
        shared = common_prefix_length(first.tokens, context)
        if shared < self.shared_at_least:
            return _LookupDrafter(self, context)
        return _LookupDrafter(self, context, base=(first.index, shared))


class _LookupDrafter:
    def __init__(self, source: PromptLookup, tokens: list[int], base=None) -> None:
        """base: (an earlier drafter's index, L): that index's positions below L, whose n-grams
        and following tokens lie in tokens[:L], are shared with this one (which never changes
        them: indexes only grow at their end)."""
        self.source = source
        self.base, self.base_end = base if base is not None else (None, 0)
        self.tokens: list[int] = tokens[: self.base_end]
        # index[n - 1][n-gram] -> positions i >= base_end where tokens[i - n:i] is that n-gram and
        # tokens[i] exists
        self.index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(source.max_ngram)]
        self.add(tokens[self.base_end :])

    def add(self, tokens: list[int]) -> None:
        first = max(len(self.tokens), self.base_end)  # positions [first, new length) gain a following token
        self.tokens.extend(tokens)
        seq = self.tokens
        for i in range(max(first, 1), len(seq)):
            for n in range(1, min(self.source.max_ngram, i) + 1):
                self.index[n - 1].setdefault(tuple(seq[i - n : i]), []).append(i)

    def _positions(self, n: int, gram: tuple[int, ...]) -> list[int]:
        """The most recent occurrences of `gram`, oldest first."""
        most = self.source.max_occurrences
        own = self.index[n - 1].get(gram, [])
        if self.base is None or len(own) >= most:
            return own[-most:]
        shared = self.base[n - 1].get(gram, [])
        end = bisect_left(shared, self.base_end)
        return shared[max(0, end - (most - len(own))) : end] + own

    def candidates(self, depth: int) -> list[Candidate]:
        seq, found, seen = self.tokens, [], set()
        for n in range(min(self.source.max_ngram, len(seq)), 0, -1):
            for i in reversed(self._positions(n, tuple(seq[len(seq) - n :]))):
                continuation = tuple(seq[i : i + depth])
                if continuation in seen:
                    continue
                seen.add(continuation)
                found.append(Candidate(continuation, n))
                if len(found) == self.source.max_candidates:
                    return found
        return found


@dataclass
class DraftTree:
    """Guessed tokens as a tree hanging off the branch's next token.

    parents[i] < i is node i's parent, -1 for a child of the branch's next token; probability[i]
    estimates the chance that node i is accepted (it never exceeds its parent's).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probability: list[float] = field(default_factory=list)
    strength: list[int] = field(default_factory=list)  # the strongest candidate through the node

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """children()[p + 1][token] -> node: index 0 is the branch's next token."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            kids[parent + 1][token] = node
        return kids

    def likeliest_path(self) -> list[int]:
        """Nodes from a child of the branch's next token down, each the likeliest child of the one
        before: the single guess most likely to be accepted deepest."""
        kids, path, parent = self.children(), [], -1
        while kids[parent + 1]:
            parent = max(kids[parent + 1].values(), key=lambda i: self.probability[i])
            path.append(parent)
        return path

    def keep(self, nodes: list[int]) -> DraftTree:
        """The subtree of `nodes` (closed under parents), renumbered in their original order."""
        nodes = sorted(nodes)
        new = {old: i for i, old in enumerate(nodes)}
        return DraftTree(
            tokens=[self.tokens[i] for i in nodes],
            parents=[-1 if self.parents[i] < 0 else new[self.parents[i]] for i in nodes],
            probability=[self.probability[i] for i in nodes],
            strength=[self.strength[i] for i in nodes],
        )


def merge_candidates(candidates: list[Candidate], first: dict[int, float], follow: dict[int, float]) -> DraftTree:
    """Merge candidates (best first) into a token tree: shared prefixes become shared nodes.

    A node's chance of being accepted is its parent's times the chance that the branch picks it
    there: rate[n] for the first child made (n: the strength of the candidate that made it; rate:
    `first` under the branch's next token, `follow` deeper), and for each later sibling rate[n] of
    what the earlier siblings leave. So a node is never likelier than its parent, and keeping the
    likeliest nodes always keeps whole paths.
    """
    tree = DraftTree()
    at: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    claimed: dict[int, float] = {}  # parent -> chance already given to its children
    for candidate in candidates:
        parent, above = -1, 1.0
        for token in candidate.tokens:
            node = at.get((parent, token))
            if node is None:
                rate = (first if parent < 0 else follow)[candidate.strength]
                chance = rate * (1.0 - claimed.get(parent, 0.0))
                claimed[parent] = claimed.get(parent, 0.0) + chance
                node = at[(parent, token)] = len(tree)
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.strength.append(candidate.strength)
                tree.probability.append(above * chance)
            parent, above = node, tree.probability[node]
    return tree
