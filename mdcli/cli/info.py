"""`mdcli info`: the host, the versions, and the kernel plan chosen for a model, for bug reports.

The plan is what the selector (mdcli.backends.select) decides when the model loads: which forward
runs, which kernels its linears and attention use, which weight copies serve which forward
widths, and why. Runs print it in their header only with --verbose.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mdcli import __version__
from mdcli.cli.common import errors, load
from mdcli.cli.groups import takes
from mdcli.cli.options import LOAD, OUTPUT, LoadFlags, OutputFlags

JsonOpt = Annotated[bool, typer.Option("--json", help="The same facts as one JSON object, for bug reports.")]
NoModelOpt = Annotated[bool, typer.Option("--no-model", help="The host and versions only: load no model.")]


@takes(loading=LOAD.only("model", "device", "dtype", "cpu_weights", "trust_remote_code"), out=OUTPUT.only("debug"))
def info(
    json_output: JsonOpt = False,
    no_model: NoModelOpt = False,
    *, loading: LoadFlags, out: OutputFlags,
) -> None:
    """Print the host (CPU, ISA, cores, memory, GPU), the torch and transformers versions, the
    settings that differ from their defaults, and the kernel plan chosen for -m MODEL (default:
    the embedded model) with its reasons."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    with errors(out.debug):
        report = {"mdcli": __version__, "host": api.host_report(), "settings": api.changed_settings()}
        if not no_model:
            lm = load(loading.options(quiet=True))
            report["model"] = {"name": lm.name, "device": str(lm.device),
                               "dtype": str(lm.dtype).removeprefix("torch."), "dtype_reason": lm.dtype_reason,
                               "attn": lm.attn, "cpu_weights": lm.cpu_weights}
            report["plan"] = lm.forward.plan.as_dict()
            report["weight_bytes"] = lm.forward.weight_bytes()
        typer.echo(json.dumps(report, indent=2) if json_output else _text(report))


def _text(report: dict) -> str:
    host = report["host"]
    gib = 2**30
    lines = [
        f"mdcli {report['mdcli']} · Python {host['python']} · torch {host['torch']} · transformers {host['transformers']}",
        f"cpu: {host['cpu']} · ISA {host['isa']} · AVX-512 {'yes' if host['avx512'] else 'no'} · "
        f"{host['cores']} cores · torch threads {host['torch_threads']}",
        f"memory: {_gib(host['memory_bytes'], gib)} total, {_gib(host['memory_available_bytes'], gib)} available",
        "gpu: " + (", ".join(f"{g['name']} ({g['memory_bytes'] / gib:.0f} GiB)" for g in host["gpus"]) or "none"),
        "settings: " + (" ".join(f"{k}={v}" for k, v in report["settings"].items()) or "defaults"),
    ]
    if "plan" in report:
        model, plan = report["model"], report["plan"]
        lines += [
            f"model: {model['name']} · {model['device']} · {model['dtype']} ({model['dtype_reason']}) · {model['attn']}",
            "forward: " + _forward_line(plan),
            f"kernels: {plan['description']}",
            f"attention: {plan['attention']}" + (f" up to {plan['bmm_max_queries']} queries, sdpa beyond"
                                                  if plan["attention"] == "bmm" and plan["bmm_max_queries"] else ""),
            "weight copies: " + (", ".join(_copies(plan)) or "none (the model's own weights)"),
        ]
        if plan["blocks_held"]:
            lines.append(f"weights held as: {plan['blocks_held']}")
        if plan["blocks_reason"]:
            lines.append(f".gguf blocks not used: {plan['blocks_reason']}")
        if plan["float32_reason"]:
            lines.append(f"float32 weights loaded, not the file's blocks: {plan['float32_reason']}")
        lines.append("weights held: " + ", ".join(f"{name} {size / 2**20:.0f} MiB"
                                                  for name, size in report["weight_bytes"].items()))
    return "\n".join(lines)


def _forward_line(plan: dict) -> str:
    if not plan["own_forward"]:
        return f"transformers' ({plan['own_forward_reason']})"
    if plan["on_blocks"]:
        return "mdcli's own, every forward (no float32 projections for transformers')"
    return "mdcli's own (masked forwards and lone tokens), transformers' for causal prefills"


def _copies(plan: dict) -> list[str]:
    copies = []
    if plan["blocks"]:
        copies.append(f".gguf {plan['blocks']} blocks for " + (
            f"every forward (the block kernel up to {plan['block_kernel_rows']} tokens, wider "
            f"{'on its own GEMM' if plan['block_gemm'] else 'tile by tile'})"
            if plan["on_blocks"] else f"1-{plan['block_rows']} tokens"))
    if plan["tiled"]:
        copies.append(f"tiled for up to {plan['tiled_rows']} tokens")
    if plan["transposed"]:
        copies.append("transposed for a lone token" + (" (OpenBLAS)" if plan["lone_blas"] else ""))
    if plan["packed"]:
        copies.append("oneDNN-packed for wider forwards" + (" (pairs padded to 4 rows)" if plan["pair_padding"] else ""))
    return copies


def _gib(value: int | None, gib: int) -> str:
    return "unknown" if value is None else f"{value / gib:.1f} GiB"
