"""Benchmark: mdcli beam (one tree in one cache) against `model.generate(num_beams=W)`.

    python -m mdcli.bench.beam            # the embedded SmolLM2, prints a Markdown table

Both approaches run in this one process, side by side for each width, on the same 1,000-token
prompt with EOS disabled so that both take exactly `new_tokens` steps, and must return the same
sequence. Memory is the KV cache each approach holds at its peak, measured as the bytes of the
storages behind the cache tensors (so preallocated room counts): generate keeps W copies of the
prompt in its batch; mdcli keeps one prompt plus the live beams (tracemalloc cannot see torch, and
the process's resident peak cannot be split between two approaches run in one process).
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from typing import TYPE_CHECKING

import torch
import transformers

from mdcli.bench import BASELINE_KERNELS, BASELINE_KERNELS_HELP
from mdcli.bench.harness import baseline_kernels, kernels_line
from mdcli.bench.twin import float32_twin
from mdcli.core.cache import output_cache
from mdcli.core.engine import Engine
from mdcli.events import Finish
from mdcli.models.load import load_model
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.beam import (
    DEFAULT_COMPACT_RATIO,
    BeamParams,
    BeamPrompt,
    BeamSearch,
)

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

_TEXT = (
    "The lighthouse keeper of Ar Men kept a logbook for forty years. Each evening she wrote the wind, the "
    "state of the sea, the ships that passed and the hour she lit the lamp. In winter the waves rose higher "
    "than the gallery and the tower shook; in summer tourists came by boat from Sein and asked her whether "
    "she was lonely. She answered that the sea talked enough for two. When the light was automated she "
    "gave the logbooks to the museum in Brest, where they fill a whole shelf. "
)


def bench_beam(
    lm: LoadedModel,
    prompt_tokens: int = 1000,
    widths: tuple[int, ...] = (4, 8),
    new_tokens: int = 64,
    threads: int = 1,
    repeats: int = 1,
    compact_ratio: float | None = None,
    kernels: str = "stock",
) -> list[dict]:
    """Time and measure both approaches for each width; the best of `repeats` runs each.

    Returns one dict per width: seconds, KV bytes at peak, their ratios (generate / mdcli), and
    whether the returned sequences are identical (they must be; a difference is reported, not
    hidden).
    """
    torch.set_num_threads(threads)
    prompt = benchmark_prompt(lm.tokenizer, prompt_tokens)
    ratio = DEFAULT_COMPACT_RATIO if compact_ratio is None else compact_ratio
    rows = []
    for width in widths:
        ours = _fastest(_run_mdcli(lm, prompt, width, new_tokens, ratio) for _ in range(repeats))
        with baseline_kernels(lm, kernels):
            theirs = _fastest(_run_generate(lm, prompt, width, new_tokens) for _ in range(repeats))
            # generate's first step alone: its prefill of W prompt copies, to split its time like ours
            theirs_prefill = min(_run_generate(lm, prompt, width, 1)["seconds"] for _ in range(repeats))
        rows.append(
            {
                "width": width,
                "prompt_tokens": len(prompt),
                "new_tokens": new_tokens,
                "mdcli_seconds": round(ours["seconds"], 3),
                "generate_seconds": round(theirs["seconds"], 3),
                "speedup": round(theirs["seconds"] / ours["seconds"], 2),
                "mdcli_prefill_seconds": round(ours["prefill_seconds"], 3),
                "generate_prefill_seconds": round(theirs_prefill, 3),
                "decode_speedup": round(
                    (theirs["seconds"] - theirs_prefill) / (ours["seconds"] - ours["prefill_seconds"]), 2
                ),
                "mdcli_kv_bytes": ours["kv_bytes"],
                "mdcli_kv_filled_bytes": ours["kv_filled_bytes"],
                "generate_kv_bytes": theirs["kv_bytes"],
                "kv_ratio": round(theirs["kv_bytes"] / ours["kv_bytes"], 2),
                "mdcli_peak_cache_tokens": ours["peak_tokens"],
                "compactions": ours["compactions"],
                "identical": ours["tokens"] == theirs["tokens"],
                "score_difference": abs(ours["score"] - theirs["score"]),
            }
        )
    return rows


def _fastest(runs) -> dict:
    return min(runs, key=lambda run: run["seconds"])


def benchmark_prompt(tokenizer, length: int) -> list[int]:
    """Exactly `length` token ids of plain prose (no chat template), the same on every run."""
    text, ids = "", []
    chapter = 0
    while len(ids) < length:
        chapter += 1
        text += f"Chapter {chapter}. " + _TEXT
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids[:length])


def _run_mdcli(lm: LoadedModel, prompt: list[int], width: int, new_tokens: int, compact_ratio: float) -> dict:
    engine = Engine(lm.forward, sliding_window=lm.sliding_window, mixed_layer_types=lm.mixed_layer_types)
    tokenizer = lm.tokenizer

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    params = BeamParams(width=width, num_return=1, max_new_tokens=new_tokens)
    search = BeamSearch(engine, [BeamPrompt("bench", prompt)], params, (), decode=decode, compact_ratio=compact_ratio)
    search.announce()
    peak_bytes, finish = 0, None
    started = time.perf_counter()
    for event in search.run():
        peak_bytes = max(peak_bytes, _storage_bytes(engine.cache))
        if isinstance(event, Finish):
            finish = event
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "prefill_seconds": search.counters.prefill_seconds,
        "kv_bytes": peak_bytes,
        "kv_filled_bytes": engine.peak_tokens * kv_bytes_per_token(lm.model.config, lm.dtype.itemsize),
        "peak_tokens": engine.peak_tokens,
        "compactions": engine.compactions,
        "tokens": finish.token_ids,
        "score": finish.score,
    }


def _run_generate(lm: LoadedModel, prompt: list[int], width: int, new_tokens: int) -> dict:
    """generate(num_beams=W) with EOS disabled (eos_token_id=None: no stopping, K = 2W, no
    processor), so it runs the same `new_tokens` steps as mdcli with no EOS ids."""
    lm = float32_twin(lm)  # generate needs float32 weights
    config = copy.deepcopy(lm.model.generation_config)
    config.update(
        eos_token_id=None,
        num_beams=width,
        num_return_sequences=1,
        do_sample=False,
        max_new_tokens=new_tokens,
        early_stopping=False,
        length_penalty=1.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    started = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([prompt], device=lm.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=lm.device),
            generation_config=config,
        )
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "kv_bytes": _storage_bytes(output_cache(out)),  # it only grows: the end is its peak
        "tokens": out.sequences[0, len(prompt):].tolist(),
        "score": float(out.sequences_scores[0]),
    }


def _storage_bytes(cache) -> int:
    """Bytes of the storages behind every layer's keys and values (views count their whole buffer)."""
    total, seen = 0, set()
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is None or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def markdown(rows: list[dict], lm: LoadedModel, threads: int, kernels: str = "stock") -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"Model: {lm.name}, {str(lm.dtype).removeprefix('torch.')}, {lm.attn}, {lm.device}. Machine: "
        f"{os.cpu_count()} CPUs (load average {load:.1f} at the end), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {threads} thread(s); {kernels_line(lm, kernels)}.",
        "",
        "| width | prompt | new | mdcli s (prefill) | generate s (prefill) | speedup | decode speedup "
        "| mdcli KV MiB (filled) | generate KV MiB | KV ratio | mdcli peak tokens | compactions | identical "
        "| score diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['mdcli_seconds']:.1f} "
            f"({r['mdcli_prefill_seconds']:.1f}) | {r['generate_seconds']:.1f} ({r['generate_prefill_seconds']:.1f}) | "
            f"{r['speedup']:.2f}x | {r['decode_speedup']:.2f}x | {r['mdcli_kv_bytes'] / 2**20:.0f} "
            f"({r['mdcli_kv_filled_bytes'] / 2**20:.0f}) | "
            f"{r['generate_kv_bytes'] / 2**20:.0f} | {r['kv_ratio']:.2f}x | {r['mdcli_peak_cache_tokens']} | "
            f"{r['compactions']} | {'yes' if r['identical'] else 'NO'} | {r['score_difference']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mdcli.bench.beam", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per approach and width")
    parser.add_argument("--baseline-kernels", choices=BASELINE_KERNELS, default="stock", help=BASELINE_KERNELS_HELP)
    args = parser.parse_args(argv)
    lm = load_model(quiet=True)
    rows = bench_beam(lm, args.prompt_tokens, tuple(args.widths), args.new_tokens, args.threads, args.repeats,
                      kernels=args.baseline_kernels)
    print(markdown(rows, lm, args.threads, args.baseline_kernels))


if __name__ == "__main__":
    main()
