"""The steppers the step benchmarks time: transformers' own single-sequence decode step and mdcli's
engine step, and the interleaved median that compares them (used by `mdcli bench` and
`python -m mdcli.bench.step`)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from mdcli.backends.forward import ModelForward
from mdcli.backends.llama import FastForward
from mdcli.backends.reference import cache_argument
from mdcli.bench.twin import float32_twin
from mdcli.core.decoding import prefill_prompts
from mdcli.core.engine import Engine
from mdcli.core.forest import pad_rows
from mdcli.core.sampling import greedy_tokens

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel


class ReferenceStepper:
    """transformers' own single-sequence decode: the prompt prefilled into a stock `DynamicCache`,
    then one greedy token per forward, on torch's stock kernels (what `generate` does per token)."""

    def __init__(self, lm: LoadedModel, prompt: list[int]) -> None:
        self.model, self.cache = float32_twin(lm).model, DynamicCache()
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=lm.device)
            self.logits = self.model(input_ids=ids, **cache_argument(self.model, self.cache), use_cache=True,
                                     logits_to_keep=1).logits[:, -1]  # [1, V]

    def step(self) -> None:
        with torch.inference_mode():
            token = self.logits.argmax(-1, keepdim=True)  # [1, 1]
            self.logits = self.model(input_ids=token, **cache_argument(self.model, self.cache),
                                     use_cache=True).logits[:, -1].float()


class EngineStepper:
    """mdcli's engine: one forward feeding one greedy token to each prompt's branch.

    forward: "transformers" (the model's forward always), "mdcli" (the engine's own forward where
    it applies, as it chooses: mdcli.backends.llama), or a variant of it: "mdcli:ATTENTION:WEIGHTS", WEIGHTS
    plain, packed, transposed, openblas (the transposed copy multiplied on OpenBLAS, mdcli.backends.weights.blas)
    or a "+" of them, e.g. packed+openblas (the copies the step multiplies by), "padded" for two-row
    products on the packed copy multiplied as four (mdcli.backends.weights.packed.pair_padded_linear), and "ahead" to
    read the cache ahead (mdcli.backends.kernels.read_ahead; without it, not), "tiled" for forwards of up to
    TILED_MAX_ROWS tokens on the tiled copy (mdcli.backends.weights.tiled; without it, not), "blocks"
    for forwards of up to gguf_blocks.max_rows() tokens on the .gguf's own blocks (mdcli.backends.weights.gguf_blocks,
    where the plan found them; without it, not). Each variant is the plan with those fields replaced. "mdcli+fused": the plan's own forward with every dense forward of up to
    fused.FUSED_MAX_QUERIES queries attending on mdcli's kernel, where the plan would not.
    "mdcli-python": the plan's own forward with every step's layers in Python, not in one native call
    (mdcli.backends.native_step).

    guesses: each branch's step also verifies this many guessed tokens, a chain after its token
    (the tree a speculative step feeds, mdcli.speculative.planner); the step then continues from the last."""

    def __init__(self, lm: LoadedModel, prompts: list[list[int]], forward: str = "mdcli", guesses: int = 0) -> None:
        if not forward.startswith("mdcli"):  # transformers' forward needs float32 weights
            lm = float32_twin(lm)
        model_forward = ModelForward(lm.model, lm.forward.plan, sliding_window=lm.sliding_window,
                                     own=forward.startswith("mdcli"))
        if forward.count(":") == 2:  # a variant, for comparing the choices the plan makes
            _, attention, weights = forward.split(":")
            copies = set(weights.split("+"))
            plan = lm.forward.plan
            model_forward.own = FastForward(lm.model, replace(
                plan, attention=attention, bmm_max_queries=None, fused_attention=False, packed="packed" in copies,
                transposed=bool(copies & {"transposed", "openblas"}), lone_blas="openblas" in copies,
                pair_padding="padded" in copies, read_ahead="ahead" in copies, tiled="tiled" in copies,
                blocks=plan.blocks if "blocks" in copies else None))
        if forward == "mdcli+fused":  # the plan's choices, the kernel's attention
            model_forward.own = FastForward(lm.model, replace(lm.forward.plan, fused_attention=True))
        if forward == "mdcli-python":  # the plan's choices, a step's layers in Python
            model_forward.own = FastForward(lm.model, replace(lm.forward.plan, native_step=False))
        self.engine = Engine(model_forward, sliding_window=lm.sliding_window, mixed_layer_types=lm.mixed_layer_types)
        self.guesses = guesses
        outs = prefill_prompts(self.engine, prompts)
        self.rows, self.logits = [o.row for o in outs], torch.stack([o.logits for o in outs])  # [B, V]

    def step(self) -> None:
        tokens = greedy_tokens(self.logits)  # the engine's own choice (numpy's argmax on the CPU)
        stacked = torch.stack([_pad(r, len(self.engine)) for r in self.rows])  # [B, N]
        if self.guesses:  # a chain of 1 + guesses nodes per branch; its guesses repeat its token
            chain = list(range(-1, self.guesses))  # node i's parent: i - 1
            trees = self.engine.forward_trees(stacked, [chain] * len(tokens), [[t] * len(chain) for t in tokens])
            self.rows, self.logits = [t.rows[-1] for t in trees], torch.stack([t.logits[-1] for t in trees])
            return
        outs = self.engine.forward(stacked, [[t] for t in tokens])
        self.rows, self.logits = [o.row for o in outs], torch.stack([o.logits for o in outs])


def median_step_seconds(steppers: dict[str, object], steps: int, observe=None) -> dict[str, float]:
    """Median seconds per step of each stepper, taking their steps in turn (one of each, then the
    next), so a change in the machine's load falls on all of them alike.

    observe: an optional context manager factory entered around every timed step (the profiler)."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(steps):
        for name, stepper in steppers.items():
            with observe() if observe is not None else _nothing():
                started = time.perf_counter()
                stepper.step()
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def memory_read_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """What one thread reads per second here: the best of a few sums over a buffer much larger
    than any cache (a decode step's weights are read the same way, once each)."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


def _pad(row, length: int):
    return pad_rows(row[None], length)[0]


@contextmanager
def _nothing():
    yield
