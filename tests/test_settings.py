"""Settings: every environment variable is declared once (mdcli/settings.py), read there only,
spelled the same way, and a bad value is one line naming the variable and what it accepts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mdcli import settings
from mdcli.errors import UsageError
from mdcli.settings import Settings, current, markdown_table, variable

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_table_is_the_registry():
    text = README.read_text()
    begin, end = "<!-- settings:begin -->\n", "\n<!-- settings:end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == markdown_table()


def test_every_field_is_one_documented_variable():
    names = [variable(field) for field in Settings.model_fields]
    assert len(names) == len(set(names))
    assert all(info.description for info in Settings.model_fields.values())
    assert {"MDCLI_CPU_KERNELS", "HF_HUB_OFFLINE", "NO_COLOR", "XDG_CACHE_HOME"} <= set(names)


@pytest.mark.parametrize("spelling, expected", [("1", True), ("on", True), ("true", True), ("yes", True),
                                                ("0", False), ("off", False), ("false", False), ("no", False)])
def test_every_on_off_variable_takes_the_same_spellings(monkeypatch, spelling, expected):
    switches = [f for f, info in Settings.model_fields.items() if info.annotation is bool]
    assert len(switches) >= 3
    for field in switches:
        monkeypatch.setenv(variable(field), spelling)
    read = current()
    assert all(getattr(read, field) is expected for field in switches)


@pytest.mark.parametrize("name, value, accepted", [
    ("MDCLI_CPU_KERNELS", "fastest", "auto, torch or onednn"),
    ("MDCLI_PACKED_WEIGHTS", "maybe", "1/0, on/off, true/false or yes/no"),
    ("MDCLI_SPARSE_ATTENTION", "dense", "auto, off, always or prefix"),
])
def test_an_unknown_value_is_one_usage_error_naming_the_variable_and_its_choices(monkeypatch, name, value, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as raised:
        current()
    message = str(raised.value)
    assert "\n" not in message and name in message and repr(value) in message and accepted in message


@pytest.mark.parametrize("spelling", ["torch", "Torch", " TORCH "])
def test_choices_ignore_case_and_surrounding_spaces(monkeypatch, spelling):
    monkeypatch.setenv("MDCLI_CPU_KERNELS", spelling)
    monkeypatch.setenv("MDCLI_GGUF_BLOCKS", " Off ")
    assert current().cpu_kernels == "torch" and current().gguf_blocks is False


def test_an_empty_variable_means_its_default(monkeypatch):
    monkeypatch.setenv("MDCLI_CPU_KERNELS", "")
    monkeypatch.setenv("MDCLI_GGUF_BLOCKS", "")
    assert current().cpu_kernels == "auto" and current().gguf_blocks is True


def test_changed_settings_are_validated_like_the_environment():
    assert current().changed(cpu_kernels="torch").cpu_kernels == "torch"
    with pytest.raises(UsageError, match="MDCLI_TILED_GEMM"):
        current().changed(tiled_gemm="sometimes")


def test_the_cache_folder_follows_mdcli_cache_dir_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MDCLI_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert current().mdcli_cache == tmp_path / "xdg" / "mdcli"
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "own"))
    assert current().mdcli_cache == tmp_path / "own"


def test_changed_settings_lists_what_differs_from_the_defaults(monkeypatch):
    for field in Settings.model_fields:
        monkeypatch.delenv(variable(field), raising=False)
    assert settings.changed_settings() == {}
    monkeypatch.setenv("MDCLI_CPU_KERNELS", "torch")
    assert settings.changed_settings() == {"MDCLI_CPU_KERNELS": "torch"}


def test_a_bad_variable_stops_a_command_with_exit_2_and_one_line(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "MDCLI_SPARSE_ATTENTION": "sometimes"}
    result = subprocess.run([sys.executable, "-m", "mdcli", "ask-many", "-", "-q", "Why?", "-n", "2"],
                            input="A short story.", capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("mdcli: error: MDCLI_SPARSE_ATTENTION='sometimes' is not valid")
    assert "Traceback" not in result.stderr


def test_every_variable_a_command_option_reads_is_in_the_registry():
    # issue 53: -m read MDCLI_MODEL, which every --help named and the README's table did not
    import click
    import typer

    from mdcli.cli.app import app

    def options(command: click.Command):
        yield from command.params
        for sub in getattr(command, "commands", {}).values():
            yield from options(sub)

    read = {option.envvar for option in options(typer.main.get_command(app)) if option.envvar}
    assert read and read <= {variable(field) for field in Settings.model_fields}


@pytest.mark.parametrize(("given", "expected"), [
    ({}, "GOMP_SPINCOUNT=3000"),  # neither set: the short spin
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "GOMP_SPINCOUNT=None"),  # the user chose: nothing added
    ({"GOMP_SPINCOUNT": "0"}, "GOMP_SPINCOUNT=0"),
])
def test_the_command_line_gives_openmp_a_short_spin_only_where_the_user_chose_no_waiting(given, expected):
    import os
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k not in settings.OPENMP_WAITING} | given
    code = "import os; from mdcli.settings import process_defaults; process_defaults(); " \
           "print('GOMP_SPINCOUNT=' + str(os.environ.get('GOMP_SPINCOUNT')))"
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == expected


ALLOCATE_TWICE = """
import ctypes, resource
from mdcli.settings import process_defaults
process_defaults()
libc, size = ctypes.CDLL(None), 16 << 20
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(2):  # a prefill piece's temporaries, made and freed, then made again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not settings.on_glibc(), reason="glibc's allocator only")
@pytest.mark.parametrize(("given", "reused"), [
    ({}, True),  # mdcli's defaults: the freed block's pages are used again
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, False),  # the user's choice: big blocks mapped anew
])
def test_the_command_line_keeps_a_freed_big_block_for_the_next_one_unless_the_user_set_malloc(given, reused):
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k not in settings.ALLOCATOR_CHOSEN + ("GLIBC_TUNABLES",)}
    done = subprocess.run([sys.executable, "-c", ALLOCATE_TWICE], env=environment | given, capture_output=True,
                          text=True, check=True)
    first, second = map(int, done.stdout.split())
    assert (second * 10 < first) == reused, (first, second)
