"""The engine: one forward pass for many chains of new tokens over one shared KV cache.

It knows token ids, ancestor rows and the model; it knows nothing of tokenizers, strategies or
display. A *chain* is a run of new tokens hanging off one place in the forest, given by that
place's ancestor row (see forest.py). A decode step is k chains of one token each; a prompt
prefill is one long chain (cut into pieces that fit `max_forward_tokens`); prompts that share a
prefix are a chain per radix-tree edge.

For every new token the engine gives the model:
* `position_ids` = its depth (the number of tokens it attends to, itself excluded);
* an additive float mask row in the model dtype: 0 at its ancestors and itself, dtype-min
  elsewhere (a bool or 0/1 mask is silently *added* to scores by eager attention), with the
  model's sliding window folded in by depth when it has one.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from mdcli.core import cache as kv
from mdcli.core.forest import Forest, layout_chains, layout_trees, pad_rows, stack_rows


class ModelForward(Protocol):
    """What the engine is handed (mdcli.backends.forward builds one per model, at load).

    Called as forward(tokens, positions, mask, cache, keep): tokens, positions [M] long; mask
    [1, 1, M, N + M] additive in `dtype`, a dict of them by layer type, or None for a causal
    continuation that sees the whole cache; keep [C] row indices or None. Returns [C, V] logits
    in the model's dtype, or None when keep is None."""

    device: torch.device
    dtype: torch.dtype

    def __call__(self, tokens, positions, mask, cache, keep) -> torch.Tensor | None: ...

    def describe(self) -> str:
        """What runs the forwards and why: the `start` event's `kernels`."""


@dataclass
class ChainResult:
    """What a chain's last token left behind."""

    row: torch.Tensor  # [N_after] bool: ancestor row of the chain's last token
    logits: torch.Tensor | None  # [V] float32 next-token logits after the chain, if asked for


@dataclass
class TreeResult:
    """What every node of a fed token tree left behind (speculative verification)."""

    rows: torch.Tensor  # [n, N_after] bool: each node's ancestor row
    logits: torch.Tensor  # [n, V] float32: next-token logits after each node


class Engine:
    """Feeds chains and token trees to the forward it is handed, over one KV cache it owns."""

    def __init__(
        self,
        model_forward: ModelForward,
        *,
        sliding_window: int | None = None,
        mixed_layer_types: bool = False,
        max_forward_tokens: int = 1024,
        capacity: int = 0,
    ) -> None:
        self.model_forward = model_forward
        self.device = model_forward.device
        self.dtype = model_forward.dtype
        self.sliding_window = sliding_window
        self.mixed_layer_types = mixed_layer_types
        self.max_forward_tokens = max_forward_tokens
        self.forest = Forest(self.device)
        self.cache = kv.new_cache(capacity)  # capacity: the slots a prefill of known size will fill
        self.forwards = 0
        self.peak_tokens = 0
        self.compactions = 0
        self._neg = torch.finfo(self.dtype).min
        self._captures_before = getattr(model_forward, "graph_captures", 0)

    def graph_captures(self) -> int:
        """CUDA graphs the forward captured while this engine ran (a forward without them: 0)."""
        return getattr(self.model_forward, "graph_captures", 0) - self._captures_before

    def __len__(self) -> int:
        return len(self.forest)

    # -- one forward -------------------------------------------------------------------------

    def forward(
        self,
        rows: torch.Tensor,
        chains: list[list[int]],
        *,
        logits: bool = True,
        start_depths: torch.Tensor | None = None,
    ) -> list[ChainResult]:
        """Feed every chain in ONE forward.

        rows:   [C, n] bool, n <= N: the row each chain hangs off (all False for a new root).
        chains: C non-empty lists of token ids.
        start_depths: [C] long, only for deliberate approximations (see forest.layout_chains);
            by default positions follow the rows and the result is exact.
        Returns one ChainResult per chain, rows sized to the cache after this forward.
        """
        n_cache = len(self.forest)
        layout = layout_chains(rows.to(self.device), [len(c) for c in chains], n_cache, start_depths)
        tokens = torch.tensor([t for c in chains for t in c], dtype=torch.long, device=self.device)  # [M]
        linear = len(chains) == 1 and start_depths is None and bool(layout.allowed[0, :n_cache].all())
        out = self._run_model(tokens, layout.positions, layout.allowed, layout.ends if logits else None, linear)
        self.forest.append(tokens, layout.positions, layout.parents)
        self.peak_tokens = max(self.peak_tokens, len(self.forest))
        new_rows = layout.allowed[layout.ends]  # [C, N + M]: each chain end's ancestors and itself
        return [
            ChainResult(row=new_rows[i], logits=None if out is None else out[i]) for i in range(len(chains))
        ]

    def forward_trees(self, rows: torch.Tensor, parents: list[list[int]], tokens: list[list[int]]) -> list[TreeResult]:
        """Feed C token trees in ONE forward and keep the logits of every node.

        rows: [C, n] bool, the row each tree hangs off; parents[c][i]: the parent of node i within
        tree c, -1 for a node hanging off rows[c] (see forest.layout_trees); tokens[c][i]: its id.
        A chain is the tree [-1, 0, 1, ...]. The nodes stay in the cache: `keep_tail` drops the
        ones nobody kept.
        """
        n_cache = len(self.forest)
        layout = layout_trees(rows.to(self.device), parents, n_cache)
        flat = torch.tensor([t for tree in tokens for t in tree], dtype=torch.long, device=self.device)  # [M]
        logits = self._run_model(flat, layout.positions, layout.allowed, layout.ends)  # [M, V]
        self.forest.append(flat, layout.positions, layout.parents)
        self.peak_tokens = max(self.peak_tokens, len(self.forest))
        results, start = [], 0
        for tree in tokens:
            end = start + len(tree)
            results.append(TreeResult(rows=layout.allowed[start:end], logits=logits[start:end]))
            start = end
        return results

    def keep_tail(self, start: int, keep: torch.Tensor) -> None:
        """Drop the slots from `start` on except `keep` ([K] long, ascending), which move down to
        [start, start + K). Rows made before `start` stay valid as they are; a row over the old
        tail maps to the new cache as `torch.cat([row[:start], row[keep]])`."""
        if keep.shape[0] == len(self.forest) - start:
            return
        kv.keep_tail(self.cache, start, keep)
        self.forest.keep_tail(start, keep)

    def _run_model(self, tokens, positions, allowed, keep_logits, linear=False) -> torch.Tensor | None:
        """tokens, positions: [M]; allowed: [M, N + M] bool; keep_logits: [C] indices or None.

        `linear`: one chain that sees the whole cache, i.e. an ordinary causal continuation (a
        document's prefill): the model builds its own causal mask, which lets sdpa use its
        causal kernel instead of reading an explicit mask.
        """
        mask = None if linear else self._additive(allowed)  # [1, 1, M, N + M]
        if self.sliding_window is not None and not linear:
            windowed = self._additive(allowed & self._inside_window(positions))
            mask = {"full_attention": mask, "sliding_attention": windowed} if self.mixed_layer_types else windowed
        logits = self.model_forward(tokens, positions, mask, self.cache, keep_logits)  # [C, V] or None
        self.forwards += 1
        if keep_logits is None:
            return None
        return logits.float()  # [C, V]

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, self._neg)[None, None]

    def _inside_window(self, positions: torch.Tensor) -> torch.Tensor:
        """[M, N + M] bool: key depth within the window of the query depth (HF: q - k < window)."""
        key_depth = torch.cat([self.forest.depth, positions])  # [N + M]
        return (positions[:, None] - key_depth[None, :]) < self.sliding_window

    # -- many forwards ------------------------------------------------------------------------

    def extend(self, rows: list[torch.Tensor], chains: list[list[int]]) -> list[ChainResult]:
        """Like `forward`, but cut into forwards of at most `max_forward_tokens` new tokens.

        Long chains (a document) are fed piece by piece; short ones are packed together.
        Logits are computed only for each chain's last token.
        """
        return run_to_end(self.extend_steps(rows, chains))

    def extend_steps(
        self, rows: list[torch.Tensor], chains: list[list[int]]
    ) -> Generator[int, None, list[ChainResult]]:
        """`extend`, yielding the number of tokens fed after each forward (for progress) and
        returning the results."""
        pending = [(i, rows[i], list(chain)) for i, chain in enumerate(chains)]
        results: list[ChainResult | None] = [None] * len(chains)
        while pending:
            batch, budget = [], self.max_forward_tokens
            while pending and budget > 0:
                i, row, toks = pending.pop(0)
                take = toks[:budget]
                batch.append((i, row, take, toks[len(take):]))
                budget -= len(take)
            stacked = stack_rows([r for _, r, _, _ in batch], len(self.forest))
            outs = self.forward(stacked, [take for _, _, take, _ in batch])
            for (i, _, _, rest), out in zip(batch, outs):
                if rest:
                    pending.append((i, out.row, rest))
                else:
                    results[i] = out
            yield self.max_forward_tokens - budget
        return results  # type: ignore[return-value]

    # -- cache housekeeping --------------------------------------------------------------------

    def compact(self, rows: torch.Tensor) -> torch.Tensor:
        """Drop every cache slot that none of `rows` attends to; return the rows remapped.

        rows: [L, n] bool, every row anyone still holds (live tips, fork points).
        Returns [L, K] bool over the compacted cache.
        """
        rows = pad_rows(rows.to(self.device), len(self.forest))  # [L, N]
        keep = rows.any(0).nonzero().flatten()  # [K] ascending
        kv.compact(self.cache, keep)
        self.forest.compact(keep)
        self.compactions += 1
        return rows[:, keep]

    def cache_bytes(self) -> int:
        return kv.cache_bytes(self.cache)

    def append_apart(self, other: Engine) -> int:
        """Lay `other`'s cache and forest (filled apart, over the same forward) after this one's;
        returns where its slot 0 now sits. Its rows map to this cache as `[zeros(offset), row]`."""
        offset = len(self.forest)
        kv.append(self.cache, other.cache)
        parent = other.forest.parent
        self.forest.append(other.forest.tokens, other.forest.depth, torch.where(parent >= 0, parent + offset, parent))
        self.forwards += other.forwards
        self.peak_tokens = max(self.peak_tokens, len(self.forest))
        return offset

    # -- a prompt cache's prefixes -------------------------------------------------------------

    def load_prefix(self, ids: list[int], prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Lay a cached prefix down in an empty cache: `ids` as one chain at slots [0, n) (depths
        0..n-1), their keys and values ([1, H, n, D] per layer) as a prefill would leave them."""
        n = len(ids)
        kv.load_prefix(self.cache, [(k.to(self.device), v.to(self.device)) for k, v in prefix_kv])
        depth = torch.arange(n, device=self.device)  # [n]
        self.forest.append(torch.tensor(ids, dtype=torch.long, device=self.device), depth, depth - 1)
        self.peak_tokens = max(self.peak_tokens, len(self.forest))

    def prefix_kv(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the keys and values of slots [0, n), layer by layer ([1, H, n, D] each)."""
        return kv.prefix_kv(self.cache, n)


R = TypeVar("R")


def run_to_end(steps: Generator[object, None, R]) -> R:
    """Exhaust a generator and return its return value (for callers that want no progress)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
