"""mdcli: MultiDecode for Hugging Face models, exact parallel decoding in one shared KV cache."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "ask_many", "beam_search", "load_model", "margins", "run_specs", "think"]


def __getattr__(name: str):
    # Lazy: `import mdcli` (and `mdcli --help`) must not import torch.
    if name in ("ask_many", "beam_search", "margins", "run_specs", "think"):
        from mdcli import api

        return getattr(api, name)
    if name == "load_model":
        from mdcli.loading import load_model

        return load_model
    raise AttributeError(f"module 'mdcli' has no attribute {name!r}")
