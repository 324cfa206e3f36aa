"""The prompt cache a loaded model is handed: what identifies its numerics, and its store.

`prompt_store` gathers every fact that changes the keys and values a prefill computes (see
mdcli.prompt_cache.key for the list and why) and opens the store of that namespace in the folder
`--prompt-cache` names. The weights are identified by their content: the digest of the weight
files the model was loaded from (remembered by path, size and modification time, so only the
first run over a file pays for reading it), or, where there are no files to hash, of its tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
import torch
import transformers

from mdcli import settings
from mdcli.prompt_cache.key import cache_folder, files_digest, namespace, tensors_digest
from mdcli.prompt_cache.store import PromptStore

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FIRST_WORDS = 60  # characters of a prefix's text `mdcli cache list` shows
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "_commit_hash")  # where it was read, not what it is


def check_prompt_cache(option: str) -> None:
    """A bad --prompt-cache value fails before anything loads."""
    cache_folder(option, settings.current())


def prompt_store(option: str, *, location: str, gguf_file: str | None, is_hub_id: bool, hf_model, plan,
                 tokenizer, name: str, dtype: torch.dtype, device: torch.device, attn: str,
                 cpu_weights: str) -> PromptStore | None:
    """The store `option` (auto | off | a folder) names for this model, or None when off."""
    now = settings.current()
    folder = cache_folder(option, now)
    if folder is None:
        return None
    config = numerics_config(hf_model.config)
    facts = {
        "weights": _weights_digest(location, gguf_file, is_hub_id, hf_model, folder),
        "config": config,
        "dtype": str(dtype),
        "device": _device_kind(device),
        "plan": plan.as_dict(),
        "attn": attn,
        "cpu_weights": cpu_weights,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    shown = {"threads": str(facts["threads"]), "device": facts["device"], "attn": attn, "cpu weights": cpu_weights,
             "kernels": plan.linears.name, "torch": torch.__version__, "transformers": transformers.__version__}
    return PromptStore(folder, namespace(facts), model=name, dtype=dtype, cap_bytes=now.prompt_cache_mb << 20,
                       describe=first_words_of(tokenizer), numerics=shown)


def numerics_config(config) -> dict:
    """The config's fields that change what the model computes (not where it was read from)."""
    return {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG}


def _weights_digest(location: str, gguf_file: str | None, is_hub_id: bool, hf_model, folder: Path) -> str:
    files = _weight_files(location, gguf_file, is_hub_id)
    if files:
        return files_digest(files, folder)
    return tensors_digest(hf_model.state_dict().items())


def _weight_files(location: str, gguf_file: str | None, is_hub_id: bool) -> list[Path]:
    """The files the weights were read from: the .gguf, or the folder's (a hub snapshot's) weight files."""
    if gguf_file is not None:
        return [Path(location) / gguf_file]
    if is_hub_id:
        try:  # the local snapshot only: never the network
            location = huggingface_hub.snapshot_download(location, local_files_only=True)
        except Exception:  # noqa: BLE001  (any failure: hash the tensors instead)
            return []
    return sorted(p for p in Path(location).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def first_words_of(tokenizer):
    """ids -> the first words of their text after the chat template's opening (the system turn
    and the user turn's head), so entries are told apart by their documents, not their template."""
    opening = _template_opening(tokenizer)

    def describe(ids: list[int]) -> str:
        text = tokenizer.decode(ids[:512], skip_special_tokens=False)
        if opening and text.startswith(opening):
            text = text[len(opening):]
        for special in getattr(tokenizer, "all_special_tokens", []):
            text = text.replace(special, " ")
        words = " ".join(text.split())
        return words if len(words) <= FIRST_WORDS else words[:FIRST_WORDS - 1] + "…"

    return describe


def _template_opening(tokenizer) -> str:
    """What the chat template writes before a user's text (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    marker = "\u2063MDCLI\u2063"
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001  (a template that cannot render: no opening to strip)
        return ""
    return re.split(re.escape(marker), rendered, maxsplit=1)[0] if marker in rendered else ""
