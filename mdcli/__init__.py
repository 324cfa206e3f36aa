"""mdcli: MultiDecode for Hugging Face models, exact parallel decoding in one shared KV cache.

The Python API is mdcli/api.py; its main entry points are also here, as `mdcli.ask_many` etc.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "ask_many", "beam_search", "explore", "load_model", "load_tokenizer", "margins", "run_specs", "think"]


def __getattr__(name: str):
    if name in __all__ and name != "__version__":
        # Here, on first use (PEP 562), not at the top: `import mdcli` (and `mdcli --help`) must not
        # pay for the decoding stack the API imports.
        from mdcli import api

        return getattr(api, name)
    raise AttributeError(f"module 'mdcli' has no attribute {name!r}")
