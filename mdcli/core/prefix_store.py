"""What a run asks of a prompt cache: the keys and values of prompt prefixes it prefilled before.

The run (mdcli.core.run) is handed a `PrefixStore` (mdcli.prompt_cache.store.PromptStore is one,
chosen at load for one model, dtype and kernel plan) and asks it two things around a prefill: the
longest cached prefix of the prompts' shared tokens, before feeding them, and to keep the new
shared prefix, after. Core knows nothing of files: a store answers with tensors and keeps its own
notes (a bad entry it skipped), which the run passes on as `note` events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

# one layer's (keys, values), each [1, kv_heads, n, head_dim], as the engine's cache holds them
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefixHit:
    """A cached prefix: its first `tokens` token ids' keys and values, layer by layer."""

    tokens: int
    kv: list[LayerKV]


class PrefixStore(Protocol):
    """A cache of prompt prefixes for ONE model under one numerics (whoever builds it keys it)."""

    # a shared prefix shorter than this is neither looked up nor kept (see mdcli.prompt_cache.store)
    min_tokens: int

    def longest(self, ids: list[int]) -> PrefixHit | None:
        """The cached entry sharing the most leading tokens with `ids` (at least `min_tokens`),
        its keys and values cut to the shared length; None when none does."""

    def save(self, ids: list[int], kv: list[LayerKV]) -> None:
        """Keep `kv` ([1, H, len(ids), D] per layer) as the keys and values of `ids`."""

    def take_notes(self) -> list[str]:
        """One line per problem met since the last call (a bad entry skipped, a failed write)."""
