"""mdcli: MultiDecode for Hugging Face models, exact parallel decoding in one shared KV cache.

The Python API is mdcli/api.py; every name it exports is also here (`from mdcli import
read_inputs`), imported on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Every name mdcli.api exports (tests/test_structure.py keeps the two lists equal), most used first.
__all__ = [
    "__version__",
    "load_model", "load_tokenizer", "ask_each", "ask_many", "beam_search", "explore", "margins", "run_specs", "think",
    "LoadedModel", "LoadOptions", "RunOptions", "host_report", "changed_settings",
    "ASK_MANY_TEMPLATE", "AskMany", "unretrieved_notes", "Beam", "BeamParams", "BranchSpec", "Constraint", "Explore", "Margins",
    "MarginsPrompts", "SamplingParams", "Speculate", "Think", "FieldError", "parse_early_stopping", "parse_speculate",
    "DEFAULT_ANSWER_TOKENS", "DEFAULT_CLASSIFY_TOKENS", "DEFAULT_MARGIN_TOKENS", "DEFAULT_SEGMENT_TOKENS",
    "MIN_SEGMENT_TOKENS", "CPU_BUDGET_TOKENS", "entry_key",
    "PromptCacheEntry", "clear_prompt_cache", "prompt_cache_entries",
    "Document", "Inputs", "Skipped", "joined_text", "named_text", "read_inputs",
    "ForestLayout", "plan_layout", "render_explanation", "describe_step", "first_verified_step",
]


def __getattr__(name: str):
    if name in __all__ and name != "__version__":
        # Here, on first use (PEP 562), not at the top: `import mdcli` (and `mdcli --help`) must not
        # pay for the decoding stack the API imports.
        from mdcli import api

        return getattr(api, name)
    raise AttributeError(f"module 'mdcli' has no attribute {name!r}")
