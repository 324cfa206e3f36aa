#!/usr/bin/env python3
"""Write a random Llama-shaped .gguf that transformers and llama.cpp both load: for memory checks.

    python benchmarks/random_gguf.py OUT.gguf --kind Q4_K_M [--shape 1b]

The file holds random block codes with small float16 scales for every projection and the (tied)
embedding, float32 norms of ones, the Llama metadata of the chosen shape, and the embedded model's
tokenizer (its 49,152-token vocabulary and chat template), so `mdcli ask-many -m OUT.gguf` runs on
it. The codes are written directly, not quantized from float32 weights: a 1B file is written in
seconds (mdcli.backends.weights.gguf_kinds.random_blocks).

--kind is one type for every matrix (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) or one of llama.cpp's
mixed file types (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K), each tensor typed as `llama-quantize` types
it (MIXES, `tensor_kind`), falling back to Q5_0/Q5_1/Q8_0 where a row is not whole super-blocks of
256, as llama.cpp does (the 135M model's 576-wide rows). tests/test_kquant_files.py writes its
tiny files with the same code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.backends.weights.gguf_kinds import random_blocks  # noqa: E402
from mdcli.models.embedded import embedded_gguf_path  # noqa: E402

# (hidden, layers, intermediate, heads, kv heads): Llama-3.2-1B's shape, SmolLM2-135M's, small
# ones for tests; SmolLM2's vocabulary
SHAPES = {"1b": (2048, 16, 8192, 32, 8), "135m": (576, 30, 1536, 9, 3), "tiny": (256, 2, 512, 8, 2),
          "tiny-576": (576, 2, 768, 9, 3)}
SINGLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")
# llama.cpp's mixed file types (llama-quantize's llama_tensor_get_type, simplified to the tensors a
# Llama has): the type of most matrices, of the value and down projections in the layers that get
# more bits (or in all), and of the output head (the tied embedding where there is no head)
MIXES = {  # file type: (most, v and down with more bits, v and down otherwise, head)
    "Q2_K": ("Q2_K", "Q4_K", "Q3_K", "Q6_K"),
    "Q3_K_M": ("Q3_K", "Q5_K", "Q4_K", "Q6_K"),
    "Q4_K_M": ("Q4_K", "Q6_K", "Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q5_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K", "Q6_K", "Q6_K"),
}
# a K-quant matrix whose rows are not whole super-blocks of 256 takes llama.cpp's fallback
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
KINDS = (*SINGLE, *MIXES)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_kind(kind: str, name: str, layer: int | None, layers: int, inner: int) -> str:
    """The type `llama-quantize` gives tensor `name` (of layer `layer`; None: the embedding/head)
    with rows of `inner` weights in a file of type `kind`."""
    if kind in SINGLE:
        return kind
    most, more, other, head = MIXES[kind]
    if layer is None:
        chosen = head
    elif name in ("attn_v", "ffn_down"):
        chosen = more if more_bits(layer, layers) else other
    else:
        chosen = most
    return chosen if inner % 256 == 0 else FALLBACK[chosen]


def write(path: Path, kind: str, shape: str | tuple[int, int, int, int, int], seed: int = 0, *,
          vocab: int | None = None) -> Path:
    """Write the file. shape: a name of SHAPES or its (hidden, layers, intermediate, heads, kv
    heads); vocab: the embedding's rows without the embedded model's tokenizer (tests; None: its
    vocabulary and tokenizer)."""
    hidden, layers, intermediate, heads, kv_heads = SHAPES[shape] if isinstance(shape, str) else shape
    source = GGUFReader(embedded_gguf_path()) if vocab is None else None
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents()) if vocab is None else vocab
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    for name, field in source.fields.items() if source is not None else ():  # the embedded model's tokenizer
        if name.startswith("tokenizer."):
            types = field.types
            writer.add_key_value(name, field.contents(), types[0], sub_type=types[1] if len(types) > 1 else None)
    head_dim = hidden // heads
    for index in range(layers):
        for name, rows, inner in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                  ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                  ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                  ("ffn_down", hidden, intermediate)):
            chosen = tensor_kind(kind, name, index, layers, inner)
            writer.add_tensor(f"blk.{index}.{name}.weight", random_blocks(chosen, rows, inner, rng),
                              raw_dtype=GGMLQuantizationType[chosen])
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{index}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    chosen = tensor_kind(kind, "token_embd", None, layers, hidden)
    writer.add_tensor("token_embd.weight", random_blocks(chosen, vocab, hidden, rng),
                      raw_dtype=GGMLQuantizationType[chosen])
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=KINDS, default="Q4_0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    args = parser.parse_args()
    path = write(args.out, args.kind, args.shape)
    print(f"{path}: {path.stat().st_size / 2**20:,.0f} MiB, {args.kind}, shape {args.shape}")


if __name__ == "__main__":
    main()
