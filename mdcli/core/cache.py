"""The shared KV cache: the only module that touches transformers' cache internals.

There is no public transformers API for removing tokens from the middle of a cache, so this
module keeps that knowledge in one place and checks it at run time (every layer a plain
full-attention one, or a refusal naming the layer: `_layers`).
Facts it relies on (transformers 5.x):

* A cache created WITHOUT `config=` (as `new_cache` makes one) gives plain full layers. With a
  config, sliding window models get layers that trim by physical index, which breaks interleaved
  branches: the engine folds the window into the mask instead.
* Each layer's `keys` / `values` are tensors [batch, kv_heads, N, head_dim]; replacing them by
  an `index_select` along dim -2 removes tokens, and `get_seq_length()` follows.
* `DynamicLayer.update` appends with `torch.cat`, copying the whole cache on every step. The
  `GrowingLayer` here keeps a preallocated buffer that grows by a quarter when full (amortised
  O(new tokens) per step) and hands attention a view of its filled part. A forward on static
  buffers (mdcli.backends.graphs) reserves room, writes past the filled part itself and sets the
  length: `reserve`, `buffers`, `set_length`. Slots past the filled part hold finite numbers
  (zeros, or keys and values dropped since), so attention over the whole buffer with those slots
  masked adds exact zeros.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer


def output_cache(output):
    """The KV cache a model output (or a generate output) carries: `cache` since transformers
    5.24 (reading `past_key_values` there warns), `past_key_values` before."""
    return output["cache"] if "cache" in output else output.past_key_values


def new_cache(capacity: int = 0) -> Cache:
    """An empty cache of plain full-attention layers (see the module notes for why no config),
    each a `GrowingLayer`; capacity: slots each layer makes room for at its first write (a prefill
    of known size then never grows its buffer midway)."""
    return Cache(layer_class_to_replicate=partial(GrowingLayer, capacity) if capacity else GrowingLayer)


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose keys/values live in a buffer that grows by a quarter when full.

    A quarter, not double: a doubled buffer can hold twice the slots in use; a quarter's growth
    copies the cache about four times over its life instead of twice, milliseconds against seconds
    of decoding (notebook/memory.md)."""

    min_capacity = 256
    growth = 1.25

    def __init__(self, first_capacity: int = 0) -> None:
        super().__init__()
        self.first_capacity = first_capacity  # the room made at the first write, if more than it needs

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self._length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        self.reserve(end)
        self._k[..., start:end, :] = key_states
        self._v[..., start:end, :] = value_states
        self._length = end
        return self.keys, self.values

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, [B, H, capacity, D] each: the filled part first."""
        return self._k, self._v

    def set_length(self, length: int) -> None:
        """The filled part is now slots [0, length) (a forward wrote them into `buffers` itself)."""
        self._length = length

    def reserve(self, needed: int) -> None:
        """Room for `needed` slots in the buffer (it grows by a quarter, or to `needed`, when full)."""
        capacity = self._k.shape[-2]
        if needed <= capacity:
            return
        capacity = max(needed, int(self.growth * capacity), self.min_capacity, self.first_capacity if not capacity else 0)
        self._k = _regrow(self._k, self._length, capacity)
        self._v = _regrow(self._v, self._length, capacity)

    @property
    def keys(self):  # [B, H, N, D] view of the filled part
        return None if not self.is_initialized else self._k[..., : self._length, :]

    @keys.setter
    def keys(self, tensor) -> None:
        if tensor is None or tensor.dim() < 4:  # reset by the base class
            self.is_initialized = False
            return
        self._k, self._length = tensor, tensor.shape[-2]

    @property
    def values(self):
        return None if not self.is_initialized else self._v[..., : self._length, :]

    @values.setter
    def values(self, tensor) -> None:
        if tensor is None or tensor.dim() < 4:
            return
        self._v = tensor

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0


def _regrow(buffer, length: int, capacity: int):
    # zeros, not empty memory: a static forward attends over the whole buffer, masked slots too,
    # and a NaN there would poison the sum that its zero weight should leave untouched
    grown = buffer.new_zeros((*buffer.shape[:2], capacity, buffer.shape[-1]))
    grown[..., :length, :] = buffer[..., :length, :]
    return grown


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def compact(cache: Cache, keep: torch.Tensor) -> None:
    """Keep only the cache slots in `keep` ([K] long, ascending), in every layer: a growing layer
    moves them down inside its buffer, which keeps its room (the next tokens need not grow it)."""
    keep_tail(cache, 0, keep)


def keep_tail(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep slots [0, start) and, after them, only `keep` ([K] long, ascending, >= start), moved
    down to [start, start + K). A growing layer moves them inside its buffer (no copy of the
    cache); other layers fall back to a full `compact`."""
    with torch.inference_mode():  # the buffers were made inside the model's forward
        for layer in _layers(cache):
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0:
                _keep_tail_of_layer(layer, start, keep)


def _keep_tail_of_layer(layer, start: int, keep: torch.Tensor) -> None:
    index = keep.to(layer.keys.device)
    if type(layer) is GrowingLayer:
        kept_k, kept_v = layer._k.index_select(-2, index), layer._v.index_select(-2, index)  # [B, H, K, D]
        layer._k[..., start : start + index.shape[0], :] = kept_k
        layer._v[..., start : start + index.shape[0], :] = kept_v
        layer._length = start + index.shape[0]
        return
    whole = torch.cat([torch.arange(start, device=index.device), index])
    keys, values = layer.keys.index_select(-2, whole), layer.values.index_select(-2, whole)
    layer.keys, layer.values = keys, values


def prefix_kv(cache: Cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the keys and values of slots [0, n), layer by layer ([1, H, n, D] each): what a
    prompt cache keeps of a prefix laid down first."""
    return [(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone()) for layer in _layers(cache)]


def load_prefix(cache: Cache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write a prefix's keys and values ([1, H, n, D] per layer) into an empty cache, through the
    layers' own `update`, as a prefill of those tokens would have left them."""
    if cache_length(cache):
        raise RuntimeError("a cached prefix goes into an empty cache only")
    with torch.inference_mode():  # as the model's forward makes its buffers
        for index, (keys, values) in enumerate(kv):
            cache.update(keys, values, index)


def append(cache: Cache, other: Cache) -> None:
    """Lay every slot of `other` (a cache of the same model, filled apart) after this one's, layer
    by layer, through the layers' own `update`, as a prefill of those tokens here would have left
    their keys and values had it attended to nothing already here."""
    with torch.inference_mode():  # as the model's forward makes its buffers
        for index, layer in enumerate(_layers(other)):
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0:
                cache.update(layer.keys, layer.values, index)


def cache_bytes(cache: Cache) -> int:
    """Bytes held by keys and values (what a per-branch copy would multiply)."""
    total = 0
    for layer in _layers(cache):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def _layers(cache: Cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError("this transformers version has no Cache.layers; mdcli needs transformers 5")
    for layer in layers:
        if type(layer) is not DynamicLayer and type(layer) is not GrowingLayer:
            raise RuntimeError(
                f"cache layer {type(layer).__name__} cannot be compacted exactly; "
                "mdcli only compacts full DynamicLayer caches"
            )
    return layers
