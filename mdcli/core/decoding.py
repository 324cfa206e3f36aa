"""Independent branches: the step-loop policy behind ask-many, recipes, margins and think.

Strategies that only need "these prompts, decoded independently, maybe with follow-ups" describe
branches as `BranchSpec`s. `Independent` is the policy (mdcli/core/steps.py) that decodes each branch
on its own (greedy or sampled by its own generator) and, when one finishes, forks its follow-up
children; `Decoder` runs it over a Run (mdcli/core/run.py), one phase per `announce` + `decode`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from mdcli.core.constraint import TokenConstraint
from mdcli.errors import UsageError
from mdcli.core.engine import Engine
from mdcli.core.run import Run, prefill_prompts
from mdcli.core.sampling import SamplingParams
from mdcli.core.steps import Policy, StepLoop, Tip
from mdcli.events import BranchInfo, Event, Progress, Source, Stats
from mdcli.prefixes import common_prefix_length
from mdcli.speculative.planner import Speculate

# common_prefix_length (mdcli.prefixes) and prefill_prompts (mdcli.core.run) are re-exported for
# the strategies, benches and tests that import them from here; they belong to the modules named
__all__ = ["BranchSpec", "Decoder", "Independent", "common_prefix_length", "prefill_prompts"]


@dataclass
class BranchSpec:
    """One branch to decode.

    For a root branch `prompt_ids` is its whole prompt. For a child it is the continuation fed
    after the parent's generated tokens (the child forks when the parent finishes).
    """

    label: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed_key: int | None = None  # defaults to the branch id
    children: list[BranchSpec] = field(default_factory=list)
    ignore_eos: bool = False  # never choose EOS (like generate's min_new_tokens): equal-length benchmarks
    sources: tuple[Source, ...] = ()  # the passages its prompt holds (announced on its BranchInfo)
    constraint: TokenConstraint | None = None  # the answer's shape (mdcli/core/constraint.py)

    def __post_init__(self) -> None:
        self.prompt_ids = token_id_list(self.prompt_ids, f"BranchSpec {self.label!r}: prompt_ids")


def token_id_list(ids: object, what: str) -> list[int]:
    """`ids` as a list of token ids: a list or tuple of ints (numpy's and 0-d tensors' too) or a
    1-D tensor or array. Anything else, text or a tokenizer's BatchEncoding above all, is one
    UsageError line saying what to pass instead, rather than a crash deep inside the run."""
    if type(ids) is list and all(type(token) is int for token in ids):
        return ids  # the common case, as the strategies build it: no copy
    if isinstance(ids, (str, bytes)):
        raise UsageError(f"{what} is text ({_shown(ids)}), not token ids",
                         fix="pass tokenizer(text)['input_ids'] or tokenizer.encode(text)")
    if isinstance(ids, Mapping):  # transformers' BatchEncoding is one (a UserDict)
        raise UsageError(f"{what} is a {type(ids).__name__} (keys {', '.join(map(str, ids))}), not token ids",
                         fix="pass its ['input_ids'], or call apply_chat_template(..., tokenize=True, return_dict=False)")
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) != 1:
        raise UsageError(f"{what} has {ids.ndim} dimensions, not 1", fix="pass one prompt's ids, e.g. ids[0]")
    listed = ids.tolist() if hasattr(ids, "tolist") else ids
    if not isinstance(listed, (list, tuple)):
        raise UsageError(f"{what} is of type {type(ids).__name__}, not a list of token ids", fix="pass a list of ints")
    tokens = []
    for index, token in enumerate(listed):
        if isinstance(token, (list, tuple)):
            raise UsageError(f"{what} is a batch of {len(listed)} prompts, not one",
                             fix="give each prompt its own BranchSpec (e.g. prompt_ids=ids[0])")
        try:
            if isinstance(token, bool):
                raise TypeError
            tokens.append(operator.index(token))
        except TypeError:
            raise UsageError(f"{what}[{index}] is {_shown(token)}, not a token id",
                             fix="pass a list of ints") from None
    return tokens


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Independent(Policy):
    """Every tip decodes on its own: its sampler's token, fed at once; when it finishes, the
    children of its BranchSpec (tip.data) fork from its full text. `phase` names the Progress
    events ("<phase> decode": branches finished of branches so far); None sends none."""

    speculative = True

    def __init__(self, phase: str | None = "", first_id: int = 0) -> None:
        self.phase = f"{phase} decode".lstrip() if phase is not None else None
        self.first_id = first_id

    def step(self, loop: StepLoop, tips: list[Tip]) -> Iterator[Event]:
        return self.advance(loop, tips)

    def ended(self, loop: StepLoop, tip: Tip, reason: str) -> Iterator[Event]:
        """Finish, then fork the children: each continues from the parent's full text (its path,
        its tokens, their prompt); the parent's last token, never fed, starts each child's chain."""
        yield loop.finish(tip, reason)
        spec: BranchSpec | None = tip.data  # type: ignore[assignment]
        if spec is None:
            return
        generated = tip.tokens
        for child in spec.children:
            continuation = list(child.prompt_ids)
            if generated and continuation and continuation[0] == generated[-1] and generated[-1] in loop.eos:
                continuation = continuation[1:]  # the answer already closed its turn
            _, fork = loop.fork(
                tip, f"{tip.label}/{child.label}", continuation, sampling=child.sampling, seed_key=child.seed_key,
                max_new_tokens=child.max_new_tokens, stop=child.stop, ignore_eos=child.ignore_eos, data=child,
                constraint=child.constraint,
            )
            yield fork

    def progress(self, loop: StepLoop) -> Progress | None:
        if self.phase is None:
            return None
        created = loop.run.next_id - self.first_id  # roots and the children spawned so far
        return Progress(self.phase, created - len(loop.live), created, "branches")


class Decoder:
    """Runs branch specs to completion over one Run (one shared cache), phase after phase."""

    def __init__(
        self,
        engine: Engine | Run,
        tokenizer,
        eos_token_ids: frozenset[int],
        *,
        context_length: int | None = None,
        compact_ratio: float = 0.25,
        speculate: Speculate | str = "off",
    ) -> None:
        if isinstance(engine, Run):
            self.run = engine
        else:
            self.run = Run(engine, context_length=context_length, compact_ratio=compact_ratio, speculate=speculate)
        self.engine = self.run.engine
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.counters = self.run.counters
        self._roots: list[Tip] = []

    @property
    def compact_ratio(self) -> float:
        return self.run.compact_ratio

    # -- public --------------------------------------------------------------------------------

    def announce(self, specs: list[BranchSpec]) -> list[BranchInfo]:
        """Create the root branches (checking they fit the context) and describe them for Start."""
        loop = self._loop(Independent())
        self._roots = [
            loop.tip(
                spec.label, list(spec.prompt_ids), sampling=spec.sampling, seed_key=spec.seed_key,
                max_new_tokens=spec.max_new_tokens, stop=spec.stop, ignore_eos=spec.ignore_eos, data=spec,
                constraint=spec.constraint,
            )
            for spec in specs
        ]
        return [t.info() for t in self._roots]

    def decode(self, phase: str = "") -> Iterator[Event]:
        """Prefill the announced roots, then decode until every branch (and child) finishes.

        Progress: the prefill reports `Progress("<phase> prefill", tokens fed, tokens to feed)`
        before its first forward and after each one; the decode reports `Progress("<phase>
        decode", branches finished, branches so far, "branches")` after each step.
        """
        roots, self._roots = self._roots, []
        first_id = roots[0].id if roots else self.run.next_id
        loop = self._loop(Independent(phase, first_id))
        yield from loop.capped_notes(roots)
        yield from loop.prefill(roots, f"{phase} prefill".lstrip())
        yield from loop.run_tips(roots)

    def stats(self, seconds: float) -> Stats:
        return self.run.stats(seconds)

    def _loop(self, policy: Policy) -> StepLoop:
        return StepLoop(self.run, policy, self.tokenizer, self.eos)
