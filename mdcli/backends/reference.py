"""transformers' own forward, the reference every other forward is tested against.

It runs the model as transformers wrote it, with two scoped changes, neither replacing anything in
torch or transformers (another model's forward, or another thread's, keeps their own functions):

* a masked forward of an sdpa model attends through `grouped_sdpa`, registered with transformers'
  AttentionInterface under its own name and switched on in the model's config for that forward
  only: grouped-query heads are read natively, as sdpa's `enable_gqa` reads them, instead of
  transformers copying the whole cache to every query head on every step (it does so whenever a
  mask is given); every call with extras (soft-capping, sinks, position bias) goes to
  transformers' own sdpa function;
* where the plan routes float32 CPU linears to oneDNN (x86-64 with AVX-512), a torch function mode
  (`OneDnnRouting`), entered per forward and local to the calling thread, sends `F.linear` and masked
  `F.scaled_dot_product_attention` calls to mdcli.backends.attention.gemm. The
mode sees every torch call of the forward, about 2 us each, which the routing repays many times
over (measured: notebook/cpu-kernels.md, "The routing as a torch function mode").
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mdcli.backends.attention.gemm import (
    gemm_attention,
    gemm_attention_applies,
    routed_linear,
    sdpa_attention,
)

GROUPED_SDPA = "mdcli_grouped_sdpa"  # the name `grouped_sdpa` is registered under
# keyword arguments that change what attention computes: any of them given means transformers' own sdpa
_SDPA_EXTRAS = ("softcap", "s_aux", "sinks", "position_bias")


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


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention for a masked forward, grouped-query heads read natively.

    query: [B, H, M, D]; key, value: [B, G, N, D]; attention_mask: [B, 1, M, N] additive. Returns
    ([B, M, H, D], None) as transformers' attention functions do. What sdpa_attention_forward
    computes with its grouped-query switch on; calls it cannot take that way go to it unchanged."""
    extras = any(kwargs.get(name) is not None for name in _SDPA_EXTRAS)  # may be tensors: no truth test
    if attention_mask is None or dropout or extras or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return sdpa_attention(query, key, value, attention_mask, scaling, onednn=False), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)  # a name of its own: no entry of transformers' replaced


class ReferenceForward:
    """Callable: (tokens, positions, mask, cache, keep) -> logits of the kept rows, or None.

    tokens, positions: [M] long; mask: [1, 1, M, N + M] additive, a dict of them by layer type, or
    None (a causal continuation that sees the whole cache: the model builds its own mask); keep: [C]
    row indices whose logits are wanted, or None. `onednn`: route this forward's linears and masked
    attention to oneDNN (`OneDnnRouting`)."""

    def __init__(self, model, *, onednn: bool) -> None:
        self.model = model
        self.onednn = onednn
        # the configs whose layers attend with sdpa: a masked forward switches them to grouped_sdpa
        self.sdpa_configs = [config for config in _configs(model) if config._attn_implementation == "sdpa"]

    def kernels(self):
        """The context this forward runs the model in: `OneDnnRouting` where the plan routes to
        oneDNN, else none (a benchmark runs its alternatives in it to compare algorithms alone)."""
        return OneDnnRouting() if self.onednn else nullcontext()

    @contextmanager
    def grouped_attention(self):
        """While inside: this model's sdpa layers attend through `grouped_sdpa` (its config says so
        for the block, then says sdpa again)."""
        for config in self.sdpa_configs:
            config._attn_implementation = GROUPED_SDPA
        try:
            yield
        finally:
            for config in self.sdpa_configs:
                config._attn_implementation = "sdpa"

    def __call__(self, tokens, positions, mask, cache, keep) -> torch.Tensor | None:
        # a causal continuation (mask None) keeps sdpa: transformers reads grouped heads natively there
        with self.kernels(), self.grouped_attention() if mask is not None else nullcontext():
            logits = self.model(
                input_ids=tokens[None, :],
                position_ids=positions[None, :],
                attention_mask=mask,
                **cache_argument(self.model, cache),
                use_cache=True,
                logits_to_keep=keep if keep is not None else 1,
            ).logits[0]
        return None if keep is None else logits  # [C, V]


def _configs(model) -> list[PretrainedConfig]:
    """Every distinct config the model's modules read their attention implementation from."""
    found = {id(module.config): module.config for module in model.modules()
             if isinstance(getattr(module, "config", None), PretrainedConfig)}
    return list(found.values())
