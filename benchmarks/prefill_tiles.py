"""A prefill on a .gguf's blocks with each rule for its wide products, side by side in one process.

    python benchmarks/prefill_tiles.py -m MODELS/r1b-Q4_K_M.gguf --tokens 567 --threads 2 \\
        [--rules gemm,bytes] [--rounds 6]

A forward wider than the block kernel's rows (a prefill) multiplies each weight on the kernel's own
GEMM (mdcli.backends.weights.gguf_blocks.gemm_product; AVX-512 builds) or a tile of its rows at a
time (tiled_product, each tile by the plan's float32 GEMM). Rules: `gemm` is the kernel's GEMM,
`bytes` the tiles' default (tile_limit: at most TILE_ROWS rows and TILE_BYTES of float32), a number
N tiles of at most N rows whatever the width. Each round runs the same forward (a fresh cache, the first `--tokens` tokens of
the README three times over) once per rule, the order reversed every other round; the process gets
the command line's OpenMP and allocator defaults (mdcli.settings.process_defaults). Prints the median
forward per rule and its ratio to the first rule's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mdcli import settings  # noqa: E402

settings.process_defaults()  # before torch: OpenMP reads its variables once

import torch  # noqa: E402

from mdcli import api  # noqa: E402
from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.backends.llama import FastForward  # noqa: E402
from mdcli.backends.weights import gguf_blocks  # noqa: E402
from mdcli.core import cache as kv  # noqa: E402


def forward_with_tiles(lm, tokens: torch.Tensor, rule: str, forwards: dict) -> float:
    """Seconds of one forward of `tokens` whose wide products take `rule` (forwards: the own
    forward with the kernel's GEMM and without it, by "gemm" and "tiles")."""
    lm.forward.own = forwards["gemm" if rule == "gemm" else "tiles"]
    most = None if rule in ("bytes", "gemm") else int(rule)
    default = gguf_blocks.tiled_product

    def tiled(flat, weight, out, _most=None, *, matmul=None):
        return default(flat, weight, out, most, matmul=matmul)

    gguf_blocks.tiled_product = tiled
    try:
        started = time.perf_counter()
        lm.forward(tokens, torch.arange(len(tokens)), None, kv.new_cache(), torch.tensor([len(tokens) - 1]))
        return time.perf_counter() - started
    finally:
        gguf_blocks.tiled_product = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--tokens", type=int, default=567)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rules", default="gemm,bytes")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = api.load_model(api.LoadOptions(model=args.model, prompt_cache="off"))
    text = (REPO / "README.md").read_text() * 3
    tokens = torch.tensor(lm.tokenizer(text)["input_ids"][: args.tokens])
    rules = args.rules.split(",")
    own, plan = lm.forward.own, lm.forward.plan
    forwards = {"gemm": FastForward(own.model, replace(plan, block_gemm=True)),
                "tiles": FastForward(own.model, replace(plan, block_gemm=False))}
    with torch.inference_mode():
        for rule in rules:  # warm
            forward_with_tiles(lm, tokens, rule, forwards)
        seconds: dict[str, list[float]] = {rule: [] for rule in rules}
        for round_ in range(args.rounds):
            for rule in rules if round_ % 2 == 0 else reversed(rules):
                seconds[rule].append(forward_with_tiles(lm, tokens, rule, forwards))
    print(f"{cpu_line()}; {args.model}, {len(tokens)} tokens, {args.threads} thread(s), {args.rounds} rounds (ABBA)")
    first = statistics.median(seconds[rules[0]])
    for rule, times in seconds.items():
        median = statistics.median(times)
        pairs = [t / f for t, f in zip(times, seconds[rules[0]])]
        print(f"{rule}: {median * 1e3:.0f} ms ({median / first:.3f}x; each round's ratio's median "
              f"{statistics.median(pairs):.3f}), each {[round(t * 1e3) for t in times]}")


if __name__ == "__main__":
    main()
