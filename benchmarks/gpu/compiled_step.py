"""The captured decode step with and without torch.compile: what fusing a layer's ~35 small kernels
gains a replayed step, and what the compile costs on first use.

Random weights of a named shape (mdcli.bench.RANDOM_SHAPES), a DOC-token document, 1 and 16 branches
stepping STEPS times, each variant in its own fresh engine, in the order given, twice (ABBA):
* graphs: mdcli's captured step as it ships (mdcli.backends.graphs);
* compiled: the same, its own forward's body compiled first (torch.compile, MODE below, a compile
  per width and cache capacity, each run's forward its own), then captured.
Prints, per variant and width: the first step (capture, and compile where it applies), the median
step after it, and whether the greedy tokens equal the first variant's.

    python3 benchmarks/gpu/compiled_step.py                 # a CUDA machine: llama-1b, bf16
    DEV=cpu SHAPE=tiny DOC=64 STEPS=4 MDCLI_CUDA_GRAPHS=static python3 benchmarks/gpu/compiled_step.py float32
                                                            # a check of the script on a CPU
"""
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from mdcli.backends.forward import forward_for
from mdcli.bench import RANDOM_SHAPES
from mdcli.core.engine import Engine

SHAPE = os.environ.get("SHAPE", "llama-1b")
DEV = os.environ.get("DEV", "cuda")
DOC = int(os.environ.get("DOC", 4096))
STEPS = int(os.environ.get("STEPS", 64))
# inductor's default: pointwise work fused, products left to cuBLAS, no graphs of its own (the graph
# is mdcli's capture); max-autotune-no-cudagraphs also searches GEMM configurations, for minutes
MODE = os.environ.get("MODE", "default")
DTYPE = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")


def model_of(shape: str):
    family, hidden, layers, heads, kv_heads, inter, vocab, head_dim = RANDOM_SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=16384, **({"head_dim": head_dim} if head_dim else {}))
    torch.manual_seed(0)
    with torch.device(DEV):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPE, attn_implementation="sdpa").eval(), vocab


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def run(model, vocab: int, branches: int, compiled: bool) -> tuple[float, float, list[list[int]]]:
    """(first step s, median later step ms, tokens) of `branches` greedy chains off one document."""
    model_forward = forward_for(model)
    if compiled:
        own = model_forward.own
        own._forward = torch.compile(own._forward, mode=MODE, dynamic=False)  # this engine's forward only
    engine = Engine(model_forward)
    document = torch.randint(0, vocab, (DOC,), generator=torch.Generator().manual_seed(1)).tolist()
    (prefix,) = engine.extend([torch.zeros(0, dtype=torch.bool)], [document])
    rows = prefix.row[None].expand(branches, -1)
    chains = [[int(t)] for t in torch.randint(0, vocab, (branches,), generator=torch.Generator().manual_seed(2))]
    tokens: list[list[int]] = [[] for _ in range(branches)]
    times = []
    for _ in range(STEPS):
        sync()
        started = time.perf_counter()
        results = engine.forward(rows, chains)
        rows = torch.stack([r.row for r in results])
        chains = [[int(r.logits.argmax())] for r in results]
        sync()
        times.append(time.perf_counter() - started)
        for mine, (token,) in zip(tokens, chains):
            mine.append(token)
    return times[0], 1000 * statistics.median(times[1:]), tokens


def main() -> None:
    # each run's forward is a new object, so each compiles anew: past dynamo's limit of 8 compiles a
    # function would quietly run uncompiled, and the later rows would time the wrong thing
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    model, vocab = model_of(SHAPE)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, random {SHAPE} {DTYPE}, {DOC}-token document, {STEPS} steps, "
          f"compile mode {MODE}", flush=True)
    print("| branches | variant | first step s | step ms (median) | same tokens |")
    print("| ---: | --- | ---: | ---: | --- |")
    for branches in (1, 16):
        reference = None
        for compiled in (False, True, True, False):
            first, step, tokens = run(model, vocab, branches, compiled)
            reference = tokens if reference is None else reference
            variant = "compiled" if compiled else "graphs"
            print(f"| {branches} | {variant} | {first:.2f} | {step:.2f} | {'yes' if tokens == reference else 'NO'} |",
                  flush=True)


if __name__ == "__main__":
    main()
