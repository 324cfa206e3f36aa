"""What machine a number was measured on: every benchmark table names the CPU and whether it has
AVX-512, because the same machine kind is sometimes an AVX-512 Zen 5 and sometimes an AVX2-only
Zen 3, and kernel choices (mdcli.kernels) and speed differ between them."""

from __future__ import annotations

import platform
from functools import cache

from mdcli.cpuinfo import cpuinfo_fields
from mdcli.kernels import cpu_capability


@cache
def cpu_model() -> str:
    """e.g. "AMD EPYC (family 26, model 2)": the marketing name alone does not tell Zen 3 from Zen 5."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def has_avx512() -> bool:
    """AVX-512 as torch's CPU kernels see it (ATEN_CPU_CAPABILITY can lower it), else the CPU flags."""
    try:
        return "AVX512" in cpu_capability()
    except ImportError:  # torch missing: fall back to what the CPU reports
        return "avx512f" in cpuinfo_fields().get("flags", "").split()


def cpu_line() -> str:
    """One line for a benchmark table: "AMD EPYC (family 26, model 2), AVX-512: yes"."""
    return f"{cpu_model()}, AVX-512: {'yes' if has_avx512() else 'no'}"
