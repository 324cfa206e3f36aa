"""A Hugging Face hub id: whether the hub answers, where its files are read from, and the one-line
errors when a hub model cannot be loaded.

The rule: a hub id asks the hub once, with a short timeout, before anything is loaded. When it does
not answer, a model already in the local Hugging Face cache loads from there (`local_files_only`,
as with HF_HUB_OFFLINE) and one that is not fails at once, in one line that says how to get it.
Without that question transformers retries an unreachable hub five times, about 25 s of retry
lines, before it fails or falls back to the cache. With HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE)
set nothing is asked: the cache only.
"""

from __future__ import annotations

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import get_session

from mdcli import settings
from mdcli.errors import ModelLoadError, first_line

ASK_SECONDS = 5.0  # how long the hub has to answer the one question; an answer of any status counts


def offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set (the registry), or huggingface_hub's own switch."""
    return settings.current().offline or bool(huggingface_hub.is_offline_mode())


def unreachable(timeout: float = ASK_SECONDS) -> str | None:
    """None when the hub answers one HEAD request (whatever its status), else why not, in a few words.
    The request goes through huggingface_hub's own session, so its endpoint (HF_ENDPOINT), proxies
    and certificates are the ones a download would use."""
    try:
        get_session().head(hub_constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (no answer, whatever the HTTP library calls it: say why)
        return first_line(exc)
    return None


def in_local_cache(repo_id: str) -> bool:
    """The model's config.json is in the local Hugging Face cache (the snapshot `main` points at)."""
    try:
        return isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not an id the cache can hold ("a/b/c"): not in it
        return False


def local_only(repo_id: str) -> bool:
    """Whether `repo_id` must be read from the local cache alone; raises at once, in one line, when
    the hub cannot be asked and the model is not there."""
    if offline():
        return True
    why = unreachable()
    if why is None:
        return False
    if in_local_cache(repo_id):
        return True
    raise ModelLoadError(
        f"cannot reach the Hugging Face hub ({hub_constants.ENDPOINT}: {why}) and '{repo_id}' is not in "
        "the local Hugging Face cache",
        fix=f"download it once where there is network (hf download {repo_id}), or pass a local folder or .gguf file",
    )


def load_error(repo_id: str, detail: str, *, local_only: bool) -> ModelLoadError:
    """One line for a hub model that failed to load: from the cache alone (offline, or the hub not
    answering), or with the hub's own reason."""
    if offline():
        return ModelLoadError(
            f"model '{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
            fix=f"download it once with network access (hf download {repo_id}), or pass a local folder or .gguf",
        )
    if local_only:
        return ModelLoadError(
            f"the Hugging Face hub does not answer and '{repo_id}' in the local cache could not be loaded: "
            f"{detail.rstrip('.;: ')}",
            fix=f"download it again where there is network (hf download {repo_id}), or pass a local folder or .gguf",
        )
    return ModelLoadError(
        f"could not load '{repo_id}' from the Hugging Face hub: {detail.rstrip('.;: ')}",
        fix="check the id, set HF_TOKEN for gated models, or pass a local folder or .gguf file",
    )
