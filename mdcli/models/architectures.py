"""Which models MultiDecode can run exactly, decided from the config alone (before weights load).

MultiDecode puts every branch in one KV cache and tells the model, per token, its depth
(`position_ids`) and its ancestors (a 4D mask). That is exact only when attention is the sole way
tokens see each other and positions enter through `position_ids`:

* ALiBi biases come from the physical key index (or a 2D mask), not from depth: BLOOM and
  Falcon-ALiBi crash on a 4D mask, MPT runs and is silently wrong.
* Recurrent and linear-attention layers (Mamba, RWKV, gated-delta-net hybrids...) carry one state
  per sequence, which cannot hold a tree.
* FlashAttention and other kernels take no arbitrary mask (and HF reads non-monotonic positions as
  packed sequences there); only sdpa and eager use the mask verbatim.

Sliding-window models are fine: the engine folds the window into the mask by depth, and passes a
dict of masks when a model mixes full and sliding layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdcli.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EXACT_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
RECURRENT_MODEL_TYPES = frozenset(
    {
        "bailing_hybrid",
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "lfm2",
        "lfm2_moe",
        "lfm2_vl",
        "lfm3",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "olmo_hybrid",
        "plamo2",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    }
)
# Per-layer block lists some hybrids use instead of `layer_types`.
_BLOCK_TYPE_ATTRS = ("layers_block_type", "block_types")
_STATEFUL_BLOCK_WORDS = ("mamba", "recurrent", "linear", "hybrid", "conv", "rwkv", "ssm")
_MODEL_FIX = "choose a decoder-only model with RoPE or learned positions, e.g. Llama, Qwen2, Mistral"
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def check_exact_support(config: PretrainedConfig, attn_implementation: str) -> None:
    """Raise UnsupportedModelError unless MultiDecode is exact for this config and attention."""
    check_attn_implementation(attn_implementation, model_type(config))
    for cfg in _configs(config):
        problem = _refusal(cfg)
        if problem is not None:
            raise UnsupportedModelError(problem, fix=_MODEL_FIX)


def check_attn_implementation(attn_implementation: str, model_type: str | None = None) -> None:
    """Only sdpa and eager apply an arbitrary 4D mask verbatim."""
    if attn_implementation in EXACT_ATTN_IMPLEMENTATIONS:
        return
    subject = f"{model_type} with attention" if model_type else "attention"
    raise UnsupportedModelError(
        f"{subject} '{attn_implementation}' cannot run MultiDecode exactly: it takes no arbitrary attention mask",
        fix="use --attn sdpa or --attn eager",
    )


def sliding_window_layout(config: PretrainedConfig) -> tuple[int | None, bool]:
    """(window, mixed): the window the engine must fold into the mask, or None, and whether the
    model mixes full and sliding layers (then it needs the dict mask
    {"full_attention": m, "sliding_attention": m_window})."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False or not isinstance(window, int) or window <= 0:
        return None, False
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if layer_types and "sliding_attention" not in layer_types:
        return None, False
    return window, {"full_attention", "sliding_attention"} <= layer_types


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence the model was built for, if its config says."""
    cfg = text_config(config)
    for attr in _CONTEXT_ATTRS:
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_type(config: PretrainedConfig) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's own config (multimodal wrappers nest it), or the config itself."""
    getter = getattr(config, "get_text_config", None)
    try:
        return getter(decoder=True) if getter else config
    except (TypeError, ValueError):
        return config


def _configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    inner = text_config(config)
    return [config] if inner is config else [config, inner]


def _refusal(cfg: PretrainedConfig) -> str | None:
    """Why MultiDecode cannot be exact for this (sub)config, or None."""
    kind = model_type(cfg)
    if getattr(cfg, "is_encoder_decoder", False):
        return f"{kind} is an encoder-decoder model; MultiDecode needs a decoder-only causal LM"
    if _uses_alibi(cfg):
        return f"{kind} uses ALiBi position biases, which follow the physical cache index, not branch depth"
    if kind in RECURRENT_MODEL_TYPES:
        return f"{kind} has recurrent or linear-attention layers whose per-sequence state cannot branch"
    odd = _non_attention_layer_type(cfg)
    if odd is not None:
        return f"{kind} has '{odd}' layers, which a tree attention mask cannot make exact"
    return None


def _uses_alibi(cfg: PretrainedConfig) -> bool:
    if model_type(cfg) in ALIBI_MODEL_TYPES:
        return True
    if getattr(cfg, "alibi", False) or getattr(cfg, "use_alibi", False):
        return True
    if getattr(cfg, "position_embedding_type", None) == "alibi":
        return True
    attn_config = getattr(cfg, "attn_config", None)  # MPT-style remote-code configs
    if isinstance(attn_config, dict):
        return bool(attn_config.get("alibi"))
    return bool(getattr(attn_config, "alibi", False))


def _non_attention_layer_type(cfg: PretrainedConfig) -> str | None:
    for layer_type in getattr(cfg, "layer_types", None) or ():
        if layer_type not in ATTENTION_LAYER_TYPES:
            return str(layer_type)
    for attr in _BLOCK_TYPE_ATTRS:
        for block in getattr(cfg, attr, None) or ():
            if any(word in str(block).lower() for word in _STATEFUL_BLOCK_WORDS):
                return str(block)
    return None
