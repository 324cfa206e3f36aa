"""Token prefixes, on the ground floor: how many leading tokens two prompts share, and how many
tokens a set of prompts holds once shared leading tokens are stored once (the node count of their
token trie: what a radix prefill feeds, what a cache keeps). The engine's prefill (core.run), a
strategy's memory estimate (strategies), the drafts' prompt lookup (speculative) and the prompt
cache (prompt_cache) all count with these; the standard library only."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trie_size(prompts: Sequence[Sequence[int]]) -> int:
    """Nodes of the prompts' token trie: their tokens, each shared leading run counted once."""
    ordered = sorted(tuple(p) for p in prompts)
    shared = sum(common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(len(p) for p in ordered) - shared
