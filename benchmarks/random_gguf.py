#!/usr/bin/env python3
"""Write a random Llama-shaped .gguf that transformers and llama.cpp both load: for memory checks.

    python benchmarks/random_gguf.py OUT.gguf --kind Q4_0 [--shape 1b]

The file holds random block codes (Q4_0 or Q8_0) with small float16 scales for every projection
and the (tied) embedding, float32 norms of ones, the Llama metadata of the chosen shape, and the
embedded model's tokenizer (its 49,152-token vocabulary and chat template), so `mdcli ask-many -m
OUT.gguf` runs on it. The codes are written directly, not quantized from float32 weights: a 1B
file is written in seconds. Issue 39's check: such a file loads and answers in at most twice its
size plus the KV cache (benchmarks/memory.py --model OUT.gguf).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's mdcli, not an installed one

from mdcli.models.embedded import embedded_gguf_path  # noqa: E402

# (hidden, layers, intermediate, heads, kv heads): Llama-3.2-1B's shape, SmolLM2's vocabulary
SHAPES = {"1b": (2048, 16, 8192, 32, 8), "tiny": (256, 2, 512, 8, 2)}
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}


def random_blocks(rows: int, inner: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, inner / 32 * bytes] uint8: random codes, each block's float16 scale about 0.02 / 8."""
    blocks = rng.integers(0, 256, size=(rows, inner // 32, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, size=(rows, inner // 32)) * (0.02 / 8)).astype(np.float16)
    blocks[:, :, :2] = scales.view(np.uint8).reshape(rows, inner // 32, 2)
    return blocks.reshape(rows, -1)


def write(path: Path, kind: str, shape: str, seed: int = 0) -> Path:
    hidden, layers, intermediate, heads, kv_heads = SHAPES[shape]
    source = GGUFReader(embedded_gguf_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
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
    for name, field in source.fields.items():  # the embedded model's tokenizer, chat template included
        if name.startswith("tokenizer."):
            types = field.types
            writer.add_key_value(name, field.contents(), types[0], sub_type=types[1] if len(types) > 1 else None)
    quantized = GGMLQuantizationType[kind]
    head_dim = hidden // heads
    for index in range(layers):
        for name, rows, inner in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                  ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                  ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                  ("ffn_down", hidden, intermediate)):
            writer.add_tensor(f"blk.{index}.{name}.weight", random_blocks(rows, inner, kind, rng), raw_dtype=quantized)
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{index}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("token_embd.weight", random_blocks(vocab, hidden, kind, rng), raw_dtype=quantized)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=sorted(BLOCK_BYTES), default="Q4_0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    args = parser.parse_args()
    path = write(args.out, args.kind, args.shape)
    print(f"{path}: {path.stat().st_size / 2**20:,.0f} MiB, {args.kind}, shape {args.shape}")


if __name__ == "__main__":
    main()
