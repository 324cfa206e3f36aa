"""Every environment variable mdcli reads, declared once: its type, default and meaning.

This is the only module that reads the environment. `current()` reads it into a `Settings`
object (pydantic-settings: one typed field per variable); the selector (mdcli.backends.select)
turns the settings and the host into a plan at load, and the rest of mdcli is handed what it
needs. Tests and benchmarks switch backends by passing a changed `Settings` to the selector
(`current().changed(cpu_kernels="torch")`), never by setting variables.

MDCLI_MODEL is the one variable read elsewhere as well: the command line's -m option takes it
as its default (typer's `envvar`, which keeps `mdcli --help` free of this module's imports);
it is declared here so that the README's table and `mdcli info` name it like every other.

On/off variables take 1/0, on/off, true/false or yes/no. A value outside a variable's choices is
a usage error (exit 2) that names the variable and what it accepts. The README's table is
`markdown_table()` (tests/test_settings.py keeps them equal).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mdcli.errors import UsageError

PREFIX = "MDCLI_"
_TRUTHY = {"1", "true", "yes", "on"}


def _other(name: str) -> dict:
    """A variable another program defines and mdcli honours: read by its own name, no prefix."""
    return {"validation_alias": AliasChoices(name)}


class Settings(BaseSettings):
    """The environment as mdcli reads it. Field `x` is variable MDCLI_X unless it names another."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, case_sensitive=False, frozen=True, populate_by_name=True,
                                      extra="ignore", env_ignore_empty=True)

    model: str | None = Field(
        None, description="The model -m/--model defaults to: a Hugging Face id, a local folder or a .gguf file (unset: the embedded SmolLM2-135M-Instruct).")
    device: str = Field(
        "auto", description="What --device auto means: auto (CUDA when present, else CPU), cpu, cuda, cuda:N or mps.")
    cache_dir: Path | None = Field(
        None, description="Where mdcli keeps its caches: the embedded model's files, compiled kernels, .gguf checks, prompts (default: $XDG_CACHE_HOME/mdcli).")
    prompt_cache_dir: Path | None = Field(
        None, description="The folder --prompt-cache auto keeps prompt prefixes in (default: the cache folder's prompts/).")
    prompt_cache_mb: int = Field(
        2048, ge=1, description="The prompt cache's size cap in MiB; the least recently used entries go first.")
    cpu_kernels: Literal["auto", "torch", "onednn"] = Field(
        "auto", description="float32 CPU kernels: auto decides by the CPU; torch or onednn forces a side.")
    forward: Literal["auto", "transformers"] = Field(
        "auto", description="transformers runs every forward on transformers' own forward (the reference).")
    packed_weights: bool = Field(
        True, description="Weight copies laid out for the CPU kernels (packed, transposed, tiled); off saves memory.")
    tiled_gemm: Literal["auto", "always", "off"] = Field(
        "auto", description="mdcli's tiled AVX2 kernel for forwards of a few tokens (auto: AVX2-only CPUs, one thread).")
    gguf_blocks: bool = Field(
        True, description="Multiply forwards by the model's own .gguf blocks where they are its weights.")
    block_digits: bool = Field(
        True, description="One-row products of K-quant blocks read x as 23-bit fixed point per block of 32, in 8-bit "
        "digits, where that was measured faster (AMD Zen 5 with AVX-512 VNNI); off: every product in float32.")
    sparse_attention: Literal["auto", "off", "always", "prefix"] = Field(
        "auto", description="Attention over each query's visible cache slots only (always, prefix: force a plan).")
    cudnn_attention: bool = Field(
        False, description="Allow cuDNN's attention on CUDA (off: it rebuilds a plan for every new cache length).")
    cuda_graphs: Literal["auto", "off", "static"] = Field(
        "auto", description="Decode forwards of up to 64 tokens on CUDA replayed as CUDA graphs (auto); off: run "
        "each as it comes; static: the same static buffers on any device, never captured (a check of their logic).")
    xdg_cache_home: Path | None = Field(None, description="The user's cache folder; mdcli's lives in it.",
                                        **_other("XDG_CACHE_HOME"))
    hf_hub_offline: str = Field("", description="Hugging Face's offline switch: a hub model is never downloaded.",
                                **_other("HF_HUB_OFFLINE"))
    transformers_offline: str = Field("", description="transformers' offline switch, honoured like HF_HUB_OFFLINE.",
                                      **_other("TRANSFORMERS_OFFLINE"))
    no_color: str = Field("", description="Any value: no colour in the live panels and plain output.",
                          **_other("NO_COLOR"))
    omp_wait_policy: str = Field(
        "", description="How torch's OpenMP threads wait between operations (ACTIVE or PASSIVE); set, mdcli's "
        "command line leaves their waiting as it says.", **_other("OMP_WAIT_POLICY"))
    gomp_spincount: str = Field(
        "", description="How many checks torch's OpenMP threads spin after an operation before sleeping; mdcli's "
        "command line starts them at 3000 where neither this nor OMP_WAIT_POLICY is set (process_defaults).",
        **_other("GOMP_SPINCOUNT"))
    glibc_tunables: str = Field(
        "", description="glibc's settings; one naming malloc leaves the allocator as it says, else mdcli's command "
        "line keeps big blocks on the heap (process_defaults).", **_other("GLIBC_TUNABLES"))
    malloc_mmap_threshold: str = Field(
        "", description="glibc's malloc: blocks from this size get pages of their own; set, mdcli's command line "
        "leaves the allocator as the environment says.", **_other("MALLOC_MMAP_THRESHOLD_"))
    malloc_trim_threshold: str = Field(
        "", description="glibc's malloc: freed heap past this size goes back to the system; set, mdcli's command "
        "line leaves the allocator as the environment says.", **_other("MALLOC_TRIM_THRESHOLD_"))
    cc: str = Field("cc", description="The C compiler mdcli's native kernels are built with, at first use.",
                    **_other("CC"))

    @field_validator("device", "cpu_kernels", "forward", "packed_weights", "tiled_gemm", "gguf_blocks",
                     "block_digits", "sparse_attention", "cudnn_attention", "cuda_graphs", mode="before")
    @classmethod
    def _spelled_any_case(cls, value):
        """Choices and on/off values ignore case and surrounding spaces (` Torch ` is torch)."""
        return value.strip().lower() if isinstance(value, str) else value

    @property
    def offline(self) -> bool:
        """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value, as Hugging Face reads them."""
        return any(value.strip().lower() in _TRUTHY for value in (self.hf_hub_offline, self.transformers_offline))

    @property
    def colour_off(self) -> bool:
        """NO_COLOR set and not empty (https://no-color.org)."""
        return bool(self.no_color)

    @property
    def mdcli_cache(self) -> Path:
        """The folder mdcli keeps its caches in: MDCLI_CACHE_DIR, else $XDG_CACHE_HOME/mdcli, else ~/.cache/mdcli."""
        if self.cache_dir is not None:
            return self.cache_dir.expanduser()
        if self.xdg_cache_home is not None:
            return self.xdg_cache_home.expanduser() / "mdcli"
        return Path.home() / ".cache" / "mdcli"

    @property
    def prompt_cache_folder(self) -> Path:
        """Where --prompt-cache auto keeps its entries: MDCLI_PROMPT_CACHE_DIR, else prompts/ in mdcli's cache."""
        return self.prompt_cache_dir.expanduser() if self.prompt_cache_dir is not None else self.mdcli_cache / "prompts"

    def changed(self, **changes) -> Settings:
        """These settings with some fields changed, validated as the environment's values are."""
        try:
            return type(self).model_validate({**self.model_dump(), **changes})
        except ValidationError as error:
            raise _usage_error(error) from None


def current() -> Settings:
    """The environment now, read into Settings; a bad value is a one-line UsageError."""
    try:
        return Settings()
    except ValidationError as error:
        raise _usage_error(error) from None


# Set for mdcli's own command-line processes before torch loads, where the user set neither OpenMP
# variable (OPENMP_WAITING). torch's OpenMP threads (libgomp) spin 300,000 checks after each of its
# operations by default and take the cores that mdcli's kernel threads need between them, and a
# spinning pool is what collapses on a busy machine; sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# makes each of a prefill's products wait for its threads to wake. A short spin serves both
# (docs/cpu-backends.md, "Threads").
PROCESS_DEFAULTS = {"GOMP_SPINCOUNT": "3000"}
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one set: the user chose how OpenMP waits


# glibc's malloc gives blocks past a threshold (128 KiB, raised to the size of the last such block
# freed) pages of their own and returns freed memory at the heap's top past twice that: a prefill's
# activations and scores (megabytes each, every 256-token piece) were pages the kernel zeroed anew:
# a 1,825-token prefill took 3.5-3.9 s, 3.0-3.1 with the blocks kept (the embedded model, one thread,
# Zen 5). mdcli's command line keeps blocks up to 32 MiB (mallopt's most) on the heap and up to 128
# MiB of freed heap (docs/cpu-backends.md, "Threads").
ALLOCATOR_DEFAULTS = {-3: 32 << 20, -1: 128 << 20}  # mallopt's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
ALLOCATOR_CHOSEN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # set, or GLIBC_TUNABLES naming malloc


def process_defaults() -> None:
    """Give this process PROCESS_DEFAULTS where the environment sets none of OPENMP_WAITING (call
    before torch is imported: OpenMP reads its variables once), and glibc's malloc ALLOCATOR_DEFAULTS
    where the environment does not set it."""
    _allocator_defaults()
    if any(os.environ.get(name) for name in OPENMP_WAITING):
        return
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def on_glibc() -> bool:
    """This process runs on glibc, whose malloc ALLOCATOR_DEFAULTS are for."""
    names = getattr(os, "confstr_names", {})
    return "CS_GNU_LIBC_VERSION" in names and "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or "")


def _allocator_defaults() -> None:
    """ALLOCATOR_DEFAULTS by mallopt, on glibc, where the user set neither variable nor a malloc tunable."""
    chosen = any(os.environ.get(name) for name in ALLOCATOR_CHOSEN) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if chosen or not on_glibc():
        return
    mallopt = ctypes.CDLL(None).mallopt
    for option, value in ALLOCATOR_DEFAULTS.items():
        mallopt(option, value)


def child_environment(**values: str) -> dict[str, str]:
    """This process's environment with `values` set, for a subprocess mdcli starts (a benchmark's)."""
    return {**os.environ, **values}


def variable(field: str) -> str:
    """The environment variable a Settings field is read from."""
    alias = Settings.model_fields[field].validation_alias
    return alias.choices[0] if isinstance(alias, AliasChoices) else f"{PREFIX}{field.upper()}"


def accepted(field: str) -> str:
    """What a variable accepts, as its error and the README say it."""
    info = Settings.model_fields[field]
    choices = getattr(info.annotation, "__args__", None)
    if info.annotation is bool:
        return "1/0, on/off, true/false or yes/no"
    if info.annotation is int:
        return "a whole number"
    if choices and all(isinstance(choice, str) for choice in choices):
        return ", ".join(choices[:-1]) + f" or {choices[-1]}"
    return "a path" if "Path" in str(info.annotation) else "any text"


def changed_settings() -> dict[str, str]:
    """The variables set to something other than their default, by name: what `mdcli info` shows."""
    now, default = current(), Settings.model_construct()
    return {variable(field): str(value) for field, value in now.model_dump().items()
            if value != getattr(default, field)}


def markdown_table() -> str:
    """The README's table of variables, one row per field."""
    rows = ["| variable | accepts | default | meaning |", "|---|---|---|---|"]
    for field, info in Settings.model_fields.items():
        default = info.default
        shown = "on" if default is True else "off" if default is False else (default or "unset")
        rows.append(f"| `{variable(field)}` | {accepted(field)} | {shown} | {info.description} |")
    return "\n".join(rows)


def _usage_error(error: ValidationError) -> UsageError:
    problem = error.errors()[0]
    field = next((name for name in Settings.model_fields if name in problem["loc"]
                  or variable(name).lower() in [str(part).lower() for part in problem["loc"]]), None)
    if field is None:
        return UsageError(f"a setting is not valid: {problem['msg']}", fix="see the README's Settings table")
    name = variable(field)
    value = problem.get("input")
    return UsageError(f"{name}={value!r} is not valid", fix=f"set {name} to {accepted(field)}")
