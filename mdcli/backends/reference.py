"""transformers' own forward, the reference every other forward is tested against.

It runs the model as transformers wrote it. Where the plan routes float32 CPU linears to oneDNN
(x86-64 with AVX-512), a torch function mode (`OneDnnRouting`) sends that forward's `F.linear` and
masked `F.scaled_dot_product_attention` calls to mdcli.backends.attention.gemm. A torch function
mode is entered per forward and is local to the calling thread: nothing in torch or transformers
is replaced, and another model's forward, or another thread's, keeps torch's own functions. The
mode sees every torch call of the forward, about 2 us each, which the routing repays many times
over (measured: notebook/cpu-kernels.md, "The routing as a torch function mode").
"""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mdcli.backends.attention.gemm import (
    gemm_attention,
    gemm_attention_applies,
    routed_linear,
)


def cache_argument(model, cache) -> dict:
    """The keyword a model's forward (and `generate`) takes its KV cache by: `cache` where the
    forward declares it (transformers 5.24 renamed `past_key_values`, warns on the old name and
    removes it in 5.40), else `past_key_values` (earlier 5.x, which would take an unknown `cache`
    into **kwargs and run without one). Use as `model(..., **cache_argument(model, cache))`."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class OneDnnRouting(TorchFunctionMode):
    """While entered, in this thread: float32 CPU `F.linear` without autograd runs on oneDNN, and
    masked multi-query float32 CPU `F.scaled_dot_product_attention` as oneDNN products; every other
    call goes to torch unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return routed_linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            routed = _attention(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p or is_causal or not gemm_attention_applies(query, key, value, attn_mask):
        return None
    return gemm_attention(query, key, value, attn_mask, scale)  # [1, H, M, Dv], as sdpa returns


class ReferenceForward:
    """Callable: (tokens, positions, mask, cache, keep) -> logits of the kept rows, or None.

    tokens, positions: [M] long; mask: [1, 1, M, N + M] additive, a dict of them by layer type, or
    None (a causal continuation that sees the whole cache: the model builds its own mask); keep: [C]
    row indices whose logits are wanted, or None. `onednn`: route this forward's linears and masked
    attention to oneDNN (`OneDnnRouting`)."""

    def __init__(self, model, *, onednn: bool) -> None:
        self.model = model
        self.onednn = onednn

    def kernels(self):
        """The context this forward runs the model in: `OneDnnRouting` where the plan routes to
        oneDNN, else none (a benchmark runs its alternatives in it to compare algorithms alone)."""
        return OneDnnRouting() if self.onednn else nullcontext()

    def __call__(self, tokens, positions, mask, cache, keep) -> torch.Tensor | None:
        with self.kernels():
            logits = self.model(
                input_ids=tokens[None, :],
                position_ids=positions[None, :],
                attention_mask=mask,
                **cache_argument(self.model, cache),
                use_cache=True,
                logits_to_keep=keep if keep is not None else 1,
            ).logits[0]
        return None if keep is None else logits  # [C, V]

