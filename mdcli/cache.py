"""The shared KV cache: the only module that touches transformers' cache internals.

There is no public transformers API for removing tokens from the middle of a cache, so this
module keeps that knowledge in one place and checks it at run time (`assert_compactable`).
Facts it relies on (transformers 5.x, see shared/notes/multidecode-on-transformers.md):

* `DynamicCache()` created WITHOUT `config=` gives plain full layers. With a config, sliding
  window models get layers that trim by physical index, which breaks interleaved branches: the
  engine folds the window into the mask instead.
* Each layer's `keys` / `values` are tensors [batch=1, kv_heads, N, head_dim]; replacing them by
  an `index_select` along dim -2 removes tokens, and `get_seq_length()` follows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import Cache


def new_cache() -> Cache:
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def compact(cache: Cache, keep: torch.Tensor) -> None:
    """Keep only the cache slots in `keep` ([K] long, ascending), in every layer."""
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def cache_bytes(cache: Cache) -> int:
    """Bytes held by keys and values (what a per-branch copy would multiply)."""
    total = 0
    for layer in _layers(cache):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def _layers(cache: Cache) -> list:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError("this transformers version has no Cache.layers; mdcli needs transformers 5")
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise RuntimeError(
                f"cache layer {type(layer).__name__} cannot be compacted exactly; "
                "mdcli only compacts full DynamicLayer caches"
            )
    return layers
