"""The Python API. The command line is a thin consumer of exactly these functions.

    from mdcli import load_model, ask_many
    model = load_model()                       # the embedded SmolLM2-135M-Instruct
    for event in ask_many(model, story, ["Who is the main character?", "Where is it set?"]):
        if event.type == "finish":
            print(event.label, "->", event.text)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mdcli.decoding import BranchSpec, Decoder
from mdcli.events import Done, Event, Start
from mdcli.sampling import SamplingParams

if TYPE_CHECKING:
    from mdcli.loading import LoadedModel


def run_specs(
    model: LoadedModel,
    specs: list[BranchSpec],
    *,
    strategy: str,
    seed: int | None = None,
    max_forward_tokens: int = 1024,
    compact_ratio: float = 0.25,
) -> Iterator[Event]:
    """Decode independent branches (with optional follow-up children) in one shared cache."""
    from mdcli.engine import Engine

    engine = Engine(
        model.model,
        sliding_window=model.sliding_window,
        mixed_layer_types=model.mixed_layer_types,
        max_forward_tokens=max_forward_tokens,
    )
    decoder = Decoder(
        engine, model.tokenizer, model.eos_token_ids, context_length=model.context_length, compact_ratio=compact_ratio
    )
    branches = decoder.announce(specs)
    yield start_event(model, strategy, seed, branches)
    started = time.perf_counter()
    yield from decoder.decode()
    yield Done(stats=decoder.stats(time.perf_counter() - started))


def start_event(model: LoadedModel, strategy: str, seed: int | None, branches) -> Start:
    return Start(
        model=model.name,
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        dtype_reason=model.dtype_reason,
        attn=model.attn,
        strategy=strategy,
        seed=seed,
        branches=branches,
    )


def ask_many(
    model: LoadedModel,
    document: str,
    questions: list[str],
    *,
    system: str | None = None,
    template: str | None = None,
    chat_template: bool = True,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 256,
    stop: tuple[str, ...] = (),
    **engine_options,
) -> Iterator[Event]:
    """Answer every question about `document`, all decoding together over the document's cache."""
    from mdcli.strategies.ask_many import DEFAULT_TEMPLATE, AskMany

    job = AskMany(
        document=document,
        questions=list(questions),
        system=system,
        template=template or DEFAULT_TEMPLATE,
        chat_template=chat_template,
        sampling=sampling or SamplingParams(),
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
    )
    specs = job.branches(model.tokenizer)
    seed = job.sampling.seed
    return run_specs(model, specs, strategy="ask-many", seed=seed, **engine_options)
