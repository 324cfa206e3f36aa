"""Benchmark: torch's stock CPU kernels against the oneDNN ones mdcli's forwards use (mdcli.backends.attention.gemm).

    python -m mdcli.bench.kernels            # one thread, the embedded model's shapes

Linears: the embedded model's 211 weight matrices (SmolLM2-135M: 30 layers of q/k/v/o and MLP,
plus the 49,152-row output head) with random float32 weights, one forward of M tokens, F.linear
against oneDNN. Attention: one layer's masked attention (9 query heads over 3 key/value heads, head
size 64, every query seeing a random 60% of the cache and itself), sdpa with native GQA (as mdcli's
engine called it before) against the oneDNN products. Both sides compute the same values; the table shows the largest difference.
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
from mdcli.bench.margins import machine

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if not onednn_linear_works():
        raise SystemExit("this torch build has no working oneDNN linear: nothing to compare")
    print(f"machine: {machine()}; median of {args.repeats}\n")
    print("Linears, the embedded model's 211 weight matrices, one forward of M tokens:\n")
    print(linear_table([1, 8, 16, 512], args.repeats))
    print("\nMasked attention, one layer (9 query heads, 3 key/value heads, head size 64):\n")
    print(attention_table([(8, 1724), (8, 4700), (2, 1724), (1, 1724)], args.repeats * 4))


if __name__ == "__main__":
    main()
