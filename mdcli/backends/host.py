"""Host facts: what the CPU says about itself (/proc/cpuinfo, vendor, model) and the instruction
set torch's CPU kernels dispatch to. The selector (mdcli.backends.select) turns these into a plan;
benchmark tables name the CPU with `cpu_line`."""

from __future__ import annotations

import os
import platform
import sys
from functools import cache
from pathlib import Path

import torch
import transformers

CPUINFO = Path("/proc/cpuinfo")
_VENDORS = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}


@cache
def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty off Linux)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@cache
def cpu_vendor() -> str:
    """"AMD", "Intel", or "" where the CPU does not say (off x86, or no /proc/cpuinfo and a
    platform string without the vendor's id, which Windows' has: "..., AuthenticAMD")."""
    reported = cpuinfo_fields().get("vendor_id") or platform.processor()
    return next((name for vendor_id, name in _VENDORS.items() if vendor_id in reported), "")


@cache
def cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here: "AVX512", "AVX2", "DEFAULT", ...
    (ATEN_CPU_CAPABILITY lowers it, so one AVX-512 machine can stand in for an AVX2 one). torch
    fixes it at start-up, so it is asked once: every block product asks which kernel serves it."""
    return str(torch.backends.cpu.get_cpu_capability())


@cache
def cpu_model() -> str:
    """The model name with its family and model numbers, "<name> (family F, model M)": the marketing
    name alone does not tell one core generation from the next."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def has_avx512() -> bool:
    """AVX-512 as torch's CPU kernels see it (ATEN_CPU_CAPABILITY can lower it)."""
    return "AVX512" in cpu_capability()


def cpu_line() -> str:
    """One line for a benchmark table: `cpu_model()` and whether it has AVX-512,
    "<name> (family F, model M), AVX-512: yes"."""
    return f"{cpu_model()}, AVX-512: {'yes' if has_avx512() else 'no'}"


def device_line(device: torch.device) -> str:
    """What a benchmark ran on, in words: "cpu" or "cuda:0 (NVIDIA H200)"."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def available_memory_bytes(device) -> int | None:
    """Memory free where the cache lives: CUDA's free bytes; on Linux MemAvailable (free plus
    reclaimable page cache), else free pages from sysconf; None when unknown."""
    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _memory_bytes("MemAvailable", "SC_AVPHYS_PAGES")


def total_memory_bytes() -> int | None:
    """The machine's memory: MemTotal on Linux, else physical pages from sysconf; None when unknown."""
    return _memory_bytes("MemTotal", "SC_PHYS_PAGES")


def _memory_bytes(meminfo_field: str, sysconf_pages: str) -> int | None:
    """A /proc/meminfo field in bytes, else that many pages from sysconf, else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(f"{meminfo_field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf(sysconf_pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_report() -> dict:
    """The machine and the software mdcli runs on, for `mdcli info` and bug reports (llama.cpp's
    and ollama's system info are the model): CPU, ISA, cores, memory, GPU, versions."""
    flags = cpuinfo_fields().get("flags", "").split()
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory_bytes": torch.cuda.get_device_properties(i).total_memory} for i in range(torch.cuda.device_count())]
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_vendor": cpu_vendor() or None,
        "isa": cpu_capability(),
        "avx512": has_avx512(),
        "avx2": "avx2" in flags if flags else None,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": total_memory_bytes(),
        "memory_available_bytes": available_memory_bytes("cpu"),
        "gpus": gpus,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
