"""Benchmark: torch's stock CPU kernels against the oneDNN ones mdcli's forwards use (mdcli.backends.attention.gemm).

    python -m mdcli.bench.kernels            # one thread, the embedded model's shapes
    python -m mdcli.bench.kernels --blocks-wide --threads 2   # wide forwards on the .gguf's blocks

Linears: the embedded model's 211 weight matrices (SmolLM2-135M: 30 layers of q/k/v/o and MLP,
plus the 49,152-row output head) with random float32 weights, one forward of M tokens, F.linear
against oneDNN. Attention: one layer's masked attention (9 query heads over 3 key/value heads, head
size 64, every query seeing a random 60% of the cache and itself), sdpa with native GQA (as mdcli's
engine called it before) against the oneDNN products. Both sides compute the same values; the table shows the largest difference.

`--blocks-wide`: one layer of the embedded model (its real .gguf blocks: fused q/k/v, o, fused
gate/up, down), the four products of a forward of M tokens, on the float32 weights (F.linear, and
the packed oneDNN copy where this host's plan makes one) against the blocks (the narrow block
kernel, and tile by tile for each tile size: mdcli.backends.weights.gguf_blocks.tiled_product),
timed in alternating order (ABBA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mdcli.backends.attention.gemm import (
    gemm_attention,
    onednn_linear_works,
    routed_linear,
)
from mdcli.backends.weights import gguf_blocks, gguf_reading
from mdcli.backends.weights.packed import pack, packed_linear
from mdcli.bench.margins import machine
from mdcli.models.load import LoadOptions, load_model

SMOLLM2_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def random_forest_mask(queries: int, keys: int, generator) -> torch.Tensor:
    """[1, 1, M, N] additive float32 mask: each query sees a random 60% of the keys, and always the
    last M keys (the new tokens themselves, query i key N - M + i), as a forest step's rows do."""
    allowed = torch.rand(queries, keys, generator=generator) < 0.6
    allowed[:, keys - queries:] |= torch.eye(queries, dtype=torch.bool)
    return torch.zeros(queries, keys).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]


def linear_table(token_counts: list[int], repeats: int) -> str:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for _ in range(LAYERS) for shape in SMOLLM2_LAYER]
    weights.append(torch.randn(VOCAB, 576, generator=generator))
    lines = ["| M tokens | stock `F.linear`, ms | oneDNN, ms | ratio | max relative difference |",
             "|---:|---:|---:|---:|---:|"]
    for m in token_counts:
        inputs = {size: torch.randn(m, size, generator=generator) for size in (576, 1536)}

        def run_all(linear=F.linear) -> list:
            return [linear(inputs[w.shape[1]], w) for w in weights]

        with torch.inference_mode():
            stock = median_seconds(run_all, repeats)
            want = run_all()
            fast = median_seconds(lambda: run_all(routed_linear), repeats)
            got = run_all(routed_linear)
        difference = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
        lines.append(f"| {m} | {stock * 1e3:.1f} | {fast * 1e3:.1f} | {stock / fast:.2f}x | {difference:.1e} |")
    return "\n".join(lines)


def attention_table(shapes: list[tuple[int, int]], repeats: int) -> str:
    generator = torch.Generator().manual_seed(0)
    lines = ["| queries x cached tokens | sdpa, us | oneDNN products, us | ratio | max difference |",
             "|---|---:|---:|---:|---:|"]
    for queries, keys in shapes:
        q = torch.randn(1, 9, queries, 64, generator=generator)
        k, v = (torch.randn(1, 3, keys, 64, generator=generator) for _ in range(2))
        mask = random_forest_mask(queries, keys, generator)
        with torch.inference_mode():  # sdpa as mdcli's own forward calls it: GQA native

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            stock = median_seconds(sdpa, repeats)
            want = sdpa()
            fast = median_seconds(lambda: gemm_attention(q, k, v, mask, None), repeats)
            got = gemm_attention(q, k, v, mask, None)
        lines.append(f"| {queries} x {keys:,} | {stock * 1e6:.0f} | {fast * 1e6:.0f} | {stock / fast:.2f}x | "
                     f"{float((got - want).abs().max()):.1e} |")
    return "\n".join(lines)


def abba_seconds(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, timed once a round, the order reversed every other round."""
    names = list(variants)
    for name in names:
        variants[name]()  # warm
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            started = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def layer_weights() -> tuple[list[torch.Tensor], list, bool]:
    """The embedded model's first layer (qkv, o, gate_up, down) as float32 (fused as
    mdcli.backends.llama fuses them) and as its .gguf's blocks, and whether its plan packs copies
    (the model loaded with its float32 weights kept: the default load holds none)."""
    lm = load_model(LoadOptions(quiet=True, keep_float32=True))
    blocks = gguf_reading.model_blocks(lm.model)
    if isinstance(blocks, str):
        raise SystemExit(f"no .gguf blocks: {blocks}")
    attention, mlp = lm.model.model.layers[0].self_attn, lm.model.model.layers[0].mlp
    fused = [torch.cat([m.weight.detach() for m in modules]) for modules in
             ((attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
              (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))]
    return fused, list(blocks[0][0]), lm.forward.plan.packed


def dequantize_tiles(weight) -> None:
    """Only the float32 tiles a wide product writes out (gguf_blocks.tiled_product), not multiplied."""
    out_features, inner = weight.shape
    tile = gguf_blocks.tile_rows(out_features, gguf_blocks.tile_limit(inner))
    scratch = torch.empty(tile, inner)
    expand = getattr(gguf_blocks.library(), f"{weight.kind.lower()}_dequantize")
    for start in range(0, out_features, tile):
        rows = min(tile, out_features - start)
        expand(weight.data.data_ptr() + start * weight.data.stride(0), rows, inner, scratch.data_ptr())


def blocks_wide_table(token_counts: list[int], repeats: int, tile_rows: list[int], narrow_max: int = 64) -> str:
    """One layer's four products at each M: float32 kernels against the blocks, ABBA; ratios are the
    float32 kernel's time over the blocks' at the default tile (gguf_blocks.TILE_ROWS)."""
    weights, blocks, packs = layer_weights()
    packed = [pack(w) for w in weights] if packs else None
    default = gguf_blocks.TILE_ROWS
    tiles = sorted({*tile_rows, default})
    generator = torch.Generator().manual_seed(0)
    header = ["M", "F.linear ms", *(["packed ms"] if packed else []), "narrow ms",
              *(f"tiles of {rows} rows, ms" for rows in tiles), f"of which dequantizing ({default})",
              *(["packed / tiles"] if packed else []),
              "F.linear / tiles", "max rel. difference"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for m in token_counts:
        inputs = [torch.randn(m, w.shape[1], generator=generator) for w in weights]

        def on_blocks(product, **options) -> Callable[[], list]:
            def run() -> list:
                outs = [torch.empty(m, b.shape[0]) for b in blocks]
                for x, b, out in zip(inputs, blocks, outs):
                    product(x, b, out, **options)
                return outs
            return run

        variants = {"F.linear": lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]}
        if packed:
            variants["packed"] = lambda: [packed_linear(x, w) for x, w in zip(inputs, packed)]
        if m <= narrow_max:
            variants["narrow"] = on_blocks(gguf_blocks.narrow_product)
        variants["dequantize"] = lambda: [dequantize_tiles(b) for b in blocks]
        for rows in tiles:
            variants[rows] = on_blocks(gguf_blocks.tiled_product, most=rows)
        with torch.inference_mode():
            seconds = abba_seconds(variants, repeats)
            want, got = variants["F.linear"](), variants[default]()
        difference = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
        cells = [str(m), *(f"{seconds[k] * 1e3:.2f}" if k in seconds else "" for k in
                           ["F.linear", *(["packed"] if packed else []), "narrow", *tiles])]
        cells.append(f"{seconds['dequantize'] / seconds[default]:.0%}")
        cells += [f"{seconds[k] / seconds[default]:.2f}x" for k in [*(["packed"] if packed else []), "F.linear"]]
        lines.append("| " + " | ".join([*cells, f"{difference:.1e}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--blocks-wide", action="store_true",
                        help="wide forwards on the embedded model's .gguf blocks against its float32 kernels")
    parser.add_argument("--tokens", default="16,32,64,128,256,512,1024", help="M for --blocks-wide")
    parser.add_argument("--tile-rows", default="128,256,512,1024", help="weight rows a tile, for --blocks-wide")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.blocks_wide:
        print(f"machine: {machine()}; median of {args.repeats}, alternating order (ABBA)\n")
        print("One layer's four products (qkv, o, gate_up, down) on the embedded model's blocks, M tokens:\n")
        print(blocks_wide_table([int(m) for m in args.tokens.split(",")], args.repeats,
                                [int(k) for k in args.tile_rows.split(",")]))
        return
    if not onednn_linear_works():
        raise SystemExit("this torch build has no working oneDNN linear: nothing to compare")
    print(f"machine: {machine()}; median of {args.repeats}\n")
    print("Linears, the embedded model's 211 weight matrices, one forward of M tokens:\n")
    print(linear_table([1, 8, 16, 512], args.repeats))
    print("\nMasked attention, one layer (9 query heads, 3 key/value heads, head size 64):\n")
    print(attention_table([(8, 1724), (8, 4700), (2, 1724), (1, 1724)], args.repeats * 4))


if __name__ == "__main__":
    main()
