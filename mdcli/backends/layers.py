"""A decoder layer's tensors gathered once for mdcli's forward (mdcli.backends.llama): q, k and v
fused into one weight, gate and up into another, each projection's own weight re-pointed at a row
slice of the fused one (the same memory, so transformers' forward reads the same numbers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mdcli.backends.weights.int8 import fused_int8
from mdcli.backends.weights.row_slices import joined_rows


@dataclass
class Layer:
    """One decoder layer's tensors, gathered once."""

    qkv: torch.Tensor  # [(H + 2G) * D, hidden] fused q/k/v weight (q_proj etc. are views of it), or an Int8Weight
    qkv_bias: torch.Tensor | None  # [(H + 2G) * D]
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * I, hidden] fused gate/up weight
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, I]
    down_bias: torch.Tensor | None
    norm_in: torch.Tensor  # [hidden]
    norm_in_eps: float
    norm_post: torch.Tensor
    norm_post_eps: float
    head_norms: tuple | None  # Qwen3: (q weight [D], q eps, k weight [D], k eps), RMSNorm over each head
    attention: object  # the HF attention module (the attention function reads its attributes)
    act: object
    layer_type: str


def fuse_layer(layer, index: int, config) -> Layer:
    """Decoder layer `index` of a Llama-family model as a Layer, its projections fused (`_fuse`)."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attention.q_proj, attention.k_proj, attention.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    layer_types = getattr(config, "layer_types", None)
    return Layer(
        qkv=qkv, qkv_bias=qkv_bias, o=weight_of(attention.o_proj), o_bias=attention.o_proj.bias,
        gate_up=gate_up, gate_up_bias=gate_up_bias, down=weight_of(mlp.down_proj), down_bias=mlp.down_proj.bias,
        norm_in=layer.input_layernorm.weight, norm_in_eps=layer.input_layernorm.variance_epsilon,
        norm_post=layer.post_attention_layernorm.weight, norm_post_eps=layer.post_attention_layernorm.variance_epsilon,
        head_norms=_head_norms(attention),
        attention=attention, act=mlp.act_fn,
        layer_type=layer_types[index] if layer_types else "full_attention",
    )


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of outputs, in] weight for several linears that read the same input; each linear's
    weight (and bias) becomes a row slice of it, so memory is not doubled. Done once per model:
    a model fused before is recognised by its weights already being consecutive slices."""
    if hasattr(linears[0], "int8"):  # int8 weights (mdcli.backends.weights.int8), fused when quantized
        fused = fused_int8(linears)
    else:
        weights = [m.weight for m in linears]
        fused = None if weights[0].is_meta else joined_rows(weights)  # meta: the blocks replace them (mdcli.models.on_blocks)
        if fused is None and not weights[0].is_meta:
            with torch.inference_mode(False), torch.no_grad():
                fused = torch.cat([w.detach() for w in weights])  # [sum out, in]
                _repoint(linears, "weight", fused)
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return fused, None
    if any(b is None for b in biases):  # some biased, some not: give the missing ones zeros
        with torch.inference_mode(False), torch.no_grad():
            for m in linears:
                if m.bias is None:
                    given = next(b for b in biases if b is not None)
                    m.bias = torch.nn.Parameter(given.new_zeros(m.out_features), requires_grad=False)
        biases = [m.bias for m in linears]
    fused_bias = joined_rows(biases)
    if fused_bias is None:
        with torch.inference_mode(False), torch.no_grad():
            fused_bias = torch.cat([b.detach() for b in biases])
            _repoint(linears, "bias", fused_bias)
    return fused, fused_bias


def weight_of(linear):
    """What a projection multiplies by: its float32 weight, or its `Int8Weight` (mdcli.backends.weights.int8)."""
    return linear.int8 if hasattr(linear, "int8") else linear.weight


def _repoint(linears, name: str, fused) -> None:
    start = 0
    for m in linears:
        rows = getattr(m, name).shape[0]
        requires_grad = getattr(m, name).requires_grad
        setattr(m, name, torch.nn.Parameter(fused[start:start + rows], requires_grad=requires_grad))
        start += rows


def _head_norms(attention) -> tuple | None:
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if q_norm is None:
        return None
    return q_norm.weight, q_norm.variance_epsilon, k_norm.weight, k_norm.variance_epsilon


def with_weights(layers, copies) -> list[Layer]:
    """The layers with each one's (qkv, o, gate_up, down) replaced by its copies."""
    return [Layer(**{**vars(layer), "qkv": qkv, "o": o, "gate_up": gate_up, "down": down})
            for layer, (qkv, o, gate_up, down) in zip(layers, copies)]
