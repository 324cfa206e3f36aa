"""Which models mdcli's own decode forward (mdcli.backends.llama) reproduces exactly.

It rewrites the Llama family's decoder layer (Llama, Mistral, Qwen2, Qwen3) as fused products over
the same weights (or over mdcli's own int8 copies of them: mdcli.backends.weights.int8); anything else in a
model (another architecture, eager attention, other quantized or wrapped linears, another norm)
keeps transformers' own forward, the reference.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mdcli.backends.weights.int8 import has_int8_weights, int8_linear_class

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
def unsupported_reason(model) -> str | None:
    """Why this model keeps transformers' forward (None: it can use mdcli's)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return "only the sdpa attention implementation is reproduced"
    inner = getattr(model, "model", None)
    int8 = has_int8_weights(model)  # every projection and the head Int8Linear (mdcli.backends.weights.int8)
    dense = int8_linear_class() if int8 else nn.Linear
    if inner is None or not hasattr(inner, "layers") or type(getattr(model, "lm_head", None)) is not dense:
        return "unexpected module layout"
    if type(inner.embed_tokens) is not nn.Embedding:
        return "the embedding is not a plain nn.Embedding"
    if len(inner.layers) != config.num_hidden_layers:
        return "layer count differs from the config"
    for layer in inner.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not dense or not _plain(m.values if int8 else m.weight) for m in linears):
            return "a projection is not a plain dense nn.Linear or mdcli's Int8Linear (quantized or wrapped weights)"
        head_norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
        if any(n is not None for n in head_norms) and not all(n is not None and _plain_rms_norm(n) for n in head_norms):
            return "query/key norms other than Qwen3's RMSNorm over each head are not reproduced"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not _plain_rms_norm(norm):
                return f"norm {type(norm).__name__} is not the plain Llama RMSNorm"
    if not _plain_rms_norm(inner.norm):
        return "the final norm is not the plain Llama RMSNorm"
    return None


def _plain(tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided


def _plain_rms_norm(norm) -> bool:
    name = type(norm).__name__
    plain = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
    return name in plain and hasattr(norm, "variance_epsilon")
