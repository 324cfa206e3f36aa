"""Benchmarks that compare approaches side by side in one process, on the same prompts and model.

Speed claims in this project come from here (recorded in docs/performance.md, with the history in
notebook/), never from timing assertions in unit tests. This package's own module holds only the
option constants the command line shows on every `mdcli --help`; what needs a model is in
mdcli.bench.harness.
"""

from __future__ import annotations

RANDOM_SHAPES = {
    # name: (family, hidden, layers, heads, kv_heads, intermediate, vocab, head_dim or None: hidden / heads)
    "tiny": ("llama", 64, 2, 4, 2, 128, 49152, None),
    "llama-135m": ("llama", 576, 30, 9, 3, 1536, 49152, None),
    "llama-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, None),
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 128256, None),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 3072, 151936, 128),  # q_norm / k_norm over each head
}


BASELINE_KERNELS = ("stock", "mdcli")
BASELINE_KERNELS_HELP = (
    "stock: the alternatives run on torch's own kernels, as users run them; mdcli: they get mdcli's CPU "
    "kernels too (mdcli.backends.reference), so the ratio shows the algorithm's gain alone"
)
