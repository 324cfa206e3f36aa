"""The float32 twin of a model that runs on its .gguf's blocks alone, for the approaches that need
float32 weights: transformers' `generate` (sequential, batched, prefix-copy, HF prompt lookup),
its single-sequence step, and the forest on other kernels of the same weights.

A model loaded on its blocks (mdcli.models.on_blocks) holds no float32 projections; its twin is
the same model loaded with them kept (`LoadOptions.keep_float32`), once per model. Both multiply
by the same float32 weights, so their tokens are compared as before. A benchmark holding a twin
holds both models: its process-wide peak memory is not the default run's (benchmarks/memory.py
measures that in a process of its own).
"""

from __future__ import annotations

import weakref

from mdcli.backends.weights.gguf_blocks import source_of
from mdcli.models.embedded import EMBEDDED_NAME
from mdcli.models.load import LoadedModel, LoadOptions, load_model

_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def float32_twin(model: LoadedModel) -> LoadedModel:
    """`model` itself where it holds float32 weights, else its twin that does (loaded once)."""
    if not model.forward.plan.on_blocks:
        return model
    if model.model not in _TWINS:
        source = None if model.name == EMBEDDED_NAME else str(source_of(model.model))
        _TWINS[model.model] = load_model(LoadOptions(model=source, device="cpu", dtype="float32", quiet=True,
                                                     cpu_weights=model.cpu_weights, keep_float32=True))
    return _TWINS[model.model]
