"""What the CPU says about itself: /proc/cpuinfo's fields and the vendor.

Its own module, below both mdcli.kernels (which picks kernels by vendor where a choice was measured
on one vendor's cores only) and mdcli.hostinfo (which names the CPU in benchmark tables and itself
imports mdcli.kernels)."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

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
