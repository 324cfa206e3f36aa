"""How much memory a KV cache needs per token (free memory is a host fact: mdcli.backends.host)."""

from __future__ import annotations

from mdcli.models.architectures import text_config


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer: layers x 2 x kv_heads x head_dim x bytes."""
    config = text_config(config)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers * 2 * kv_heads * head_dim * dtype_bytes
