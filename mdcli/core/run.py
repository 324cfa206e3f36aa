"""The run layer: what every strategy shares between its first event and its last.

A `Run` owns one engine (one shared KV cache) from the Start event to the Done event:

* the engine, built from a RunnableModel and the engine options (`Run.for_model`);
* the Start event (`start_event`) and the Done event with the run's stats (`Run.done`);
* branch ids, unique over every phase of the run (`Run.new_id`);
* fitting a branch to the model's context (`Run.fit`) and the "capped" note when it had to;
* the shared prefill of prompts as a radix tree of token prefixes (`Run.prefill`, built on
  `prefill_steps`), with Progress events;
* the prompt cache around the run's first prefill (`Run.prefill`, with a `PrefixStore`): the
  prompts' shared prefix is laid down from the store as far as it holds it, and kept there after;
* compaction: dropping the cache slots no live row reaches (`Run.maybe_compact`);
* the counters behind the Done event's stats (`DecodeCounters`), and the process's resident peak
  when the stats are taken (mdcli.core.resident).

Strategies decide which branches exist; the step loop (mdcli/core/steps.py) decodes them over a Run.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from mdcli.core.engine import ChainResult, Engine, ModelForward, run_to_end
from mdcli.core.forest import stack_rows
from mdcli.core.prefix_store import PrefixStore
from mdcli.core.resident import peak_rss_bytes
from mdcli.errors import ContextTooLongError
from mdcli.events import BranchInfo, Done, Note, Progress, Start, Stats
from mdcli.prefixes import common_prefix_length, trie_size
from mdcli.speculative.planner import SpeculationPolicy, parse_speculate

R = TypeVar("R")


class RunnableModel(Protocol):
    """What a run reads of a loaded model (mdcli.models.load.LoadedModel is one)."""

    forward: ModelForward  # chosen at load (mdcli.backends.forward), the engine calls it
    name: str
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    attn: str
    context_length: int | None
    sliding_window: int | None
    mixed_layer_types: bool
    prompt_store: PrefixStore | None  # the prompt cache chosen at load (None: off)


# An edge of the prompts' radix tree at least this long, and this many times longer than every
# other edge waiting with it, is fed alone (see _spine_first; measured: notebook/attention.md,
# "Prefixes read in place, the document laid down first")
SPINE_MIN_TOKENS = 64
SPINE_RATIO = 4


@dataclass
class DecodeCounters:
    """What a run did, for the `done` event (shared by every phase and strategy of a run)."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0

    def stats(self, engine: Engine, seconds: float) -> Stats:
        return Stats(
            prompt_tokens=self.prompt_tokens,
            prefill_tokens=self.prefill_tokens,
            generated_tokens=self.generated_tokens,
            steps=self.steps,
            seconds=round(seconds, 4),
            prefill_seconds=round(self.prefill_seconds, 4),
            decode_seconds=round(self.decode_seconds, 4),
            peak_cache_tokens=engine.peak_tokens,
            final_cache_tokens=len(engine),
            compactions=engine.compactions,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            forwards=engine.forwards,
            cached_tokens=self.cached_tokens,
            peak_rss_bytes=peak_rss_bytes(),
            graph_captures=engine.graph_captures(),
        )


def new_engine(model: RunnableModel, *, max_forward_tokens: int = 1024) -> Engine:
    """The engine for a loaded model: its sliding window and layer types, one empty cache."""
    return Engine(
        model.forward,
        sliding_window=model.sliding_window,
        mixed_layer_types=model.mixed_layer_types,
        max_forward_tokens=max_forward_tokens,
    )


def start_event(model: RunnableModel, strategy: str, seed: int | None, branches: list[BranchInfo]) -> Start:
    return Start(
        kernels=model.forward.describe(),
        model=model.name,
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        dtype_reason=model.dtype_reason,
        attn=model.attn,
        strategy=strategy,
        seed=seed,
        branches=branches,
    )


class Run:
    """One engine and its bookkeeping, from Start to Done.

    Build it with `Run.for_model(model, ...)` (the CLI and API) or `Run(engine, ...)` (tests and
    benches that make their own engine). `speculate`: "off" | "auto" | N draft tokens per branch
    per step (mdcli/speculative/planner.py), for the step loops whose policy allows it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model: RunnableModel | None = None,
        context_length: int | None = None,
        compact_ratio: float = 0.25,
        speculate: str | object = "off",
        prompt_store: PrefixStore | None = None,
    ) -> None:
        self.engine = engine
        self.prompt_store = prompt_store
        self._prefilled = False
        self.model = model
        self.context_length = context_length
        self.compact_ratio = compact_ratio
        setting = parse_speculate(speculate)
        # one drafting policy per run: "auto" keeps what it measured from phase to phase
        self.speculation = SpeculationPolicy(setting) if setting.on else None
        self.counters = DecodeCounters()
        self.started = time.perf_counter()
        self._next_id = 0

    @classmethod
    def for_model(
        cls,
        model: RunnableModel,
        *,
        max_forward_tokens: int = 1024,
        compact_ratio: float = 0.25,
        speculate: str = "off",
    ) -> Run:
        return cls(
            new_engine(model, max_forward_tokens=max_forward_tokens),
            model=model,
            context_length=model.context_length,
            compact_ratio=compact_ratio,
            speculate=speculate,
            prompt_store=model.prompt_store,
        )

    # -- Start and Done ------------------------------------------------------------------------

    def start(self, strategy: str, seed: int | None, branches: list[BranchInfo]) -> Start:
        """The Start event; the run's clock starts here."""
        self.started = time.perf_counter()
        assert self.model is not None, "start() needs the RunnableModel (Run.for_model)"
        return start_event(self.model, strategy, seed, branches)

    def stats(self, seconds: float | None = None) -> Stats:
        if seconds is None:
            seconds = time.perf_counter() - self.started
        return self.counters.stats(self.engine, seconds)

    def done(self) -> Done:
        return Done(stats=self.stats())

    # -- branches ------------------------------------------------------------------------------

    def new_id(self) -> int:
        """The next branch id: ids are unique over every phase of the run."""
        branch = self._next_id
        self._next_id += 1
        return branch

    @property
    def next_id(self) -> int:
        return self._next_id

    def fit(self, label: str, prompt_len: int, max_new: int) -> int:
        """The most new tokens a branch with this prompt may generate within the context.
        Raises ContextTooLongError for an empty prompt or one that fills the context."""
        if prompt_len == 0:
            raise ContextTooLongError(f"branch '{label}' has an empty prompt", fix="give it some text")
        limit = self.context_length
        if limit is None:
            return max_new
        if prompt_len >= limit:
            raise ContextTooLongError(
                f"the prompt of '{label}' is {prompt_len} tokens, {prompt_len - limit + 1} more than the "
                f"model's context of {limit} allows",
                fix="shorten the document or the question, or use a model with a longer context",
            )
        return min(max_new, limit - prompt_len)

    @staticmethod
    def capped_note(label: str, branch: int, capped: int, asked: int) -> Note | None:
        """The note that says a branch's max new tokens was capped by the context (None if not)."""
        if capped >= asked:
            return None
        return Note(
            kind="capped",
            message=f"'{label}': max new tokens capped at {capped} by the model's context",
            data={"branch": branch, "max_new_tokens": capped},
        )

    # -- prefill and compaction ----------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], phase: str) -> Generator[Progress | Note, None, list[ChainResult]]:
        """Feed prompts as a radix tree (see prefill_steps), with Progress events; counts the
        tokens fed and the time (prompt tokens are counted where branches are made). The run's
        first prefill goes through the prompt cache when it has one (`_from_store`, `_to_store`)."""
        started = time.perf_counter()
        shared = self._shared_prefix(prompts)
        restored = self._from_store(shared)
        before = len(self.engine)
        results = yield from progress_events(phase, prefill_steps(self.engine, prompts))
        self.counters.prefill_tokens += len(self.engine) - before
        self.counters.cached_tokens += restored
        self._to_store(shared, restored)
        self.counters.prefill_seconds += time.perf_counter() - started
        yield from self._store_notes()
        return results

    def prefill_apart(self, prompts: list[list[int]], phase: str) -> Generator[Progress, None, list[ChainResult]]:
        """Feed prompts as a radix tree in a cache of their own (each document's prefix a plain
        causal run, as when it runs alone, not masked against the slots here), then lay that cache
        after this run's: --each admits a document mid-forest so. Rows are over this run's cache."""
        started, engine = time.perf_counter(), self.engine
        apart = Engine(engine.model_forward, sliding_window=engine.sliding_window,
                       mixed_layer_types=engine.mixed_layer_types, max_forward_tokens=engine.max_forward_tokens,
                       capacity=trie_size(prompts))
        results = yield from progress_events(phase, prefill_steps(apart, prompts))
        offset = engine.append_apart(apart)
        self.counters.prefill_tokens += len(apart)
        self.counters.prefill_seconds += time.perf_counter() - started
        head = torch.zeros(offset, dtype=torch.bool, device=engine.device)
        return [ChainResult(row=torch.cat([head, result.row]), logits=result.logits) for result in results]

    # -- the prompt cache ----------------------------------------------------------------------

    def _shared_prefix(self, prompts: list[list[int]]) -> list[int]:
        """The tokens every prompt starts with (each prompt's last token excluded: its logits are
        needed), when this is the run's first prefill and a prompt cache is on; else []."""
        first, self._prefilled = not self._prefilled, True
        if self.prompt_store is None or not first or len(self.engine) or not prompts:
            return []
        shortest = min(len(p) for p in prompts) - 1
        shared = prompts[0][:max(shortest, 0)]
        for prompt in prompts[1:]:
            shared = shared[:common_prefix_length(shared, prompt)]
        return shared if len(shared) >= self.prompt_store.min_tokens else []

    def _from_store(self, shared: list[int]) -> int:
        """Lay down the longest cached prefix of `shared` in the empty cache; its length (0: none)."""
        hit = self.prompt_store.longest(shared) if shared else None
        if hit is None:
            return 0
        self.engine.load_prefix(shared[:hit.tokens], hit.kv)
        return hit.tokens

    def _to_store(self, shared: list[int], restored: int) -> None:
        """Keep the shared prefix, which the prefill laid down at slots [0, len(shared)), unless
        the store already held all but fewer than `min_tokens` of it (no near-duplicate entries)."""
        if shared and len(shared) - restored >= self.prompt_store.min_tokens:
            self.prompt_store.save(shared, self.engine.prefix_kv(len(shared)))

    def _store_notes(self) -> Iterator[Note]:
        """The store's problems (a bad entry skipped, a failed write) as one `note` each."""
        for line in self.prompt_store.take_notes() if self.prompt_store is not None else ():
            yield Note(kind="prompt-cache", message=line)

    def maybe_compact(self, rows: list[torch.Tensor]) -> torch.Tensor | None:
        """Reclaim the cache slots none of `rows` (every row anyone still holds) attends to, once
        they are `compact_ratio` of the cache. Returns the rows remapped ([L, K] bool), or None
        when nothing was compacted (the rows stay valid as they are)."""
        n = len(self.engine)
        if not rows or n == 0:
            return None
        stacked = stack_rows(rows, n)  # [L, N]
        dead = n - int(stacked.any(0).sum())
        if dead == 0 or dead < self.compact_ratio * n:
            return None
        return self.engine.compact(stacked)

    def empty_cache(self) -> None:
        """Free every slot (between phases whose later prompts reuse nothing)."""
        engine = self.engine
        if len(engine):
            engine.compact(torch.zeros((0, len(engine)), dtype=torch.bool, device=engine.device))


# -- the radix prefill --------------------------------------------------------------------------


def progress_events(phase: str, steps: Generator[tuple[int, int], None, R]) -> Generator[Progress, None, R]:
    """Turn ``(done, total)`` steps into Progress events, passing the steps' result through."""
    while True:
        try:
            done, total = next(steps)
        except StopIteration as stop:
            return stop.value
        yield Progress(phase, done, total)


def prefill_prompts(engine: Engine, prompts: list[list[int]]) -> list[ChainResult]:
    """Feed prompts as a radix tree hanging off what the cache already holds (see prefill_steps)."""
    return run_to_end(prefill_steps(engine, prompts))


def prefill_steps(
    engine: Engine, prompts: list[list[int]]
) -> Generator[tuple[int, int], None, list[ChainResult]]:
    """Feed prompts as a radix tree hanging off what the cache already holds, yielding
    ``(tokens fed, tokens to feed)`` before the first forward and after each one.

    Tokenize full prompts first, then share: BPE merges differ at the seams of separately
    tokenized pieces, so only token-level sharing keeps each branch identical to its prompt alone.
    Each prompt first reuses the longest path already cached (a document prefilled earlier, a
    question whose answer is being merged); the rest goes in as a radix tree, one forward (or a
    few, for long edges) per tree level. At least one token per prompt is always fed, since its
    next-token logits are needed.
    """
    results: list[ChainResult | None] = [None] * len(prompts)
    attach: dict[int, list[int]] = {}  # cached slot (-1: new root) -> prompts hanging there
    starts = [0] * len(prompts)
    for i, prompt in enumerate(prompts):
        starts[i], slot = engine.forest.longest_cached_prefix(prompt, limit=len(prompt) - 1)
        attach.setdefault(slot, []).append(i)
    pending = []  # edges (row, prompts, start, end): each one's end found once, when it is made
    for slot, members in attach.items():
        row = engine.forest.row_of(slot) if slot >= 0 else engine.forest.empty_row()
        by_start: dict[int, list[int]] = {}
        for i in members:
            by_start.setdefault(starts[i], []).append(i)
        for start, group in by_start.items():
            pending.extend(_edges(prompts, row, group, start))
    done, total = 0, sum(trie_size([prompts[i][starts[i]:] for i in members]) for members in attach.values())
    yield done, total
    while pending:
        edges, pending = _spine_first(pending)
        steps = engine.extend_steps([row for row, _, _, _ in edges], [prompts[g[0]][s:e] for _, g, s, e in edges])
        outs = yield from _running_count(steps, done, total)
        done += sum(end - start for _, _, start, end in edges)
        for (_, group, _, end), out in zip(edges, outs):
            for i in group:
                if len(prompts[i]) == end:
                    results[i] = out
            pending.extend(_edges(prompts, out.row, [i for i in group if len(prompts[i]) > end], end))
    return results  # type: ignore[return-value]


def _edges(prompts: list[list[int]], row, group: list[int], start: int) -> list[tuple]:
    """The radix tree's edges from `start` for the prompts in `group`, which all hang off `row`:
    (row, prompts sharing the edge, start, end of their common tokens)."""
    return [(row, sub, start, _common_prefix_end(prompts, sub, start))
            for sub in _group_by_token(prompts, group, start)]


def _spine_first(pending: list[tuple]) -> tuple[list, list]:
    """(edges to feed now, edges held back). An edge much longer than every other (a document
    that prompts read further into, as margins' chain layout, beside the short instructions that
    branch off it) is fed alone and the short edges wait: the document then lies in one
    contiguous run of slots, fed as plain causal pieces, and each branch sees a prefix of it (what
    mdcli.backends.attention.prefix attends to in place). Otherwise every edge is fed together."""
    if len(pending) < 2:
        return pending, []
    lengths = [end - start for _, _, start, end in pending]
    longest = max(range(len(pending)), key=lengths.__getitem__)
    others = max(length for i, length in enumerate(lengths) if i != longest)
    if lengths[longest] < SPINE_MIN_TOKENS or lengths[longest] < SPINE_RATIO * others:
        return pending, []
    return [pending[longest]], pending[:longest] + pending[longest + 1:]


def _running_count(
    steps: Generator[int, None, R], done: int, total: int
) -> Generator[tuple[int, int], None, R]:
    """Per-forward token counts -> ``(tokens fed so far, tokens to feed)``."""
    while True:
        try:
            done += next(steps)
        except StopIteration as stop:
            return stop.value
        yield done, total


def _group_by_token(prompts: list[list[int]], indices: list[int], at: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(prompts[i][at], []).append(i)
    return list(groups.values())


def _common_prefix_end(prompts: list[list[int]], group: list[int], start: int) -> int:
    """End of the longest common prefix of the group's prompts (all agree on token `start`)."""
    first = prompts[group[0]]
    end = min(len(prompts[i]) for i in group)
    for i in group[1:]:
        other = prompts[i]
        j = start
        while j < end and other[j] == first[j]:
            j += 1
        end = j
    return end
