"""The CPU's vendor, read from /proc/cpuinfo (or the platform string where there is none): kernel
choices measured on one vendor's cores (the plan's read_ahead and pair_padding, mdcli.backends.select)
follow it; `Host.read()` hands it to the selector."""

from __future__ import annotations

import platform

import pytest

from mdcli.backends import host as cpuinfo
from mdcli.backends.host import cpu_model
from mdcli.backends.select import Host

CPUINFO_TEXT = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: SomeoneElse
"""


@pytest.fixture
def fresh_cpuinfo(monkeypatch, tmp_path):
    """fresh_cpuinfo(text or None) -> points mdcli.backends.host at a file holding `text` (None: no file);
    the cached readings are cleared before and after, so other tests see the real CPU again."""

    def use(text: str | None) -> None:
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(cpuinfo, "CPUINFO", path)
        _clear()

    yield use
    monkeypatch.undo()
    _clear()


def _clear() -> None:
    cpuinfo.cpuinfo_fields.cache_clear()
    cpuinfo.cpu_vendor.cache_clear()
    cpu_model.cache_clear()


@pytest.mark.parametrize(("vendor_id", "vendor"), [("AuthenticAMD", "AMD"), ("GenuineIntel", "Intel"),
                                                    ("HygonGenuine", "")])
def test_the_vendor_is_the_first_processors_vendor_id(fresh_cpuinfo, vendor_id, vendor):
    fresh_cpuinfo(CPUINFO_TEXT.format(vendor=vendor_id, family=25, model=17, name="AMD EPYC 9R14"))
    assert cpuinfo.cpu_vendor() == vendor


def test_the_host_line_names_the_model_with_its_family_and_number(fresh_cpuinfo):
    fresh_cpuinfo(CPUINFO_TEXT.format(vendor="GenuineIntel", family=6, model=207, name="Intel(R) Xeon(R) Processor"))
    assert cpu_model() == "Intel(R) Xeon(R) Processor (family 6, model 207)"


def test_without_cpuinfo_the_platform_string_names_the_vendor(fresh_cpuinfo, monkeypatch):
    fresh_cpuinfo(None)
    assert cpuinfo.cpuinfo_fields() == {}
    monkeypatch.setattr(platform, "processor", lambda: "AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD")
    assert cpuinfo.cpu_vendor() == "AMD"  # as Windows reports it
    cpuinfo.cpu_vendor.cache_clear()
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert cpuinfo.cpu_vendor() == ""


def test_this_machine_reports_its_own_vendor():
    """Where /proc/cpuinfo names an x86 vendor, cpu_vendor agrees with it."""
    vendor_id = cpuinfo.cpuinfo_fields().get("vendor_id")
    if vendor_id not in ("AuthenticAMD", "GenuineIntel"):
        pytest.skip(f"no x86 vendor_id here ({vendor_id!r})")
    assert cpuinfo.cpu_vendor() == {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}[vendor_id]


def test_the_selector_reads_this_machines_vendor_and_kernel_isa():
    """The host facts the selector decides by are the ones mdcli.backends.host reads."""
    read = Host.read()
    assert read.vendor == cpuinfo.cpu_vendor() and read.capability == cpuinfo.cpu_capability()
    assert read.machine == platform.machine().lower()
