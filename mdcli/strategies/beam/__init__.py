"""beam: Hugging Face's beam search as one tree in one shared KV cache.

    job      what a run asks: BeamOptions (shared with the recipe), BeamParams, Beam
    rules    HF's selection rules and scores for one beam set, and the memory estimate
    search   the step-loop policy over every beam set, the input checks, and the run
"""

from mdcli.strategies.beam.job import Beam, BeamOptions, BeamParams, EarlyStopping, parse_early_stopping
from mdcli.strategies.beam.rules import DEFAULT_COMPACT_RATIO, IMPOSSIBLE, BeamSet, beam_memory_bytes
from mdcli.strategies.beam.search import (
    BeamPrompt,
    BeamSearch,
    beam_prompts,
    check_beam_fits,
    ignored_generation_settings,
    run_beam,
)

__all__ = [
    "DEFAULT_COMPACT_RATIO", "IMPOSSIBLE", "Beam", "BeamOptions", "BeamParams", "BeamPrompt", "BeamSearch", "BeamSet",
    "EarlyStopping", "beam_memory_bytes", "beam_prompts", "check_beam_fits", "ignored_generation_settings",
    "parse_early_stopping", "run_beam",
]
