"""The token forest: every token in the shared KV cache, in cache (physical) order.

MultiDecode's invariant, which every other module relies on:

* a token's position id is its depth in its tree (root tokens have depth 0);
* a token attends to exactly its ancestors and itself.

A node's ancestry is carried as an *ancestor row*: a bool vector over physical cache slots that is
True at the node's ancestors and the node itself. Rows belong to whoever holds a place in the
forest (a branch tip, a fork point): the forest stores only per-token facts (token id, depth,
parent). Because parents always sit physically before their children, a row's True slots, in
order, are the node's root-to-node path, and the row's popcount is the depth of the node's next
child. Rows may be shorter than the cache: slots appended after a row was made are never its
ancestors, so missing columns read as False (`pad_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ChainLayout:
    """Where C chains of new tokens (M in all) go when appended after N cached tokens."""

    positions: torch.Tensor  # [M] long: depth of each new token
    parents: torch.Tensor  # [M] long: parent slot of each new token, -1 for a root
    allowed: torch.Tensor  # [M, N + M] bool: what each new token attends to (ancestors + itself)
    ends: torch.Tensor  # [C] long: index among the M new tokens of each chain's last token


def layout_chains(
    rows: torch.Tensor, lengths: list[int], n_cache: int, start_depths: torch.Tensor | None = None
) -> ChainLayout:
    """Lay chains out after the cache. rows: [C, n <= N] bool, the place each chain hangs off.

    A chain's first token normally sits one below its parent (depth = popcount of the parent's
    row). `start_depths` ([C] long) overrides that for deliberate, labelled approximations such
    as the Multiverse merge, where one token attends to several branches at max depth + 1.
    """
    if min(lengths) < 1:
        raise ValueError("every chain needs at least one token")
    past = pad_rows(rows, n_cache)  # [C, N]
    if start_depths is None and max(lengths) == 1:
        return _one_token_each(past, n_cache)
    device = rows.device
    lengths_t = torch.tensor(lengths, device=device)  # [C]
    n_new = int(lengths_t.sum())
    chain_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)  # [M]
    starts = torch.cumsum(lengths_t, 0) - lengths_t  # [C]
    offset = torch.arange(n_new, device=device) - starts[chain_of]  # [M] index within its chain

    # a chain's first token sits one below its parent: depth = popcount(parent's row)
    first_depth = past.sum(-1) if start_depths is None else start_depths.to(device)  # [C]
    positions = first_depth[chain_of] + offset  # [M]
    same_chain = chain_of[:, None] == chain_of[None, :]  # [M, M]
    not_later = offset[:, None] >= offset[None, :]  # [M, M]
    allowed = torch.cat([past[chain_of], same_chain & not_later], dim=1)  # [M, N + M]
    slots = torch.arange(n_new, device=device) + n_cache  # [M]
    parents = torch.where(offset == 0, _last_true(past)[chain_of], slots - 1)  # [M]
    return ChainLayout(positions=positions, parents=parents, allowed=allowed, ends=starts + lengths_t - 1)


def _one_token_each(past: torch.Tensor, n_cache: int) -> ChainLayout:
    """`layout_chains` for a decode step, C chains of one token each, in a handful of ops: each
    token sits one below its row's tip and attends to its row and itself (the general layout's small
    tensor ops cost a fixed time a step whatever the branch count: notebook/step-loop.md, "Less
    per-branch glue")."""
    c = past.shape[0]
    own = torch.eye(c, dtype=torch.bool, device=past.device)  # [C, C]
    ends = torch.arange(c, device=past.device)  # [C]
    return ChainLayout(positions=past.sum(-1), parents=_last_true(past), allowed=torch.cat([past, own], 1), ends=ends)


def layout_trees(rows: torch.Tensor, parents: list[list[int]], n_cache: int) -> ChainLayout:
    """Lay out C token trees after the cache: a chain generalised (speculative drafts).

    rows: [C, n <= N] bool, the place each tree hangs off. parents[c][i] is the index, within
    tree c, of node i's parent, or -1 for a node hanging directly off rows[c]; parents come
    before their children. Every node attends to the tree's row plus its own ancestors within
    the tree, at depth = its parent's depth + 1. `ends` holds every node (all of them get logits).
    """
    device = rows.device
    past = pad_rows(rows, n_cache)  # [C, N]
    base_depth = past.sum(-1).tolist()  # [C]
    tips = _last_true(past).tolist()  # [C]
    depth, parent_slot, tree_of, cells = [], [], [], []
    start = 0
    for c, tree in enumerate(parents):
        ancestors: list[list[int]] = []  # per node: its in-forward ancestors and itself
        for i, p in enumerate(tree):
            if not -1 <= p < i:
                raise ValueError("a tree node's parent must come before it")
            ancestors.append((ancestors[p] if p >= 0 else []) + [start + i])
            depth.append(base_depth[c] + len(ancestors[-1]) - 1)
            parent_slot.append(tips[c] if p < 0 else n_cache + start + p)
            tree_of.append(c)
            cells.extend((start + i, j) for j in ancestors[-1])
        start += len(tree)
    n_new = start
    own = torch.zeros(n_new, n_new, dtype=torch.bool, device=device)  # [M, M]
    index = torch.tensor(cells, dtype=torch.long, device=device).reshape(-1, 2)  # [cells, 2]
    own[index[:, 0], index[:, 1]] = True
    tree_index = torch.tensor(tree_of, dtype=torch.long, device=device)  # [M]
    return ChainLayout(
        positions=torch.tensor(depth, dtype=torch.long, device=device),
        parents=torch.tensor(parent_slot, dtype=torch.long, device=device),
        allowed=torch.cat([past[tree_index], own], dim=1),  # [M, N + M]
        ends=torch.arange(n_new, device=device),
    )


def _last_true(rows: torch.Tensor) -> torch.Tensor:
    """[C, N] bool -> [C] index of the last True per row (a row's tip), -1 where none."""
    if rows.shape[1] == 0:
        return torch.full((rows.shape[0],), -1, dtype=torch.long, device=rows.device)
    slots = torch.arange(rows.shape[1], device=rows.device)  # [N]
    return torch.where(rows, slots, -1).amax(1)  # a max, not an argmax: torch's CPU argmax is slow


def pad_rows(rows: torch.Tensor, length: int) -> torch.Tensor:
    """rows: [C, n] bool, n <= length -> [C, length] with False in the new columns."""
    missing = length - rows.shape[-1]
    if missing < 0:
        raise ValueError(f"ancestor rows are longer ({rows.shape[-1]}) than the cache ({length})")
    if missing == 0:
        return rows
    return torch.nn.functional.pad(rows, (0, missing), value=False)


def stack_rows(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Rows of different lengths -> one [C, length] bool tensor (one stack and one pad when they
    are all as long, as a decode step's rows are: no op per row)."""
    width = rows[0].shape[0]
    if all(r.shape[0] == width for r in rows):
        return pad_rows(torch.stack(list(rows)), length)
    return torch.stack([pad_rows(r.unsqueeze(0), length)[0] for r in rows])


class Forest:
    """Per-token facts for the shared cache, kept in step with it (append and compact together)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.tokens = torch.empty(0, dtype=torch.long, device=self.device)  # [N]
        self.depth = torch.empty(0, dtype=torch.long, device=self.device)  # [N]
        self.parent = torch.empty(0, dtype=torch.long, device=self.device)  # [N], -1 for roots
        # (parent slot, token id) -> slot: lets a new prompt find the longest path already cached
        self._child: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def empty_row(self) -> torch.Tensor:
        """The row of a new root: it attends to nothing already in the cache."""
        return torch.zeros(len(self), dtype=torch.bool, device=self.device)

    def append(self, tokens: torch.Tensor, depth: torch.Tensor, parent: torch.Tensor) -> None:
        """tokens, depth, parent: [M] long, in the order they enter the cache."""
        first = len(self)
        self.tokens = torch.cat([self.tokens, tokens])
        self.depth = torch.cat([self.depth, depth])
        self.parent = torch.cat([self.parent, parent])
        self._index(first)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the slots in `keep` ([K] long, ascending); re-point parents to new slots.

        Every kept node's parent must be kept too (true whenever `keep` is a union of rows).
        """
        new_index = torch.full((len(self),), -1, dtype=torch.long, device=self.device)
        new_index[keep] = torch.arange(keep.shape[0], device=self.device)
        parent = self.parent[keep]
        self.parent = torch.where(parent >= 0, new_index[parent.clamp(min=0)], parent)
        self.tokens = self.tokens[keep]
        self.depth = self.depth[keep]
        self._child = {}
        self._index(0)

    def keep_tail(self, start: int, keep: torch.Tensor) -> None:
        """Keep slots [0, start) and, of the slots after, only `keep` ([K] long, ascending, >=
        start), which move down to [start, start + K): a speculative step's rejected drafts leave.

        A kept node's parent must be below `start` or kept too.
        """
        for slot in range(start, len(self)):  # forget the index entries of every tail slot
            key = (int(self.parent[slot]), int(self.tokens[slot]))
            if self._child.get(key) == slot:
                del self._child[key]
        new_index = torch.arange(len(self), device=self.device)
        new_index[keep] = torch.arange(start, start + keep.shape[0], device=self.device)
        parent = self.parent[keep]
        parent = torch.where(parent >= start, new_index[parent.clamp(min=0)], parent)
        self.tokens = torch.cat([self.tokens[:start], self.tokens[keep]])
        self.depth = torch.cat([self.depth[:start], self.depth[keep]])
        self.parent = torch.cat([self.parent[:start], parent])
        self._index(start)

    def _index(self, first: int) -> None:
        """Record slots [first, N) in the (parent, token) -> slot index; the first slot wins."""
        pairs = zip(self.parent[first:].tolist(), self.tokens[first:].tolist())
        for slot, key in enumerate(pairs, start=first):
            self._child.setdefault(key, slot)

    def longest_cached_prefix(self, tokens: list[int], limit: int) -> tuple[int, int]:
        """Follow `tokens` down from the roots through cached slots, at most `limit` tokens.

        Returns (how many tokens matched, slot of the last matched token or -1). Any cached node
        whose path equals the prompt's prefix will do: a node's keys and values depend only on
        its path, so hanging the rest of the prompt there is exact.
        """
        slot, matched = -1, 0
        for token in tokens[:limit]:
            nxt = self._child.get((slot, token))
            if nxt is None:
                break
            slot, matched = nxt, matched + 1
        return matched, slot

    def path_token_ids(self, row: torch.Tensor) -> list[int]:
        """The tokens a row attends to, root first: the sequence to replay a branch alone."""
        return self.tokens[: row.shape[0]][row].tolist()

    def ancestors(self, node: int) -> list[int]:
        """Slots of `node`'s ancestors and itself, root first, by walking parents (slow; tests)."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]

    def row_of(self, node: int) -> torch.Tensor:
        """The ancestor row of an existing node, built from parent links (explain, tests)."""
        row = self.empty_row()
        row[self.ancestors(node)] = True
        return row
