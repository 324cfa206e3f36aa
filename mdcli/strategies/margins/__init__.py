"""margins: Writing in the Margins, every margin written at once.

    job    what a run asks: documents, questions, every parameter (MarginsOptions, shared with
           the recipe) and every prompt text (no model)
    fit    what fits: every prompt within the context, every phase's cache within memory
    run    the three phases (margins, classifications, answers) over one cache; its docstring
           documents the prompts and the events
"""

from mdcli.strategies.margins.fit import MEMORY_SHARE, cache_tokens, check_fits
from mdcli.strategies.margins.job import (
    ANSWER_TEMPLATE,
    CLASSIFICATION_CONSTRAINT,
    CLASSIFICATION_TEMPLATE,
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_CLASSIFY_TOKENS,
    DEFAULT_MARGIN_TOKENS,
    DOCUMENT_SEPARATOR,
    KEEPS,
    Keep,
    LAYOUTS,
    Layout,
    MARGIN_TEMPLATE,
    MarginResult,
    Margins,
    MarginsOptions,
    MarginsPrompts,
    NOTE_SEPARATOR,
    NOTE_TEMPLATE,
    NOTE_WITH_SEGMENT_TEMPLATE,
    NO_NOTES,
    Verdict,
    parse_verdict,
)
from mdcli.strategies.margins.run import new_decoder, run_margins, sources_note

__all__ = [
    "ANSWER_TEMPLATE", "CLASSIFICATION_CONSTRAINT", "CLASSIFICATION_TEMPLATE", "DEFAULT_ANSWER_TOKENS", "DEFAULT_CLASSIFY_TOKENS",
    "DEFAULT_MARGIN_TOKENS", "DOCUMENT_SEPARATOR", "KEEPS", "LAYOUTS", "MARGIN_TEMPLATE", "MEMORY_SHARE", "NO_NOTES",
    "NOTE_SEPARATOR", "NOTE_TEMPLATE", "NOTE_WITH_SEGMENT_TEMPLATE", "Keep", "Layout", "MarginResult", "Margins",
    "MarginsOptions", "MarginsPrompts", "Verdict", "cache_tokens", "check_fits", "new_decoder", "parse_verdict",
    "run_margins", "sources_note",
]
