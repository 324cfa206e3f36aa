"""The decoding loop: turns branch specs into events, one engine forward per step.

Strategies that only need "these prompts, decoded independently, maybe with follow-ups" (ask-many,
recipes, margins, think) describe branches as `BranchSpec`s and iterate `decode(...)`. Beam search
drives the engine itself because it chooses among candidates across branches.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from mdcli.detok import StreamingDetokenizer
from mdcli.engine import ChainResult, Engine, run_to_end
from mdcli.errors import ContextTooLongError
from mdcli.events import BranchInfo, Event, Finish, Fork, Note, Progress, Stats, Token
from mdcli.forest import pad_rows
from mdcli.sampling import Sampler, SamplingParams, choose_tokens
from mdcli.speculate import Speculate, SpeculationPolicy, parse_speculate

if TYPE_CHECKING:
    import torch

R = TypeVar("R")


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


@dataclass
class _Branch:
    id: int
    spec: BranchSpec
    label: str
    path_ids: list[int]  # everything the branch attends to before its first generated token
    sampler: Sampler
    detok: StreamingDetokenizer
    max_new_tokens: int
    row: torch.Tensor | None = None  # ancestor row of the last token fed
    logits: torch.Tensor | None = None  # [V] next-token logits
    logprob: float = 0.0
    parent: int | None = None
    fork_at: int = 0  # children: index in path_ids just past the parent's last generated token
    # speculative decoding (mdcli/verify.py): the token already chosen after the last accepted
    # guess (token, logprob); a child forked after a verify, still to be fed; the branch's drafter
    pending: tuple[int, float] | None = None
    chain: list[int] | None = None
    drafts: object | None = None

    def info(self) -> BranchInfo:
        return BranchInfo(id=self.id, label=self.label, prompt_token_ids=list(self.path_ids), parent=self.parent)


@dataclass
class DecodeCounters:
    """What a run did, for the `done` event (shared by every loop that drives an engine)."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0

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
        )


class Decoder:
    """Runs branch specs to completion over one engine (one shared cache)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        eos_token_ids: frozenset[int],
        *,
        context_length: int | None = None,
        compact_ratio: float = 0.25,
        speculate: Speculate | str = "off",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.context_length = context_length
        self.compact_ratio = compact_ratio
        self.counters = DecodeCounters()
        setting = parse_speculate(speculate)
        self.policy = SpeculationPolicy(setting) if setting.on else None
        self._next_id = 0
        self._roots: list[_Branch] = []

    # -- public --------------------------------------------------------------------------------

    def announce(self, specs: list[BranchSpec]) -> list[BranchInfo]:
        """Create the root branches (checking they fit the context) and describe them for Start."""
        self._roots = [self._new_branch(spec, spec.label, list(spec.prompt_ids), None) for spec in specs]
        return [b.info() for b in self._roots]

    def decode(self, phase: str = "") -> Iterator[Event]:
        """Prefill the announced roots, then decode until every branch (and child) finishes.

        Progress: the prefill reports `Progress("<phase> prefill", tokens fed, tokens to feed)`
        before its first forward and after each one; the decode reports `Progress("<phase>
        decode", branches finished, branches so far, "branches")` after each step.
        """
        yield from self._cap_notes(self._roots)
        started = time.perf_counter()
        yield from self._prefill(self._roots, f"{phase} prefill".lstrip())
        self.counters.prefill_seconds += time.perf_counter() - started
        started = time.perf_counter()
        first_id = self._roots[0].id if self._roots else self._next_id
        active = list(self._roots)
        while active:
            active = yield from self._step(active)
            created = self._next_id - first_id  # roots and the children spawned so far
            yield Progress(f"{phase} decode".lstrip(), created - len(active), created, "branches")
        self.counters.decode_seconds += time.perf_counter() - started

    def stats(self, seconds: float) -> Stats:
        return self.counters.stats(self.engine, seconds)

    # -- branches ------------------------------------------------------------------------------

    def _new_branch(self, spec: BranchSpec, label: str, path_ids: list[int], parent: int | None) -> _Branch:
        if not path_ids:
            raise ContextTooLongError(f"branch '{label}' has an empty prompt", fix="give it some text")
        max_new = self._fit_to_context(label, len(path_ids), spec.max_new_tokens)
        branch_id = self._next_id
        self._next_id += 1
        key = branch_id if spec.seed_key is None else spec.seed_key
        self.counters.prompt_tokens += len(path_ids)
        return _Branch(
            id=branch_id,
            spec=spec,
            label=label,
            path_ids=path_ids,
            sampler=Sampler(spec.sampling, key, self.engine.device),
            detok=StreamingDetokenizer(self.tokenizer, spec.stop),
            max_new_tokens=max_new,
            parent=parent,
        )

    def _fit_to_context(self, label: str, prompt_len: int, max_new: int) -> int:
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

    def _cap_notes(self, branches: list[_Branch]) -> Iterator[Event]:
        for b in branches:
            if b.max_new_tokens < b.spec.max_new_tokens:
                yield Note(
                    kind="capped",
                    message=f"'{b.label}': max new tokens capped at {b.max_new_tokens} by the model's context",
                    data={"branch": b.id, "max_new_tokens": b.max_new_tokens},
                )

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, branches: list[_Branch], phase: str) -> Iterator[Event]:
        before = len(self.engine)
        steps = prefill_steps(self.engine, [b.path_ids for b in branches])
        results = yield from progress_events(phase, steps)
        for branch, result in zip(branches, results):
            branch.row, branch.logits = result.row, result.logits
        self.counters.prefill_tokens += len(self.engine) - before

    # -- one step ------------------------------------------------------------------------------

    def _step(self, active: list[_Branch]) -> Iterator[Event]:
        to_feed: list[tuple[_Branch, list[int]]] = [(b, b.chain) for b in active if b.chain is not None]
        choosing = [b for b in active if b.chain is None]
        for branch, _ in to_feed:
            branch.chain = None
        finished = False
        for branch, token, logprob in zip(choosing, *self._choose(choosing)):
            self.counters.generated_tokens += 1
            branch.logprob += logprob
            text = branch.detok.add(token)
            reason = self._finish_reason(branch, token)
            if reason is None:
                yield Token(branch=branch.id, token_id=token, text=text, logprob=logprob)
                to_feed.append((branch, [token]))
                continue
            finished = True
            yield Token(branch=branch.id, token_id=token, text=text + branch.detok.finish(), logprob=logprob)
            yield self._finish_event(branch, reason)
            for child in self._spawn_children(branch):
                yield Fork(branch=child.info())
                to_feed.append((child, child.path_ids[child.fork_at - 1 :]))

        if finished:
            self._maybe_compact([b for b, _ in to_feed])
        if not to_feed:
            return []
        if self.policy is not None:
            from mdcli.verify import feed_with_drafts

            return (yield from feed_with_drafts(self, to_feed))
        self._feed(to_feed)
        return [b for b, _ in to_feed]

    def _choose(self, branches: list[_Branch]) -> tuple[list[int], list[float]]:
        """Each branch's next token and its logprob (already chosen after a speculative step)."""
        import torch

        tokens = [b.pending[0] if b.pending else -1 for b in branches]
        logprobs = [b.pending[1] if b.pending else 0.0 for b in branches]
        todo = [i for i, b in enumerate(branches) if b.pending is None]
        if todo:
            sub = [branches[i] for i in todo]
            logits = self._suppress_eos(torch.stack([b.logits for b in sub]), sub)  # [k, V]
            chosen = choose_tokens(logits, [b.sampler for b in sub])
            picked = torch.log_softmax(logits, -1)[torch.arange(len(sub)), torch.tensor(chosen)].tolist()
            for i, token, logprob in zip(todo, chosen, picked):
                tokens[i], logprobs[i] = token, logprob
        for b in branches:
            b.pending = None
        return tokens, logprobs

    def _suppress_eos(self, logits: torch.Tensor, active: list[_Branch]) -> torch.Tensor:
        """EOS gets -inf for branches that asked to ignore it, as generate's min_new_tokens does."""
        rows = [i for i, b in enumerate(active) if b.spec.ignore_eos]
        if not rows or not self.eos:
            return logits
        logits = logits.clone()
        logits[torch_index(rows, logits.device)[:, None], torch_index(sorted(self.eos), logits.device)] = float("-inf")
        return logits

    def _finish_reason(self, branch: _Branch, token: int) -> str | None:
        if token in self.eos or branch.detok.stopped_at is not None:
            return "stop"
        if len(branch.detok.token_ids) >= branch.max_new_tokens:
            return "length"
        return None

    def _finish_event(self, branch: _Branch, reason: str) -> Finish:
        return Finish(
            branch=branch.id,
            label=branch.label,
            text=branch.detok.final_text,
            token_ids=list(branch.detok.token_ids),
            finish_reason=reason,  # type: ignore[arg-type]
            cumulative_logprob=branch.logprob,
        )

    def _spawn_children(self, parent: _Branch) -> list[_Branch]:
        """Children continue from the parent's full text: its path, its tokens, their prompt."""
        children = []
        generated = parent.detok.token_ids
        for spec in parent.spec.children:
            continuation = list(spec.prompt_ids)
            if generated and continuation and continuation[0] == generated[-1] and generated[-1] in self.eos:
                continuation = continuation[1:]  # the answer already closed its turn
            path = parent.path_ids + generated + continuation
            child = self._new_branch(spec, f"{parent.label}/{spec.label}", path, parent.id)
            # the parent's last token was never fed: it starts the child's chain
            child.row = parent.row
            child.fork_at = len(parent.path_ids) + len(generated)
            children.append(child)
        return children

    def _feed(self, to_feed: list[tuple[_Branch, list[int]]]) -> None:
        rows = [b.row for b, _ in to_feed]
        chains = [chain for _, chain in to_feed]
        if all(len(c) == 1 for c in chains):
            import torch

            stacked = torch.stack([pad_rows(r[None], len(self.engine))[0] for r in rows])  # [k, N]
            results = self.engine.forward(stacked, chains)
        else:
            results = self.engine.extend(rows, chains)
        self.counters.steps += 1
        for (branch, _), result in zip(to_feed, results):
            branch.row, branch.logits = result.row, result.logits

    def _maybe_compact(self, live: list[_Branch]) -> None:
        """Reclaim cache slots that no live branch attends to, once enough of the cache is dead."""
        import torch

        n = len(self.engine)
        if not live or n == 0:
            return
        rows = torch.stack([pad_rows(b.row[None], n)[0] for b in live])  # [L, N]
        dead = n - int(rows.any(0).sum())
        if dead == 0 or dead < self.compact_ratio * n:
            return
        remapped = self.engine.compact(rows)
        for branch, row in zip(live, remapped):
            branch.row = row


def torch_index(values: list[int], device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


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
    pending = []
    for slot, members in attach.items():
        row = engine.forest.row_of(slot) if slot >= 0 else engine.forest.empty_row()
        by_start: dict[int, list[int]] = {}
        for i in members:
            by_start.setdefault(starts[i], []).append(i)
        for start, group in by_start.items():
            pending.extend((row, sub, start) for sub in _group_by_token(prompts, group, start))
    done, total = 0, sum(_trie_size([prompts[i][starts[i]:] for i in members]) for members in attach.values())
    yield done, total
    while pending:
        edges = [(row, group, start, _common_prefix_end(prompts, group, start)) for row, group, start in pending]
        steps = engine.extend_steps([row for row, _, _, _ in edges], [prompts[g[0]][s:e] for _, g, s, e in edges])
        outs = yield from _running_count(steps, done, total)
        done += sum(end - start for _, _, start, end in edges)
        pending = []
        for (_, group, _, end), out in zip(edges, outs):
            for i in group:
                if len(prompts[i]) == end:
                    results[i] = out
            longer = [i for i in group if len(prompts[i]) > end]
            pending.extend((out.row, sub, end) for sub in _group_by_token(prompts, longer, end))
    return results  # type: ignore[return-value]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


def _trie_size(sequences: list[list[int]]) -> int:
    """Nodes of the token trie of `sequences`: the tokens a radix prefill of them feeds."""
    ordered = sorted(sequences)
    shared = sum(common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(len(s) for s in ordered) - shared


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
