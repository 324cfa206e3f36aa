"""Benchmark reports: the machine, a table of approaches with ratios, JSON and an optional plot."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from statistics import median
from typing import TYPE_CHECKING

import torch
import transformers

from mdcli.backends.host import cpu_model, has_avx512
from mdcli.core.resident import peak_rss_bytes
from mdcli.errors import UsageError

try:  # optional: only `mdcli bench --plot` draws
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

if TYPE_CHECKING:
    from mdcli.backends.select import Plan
    from mdcli.bench.ask import Measurement


def machine_facts(threads: int, plan: Plan | None = None) -> dict:
    """The machine, versions and mdcli's kernels (for `model`: whether its forward reads a .gguf's
    blocks, mdcli.backends.weights.gguf_blocks)."""
    kernels = plan.linears if plan is not None else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    facts = {
        "cpu": cpu_model(),
        "avx512": has_avx512(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_average_1m": round(load[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "mdcli_kernels": kernels.name if kernels else "torch",
        "mdcli_kernels_reason": "; ".join([kernels.reason, *plan.notes]) if kernels else "no model loaded",
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def combine_repeats(runs: list[list[Measurement]]) -> list[Measurement]:
    """Median seconds (and step time) over repeats; tokens and memory from the first run; every
    repeat's seconds kept, so that ratios can be taken repeat by repeat (`rows`)."""
    combined = []
    for same in zip(*runs):
        first = same[0]
        first.repeat_seconds = [m.seconds for m in same]
        first.seconds = median(first.repeat_seconds)
        steps = [m.step_seconds for m in same if m.step_seconds is not None]
        first.step_seconds = median(steps) if steps else None
        references = [m.reference_step_seconds for m in same if m.reference_step_seconds is not None]
        first.reference_step_seconds = median(references) if references else None
        compared = [m.matches_forest for m in same if m.matches_forest is not None]  # None: not compared
        first.matches_forest = all(compared) if compared else None
        combined.append(first)
    return combined


def rows(results: list[Measurement], peak_bandwidth_gbps: float | None = None) -> list[dict]:
    """One row per measurement with its ratio to the forest in the same case.

    For the forest also the memory traffic of a decode step: the bytes it must read (every weight
    once, and the whole KV cache at its mean length) over the step time, and that as a fraction of
    `peak_bandwidth_gbps` when the machine's peak is given: how far a step is from the
    memory-bandwidth limit."""
    forests = {_key(m): m for m in results if m.approach == "forest"}
    table = []
    for m in results:
        forest = forests.get(_key(m))
        table.append(
            {
                "branches": m.case.branches,
                "context_tokens": m.case.context_tokens,
                "new_tokens": m.case.new_tokens,
                "approach": m.approach,
                "seconds": round(m.seconds, 3),
                "repeat_seconds": [round(x, 3) for x in m.repeat_seconds],  # in run order; ratios pair them
                "tokens_per_second": round(m.tokens_per_second, 2),
                "kv_mib": round(m.kv_bytes / 2**20, 2),
                "forest_speedup": None if forest is None else round(paired_ratio(m, forest), 2),
                "kv_vs_forest": round(m.kv_bytes / forest.kv_bytes, 2) if forest is not None and forest.kv_bytes else None,
                "step_ms": round(m.step_seconds * 1000, 2) if m.step_seconds is not None else None,
                "reference_step_ms": _ms(m.reference_step_seconds),
                "step_vs_reference": _ratio(m.step_seconds, m.reference_step_seconds),
                "step_read_gbps": _read_gbps(m),
                "step_bandwidth_fraction": _fraction(_read_gbps(m), peak_bandwidth_gbps),
                "same_tokens_as_forest": m.matches_forest,
                "tokens_per_forward": _per_forward(m),
                "drafts_accepted": round(m.accepted_tokens / m.draft_tokens, 3) if m.draft_tokens else None,
            }
        )
    return table


def paired_ratio(m: Measurement, forest: Measurement) -> float:
    """m's seconds over the forest's: the median of the ratios repeat by repeat when both kept their
    repeats (each pair ran back to back, so a machine drifting over minutes, as shared and virtual
    ones do by 10-20%, moves both sides of a pair alike), else the ratio of the two medians."""
    if m.repeat_seconds and len(m.repeat_seconds) == len(forest.repeat_seconds):
        return median(a / b for a, b in zip(m.repeat_seconds, forest.repeat_seconds))
    return m.seconds / forest.seconds


def markdown_table(table: list[dict]) -> str:
    header = (
        "| branches | context | new | approach | seconds | tok/s | KV MiB | forest is x faster | KV x forest "
        "| step ms | step reads GB/s | of peak | transformers step ms | step x transformers | same tokens "
        "| tokens/forward | drafts accepted |\n"
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n"
    )
    body = "".join(
        f"| {r['branches']} | {r['context_tokens']} | {r['new_tokens']} | {r['approach']} | {r['seconds']:.2f} "
        f"| {r['tokens_per_second']:.1f} | {r['kv_mib']:.1f} | {_num(r['forest_speedup'])} | {_num(r['kv_vs_forest'])} "
        f"| {_num(r['step_ms'])} | {_num(r['step_read_gbps'])} | {_percent(r['step_bandwidth_fraction'])} "
        f"| {_num(r['reference_step_ms'])} | {_num(r['step_vs_reference'])} | {_yes(r['same_tokens_as_forest'])} "
        f"| {_num(r.get('tokens_per_forward'))} | {_percent(r.get('drafts_accepted'))} |\n"
        for r in table
    )
    return header + body


def plot(table: list[dict], path: str) -> None:
    """Speedup of the forest against each alternative, by branch count, one line per context."""
    if plt is None:
        raise UsageError("--plot needs matplotlib", fix="pip install matplotlib")
    figure, axis = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in table:
        if r["approach"] != "forest" and r["forest_speedup"]:
            series.setdefault((r["approach"], r["context_tokens"], r["new_tokens"]), []).append(
                (r["branches"], r["forest_speedup"])
            )
    for (approach, context, new), points in sorted(series.items()):
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                  label=f"vs {approach}, {context} ctx, {new} new")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("branches")
    axis.set_ylabel("forest speedup (x)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def process_memory() -> dict:
    """The bench process's resident peak, read after every approach ran (mdcli.core.resident): one
    figure for the whole process, the model's load included. It cannot be split between approaches
    that ran in one process (the peak is a high-water mark), so no row has one of its own; for
    per-process peaks, benchmarks/memory.py runs each command in a process of its own."""
    return {"process_peak_rss_bytes": peak_rss_bytes()}


def memory_note(memory: dict) -> str:
    """The line under the table, e.g. ``Peak RSS of the whole bench process: 1,861 MiB (...)``."""
    peak = memory.get("process_peak_rss_bytes") or 0
    if not peak:
        return "Peak RSS: not reported on this platform."
    return (f"Peak RSS of the whole bench process: {peak / 2**20:,.0f} MiB (after every approach and repeat, the "
            "model's load included; one process cannot split it between approaches, so no row has its own)")


def as_json(facts: dict, table: list[dict], command: str, memory: dict | None = None) -> dict:
    return {"command": command, "machine": facts, **(memory or {}), "results": table}


def _key(m: Measurement) -> tuple:
    return tuple(asdict(m.case).values())


def _per_forward(m: Measurement) -> float | None:
    """Generated tokens per decode forward (the prefill's forward excluded)."""
    if not m.forwards:
        return None
    return round(m.case.branches * m.case.new_tokens / m.forwards, 2)


def _read_gbps(m: Measurement) -> float | None:
    if m.step_bytes is None or not m.step_seconds:
        return None
    return round(m.step_bytes / m.step_seconds / 1e9, 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _ratio(step: float | None, reference: float | None) -> float | None:
    """A forest step over transformers' own single-sequence step on the same context."""
    return None if step is None or not reference else round(step / reference, 2)


def _fraction(gbps: float | None, peak: float | None) -> float | None:
    return None if gbps is None or not peak else round(gbps / peak, 3)


def _percent(value) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def _num(value) -> str:
    return "" if value is None else f"{value:g}"


def _yes(value) -> str:
    return "" if value is None else ("yes" if value else "**NO**")
