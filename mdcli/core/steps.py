"""The step loop: ONE engine forward per step for every live tip, a policy deciding for each tip.

Every strategy decodes through `StepLoop` (independent branches with follow-ups, beam search, an
approximate merge at an explicit depth, step-level search); only its `Policy` differs.

A *tip* (`Tip`, mdcli/core/tip.py) is a branch's growing end: its prompt, the tokens it generated,
its ancestor row, its next-token logits, its cumulative logprob, its sampler and detokenizer, and a
free slot for the policy (`data`).

One step:

1. The loop hands the policy every live tip that has logits: `yield from policy.step(loop, tips)`.
2. For every tip it is given, the policy calls exactly ONE of these verbs (a tip it does not
   mention is dropped without an event):

   * `loop.feed(tip, tokens)`: feed tokens the tip generated (normally the one token just
     accepted) in this step's forward; the tip gets new logits.
   * `loop.wait(tip)`: feed nothing; the tip keeps its row and logits and is offered again next
     step (e.g. it reached a boundary and waits for its siblings).
   * `loop.finish(tip, reason)`: the branch ends ("stop" | "length"); returns its Finish event.
   * `loop.prune(tip, reason)`: the branch is dropped; returns its Prune event.

   Finished and pruned tips leave the cache's live set: their slots become dead unless a child
   still hangs off them, and the loop compacts them away once `compact_ratio` of the cache is dead.
   Helpers the policy may call on the way:

   * `loop.choose(tips)` -> (tokens, logprobs): each tip's next token by its own sampler (greedy
     argmax, or a draw from its own generator), batched; `ignore_eos` tips never get EOS.
   * `loop.accept(tip, token, logprob)` -> (Token event, finish reason or None): the one
     token-accept path (counters, cumulative logprob, detokenizer, EOS / stop string / length).
     Speculation's verify walk accepts through it too, so no strategy repeats it.
   * `loop.fork(parent, label, continuation, ...)` -> (child, Fork event): a new branch whose
     path is the parent's prompt + the parent's tokens + `continuation` (a prompt continuation,
     e.g. a rating question), with its own sampling / seed key / budget / stop strings. Fork a
     tip several times for several children. If the child has tokens to feed (the parent's
     token(s) not yet in the cache and/or the continuation) the loop feeds them as one chain in
     this step's forward and the child is offered to the policy next step with its own logits.
     Otherwise (a live parent, nothing to add) the child shares the parent's row and logits and
     the policy must decide for it NOW, like any tip: e.g. `loop.choose([child])`, `accept`,
     `feed`. Each child's first draw comes from its own generator, so k sampled children of one
     tip are k independent samples.

3. The loop compacts (when a tip ended this step), runs ONE forward for every chain fed (with
   speculative drafts when the run speculates and the policy allows it), sets each fed tip's row,
   logits and cached length, and yields `policy.progress(loop)` (if not None).

Writing a policy: subclass `Policy` and implement `step` (and `ended`, `progress` if wanted).
`Policy.advance(loop, tips)` is the plain step for the tips it is given: each one's own next
token (`choose`), accepted (`accept`), fed (`feed`), or, when it finishes the branch, handed to
`self.ended` (default: `finish`). A policy that does something special for a few tips decides
those and passes the rest to `advance`:

    class PruneAfterTen(Policy):
        def step(self, loop, tips):
            long = [t for t in tips if len(t.tokens) >= 10]
            for tip in long:
                yield loop.prune(tip, "long enough")
            yield from self.advance(loop, [t for t in tips if len(t.tokens) < 10])

Step-level search (explore) on these verbs:

* k candidates: `loop.fork(tip, f"cand {i}", sampling=SamplingParams(temperature=..., seed=seed),
  seed_key=i)` k times; each child's generator is seeded from (seed, i). The tip's tokens are all
  fed, so each child shares its logits and is decided at once: `yield from self.advance(loop,
  children)` draws every child's own first token.
* a boundary per tip: after `accept`, test `tip.detok.text` (a sentence or line end) or
  `len(tip.tokens)` (every N tokens). Still `feed` the boundary token (the tip's logits then
  follow its whole text), remember the tip is there, and `loop.wait(tip)` on the following steps
  until every sibling is there too.
* scores: `tip.logprob / len(tip.tokens)` is the mean token logprob of a candidate (a child's
  tokens start at its fork). A judge: `loop.fork(cand, "judge", continuation=rating_ids,
  sampling=SamplingParams(), max_new_tokens=1)` feeds the rating prompt as one chain this step;
  next step `judge.logits` ([V]) gives the YES/NO logits, then `loop.prune(judge, ...)`.
* choosing: `loop.prune(loser, f"score {s:.3f}")` for the losers (their slots are reclaimed by
  compaction), fork the next round's candidates from the winner, then prune or finish the winner
  itself (its cached tokens stay: the children hang off them).

Explicit depth (an approximate merge): `loop.start_at(tip, row, chain, depth)` feeds `chain`
hanging off any row at position `depth`; the tip then keeps its own depth counter (`tip.depth`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from mdcli.core.constraint import ConstraintState, TokenConstraint
from mdcli.core.detok import StreamingDetokenizer
from mdcli.core.forest import stack_rows
from mdcli.core.run import Run
from mdcli.core.sampling import Sampler, SamplingParams, choose_next, suppress
from mdcli.core.tip import Tip
from mdcli.core.verify import feed_with_drafts, time_step
from mdcli.events import BranchInfo, Event, Finish, Fork, Note, Progress, Prune, Token

__all__ = ["Policy", "StepLoop", "Tip"]


class Policy:
    """What a strategy decides each step (see the module docstring). `speculative`: the loop may
    verify drafted tokens for this policy's tips: only for a policy whose `step` is `advance`
    for every tip, which the verify walk reproduces token by token."""

    speculative = False

    def step(self, loop: StepLoop, tips: list[Tip]) -> Iterator[Event]:
        raise NotImplementedError

    def advance(self, loop: StepLoop, tips: list[Tip]) -> Iterator[Event]:
        """The plain step for `tips`: each one's own next token, accepted and fed, or, when it
        ends the branch, `self.ended`. Speculation's verify walk reproduces exactly this."""
        if not tips:
            return
        feed = loop._fed.append  # loop.feed, without a call per token
        for tip, token, logprob in zip(tips, *loop.choose(tips)):
            event, reason = loop.accept(tip, token, logprob)
            yield event
            if reason is None:
                feed((tip, [token]))
            else:
                yield from self.ended(loop, tip, reason)

    def ended(self, loop: StepLoop, tip: Tip, reason: str) -> Iterator[Event]:
        """A tip's accepted token finished it: by default its Finish event."""
        yield loop.finish(tip, reason)

    def progress(self, loop: StepLoop) -> Progress | None:
        return None


class StepLoop:
    """Decodes tips over a Run: one forward per step, a policy deciding (module docstring)."""

    def __init__(
        self, run: Run, policy: Policy, tokenizer=None, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.run = run
        self.engine = run.engine
        self.counters = run.counters
        self.policy = policy
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.speculation = run.speculation if policy.speculative else None
        self.live: list[Tip] = []  # tips decoding (after `run`: those still going)
        self._fed: list[tuple[Tip, list[int]]] = []
        self._waiting: list[Tip] = []
        self._ended = False
        self._walking = False  # True while the verify walk runs after the forward
        self.deferred: list[Tip] = []  # children forked during the walk, fed next step
        self.explicit_depths = False  # a tip was started at an explicit depth (start_at)
        self.notes: list[Note] = []  # said after the step: constrained branches that ended incomplete

    # -- tips ----------------------------------------------------------------------------------

    def tip(
        self,
        label: str,
        path_ids: list[int],
        *,
        sampling: SamplingParams | None = None,
        seed_key: int | None = None,
        max_new_tokens: int = 256,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        parent: int | None = None,
        data: object = None,
        fit: bool = True,
        counted: bool = True,
        constraint: TokenConstraint | None = None,
    ) -> Tip:
        """A new tip (not in the cache yet). `fit`: cap its budget by the context (raising
        ContextTooLongError when its prompt fills it); `counted`: add its path to prompt_tokens;
        `constraint`: its output decodes under it, from its start (mdcli/core/constraint.py)."""
        max_new = self.run.fit(label, len(path_ids), max_new_tokens) if fit else max_new_tokens
        branch = self.run.new_id()
        detok = StreamingDetokenizer(self.tokenizer, stop) if self.tokenizer is not None else None
        sampler = None
        if sampling is not None:
            sampler = Sampler(sampling, branch if seed_key is None else seed_key, self.engine.device)
        if counted:
            self.counters.prompt_tokens += len(path_ids)
        return Tip(
            id=branch,
            label=label,
            path_ids=path_ids,
            tokens=detok.token_ids if detok is not None else [],
            max_new_tokens=max_new,
            sampler=sampler,
            detok=detok,
            asked_new_tokens=max_new_tokens,
            parent=parent,
            ignore_eos=ignore_eos,
            data=data,
            constraint=None if constraint is None else constraint.start(),
            constraint_label=None if constraint is None else constraint.description,
        )

    def prefill(self, tips: list[Tip], phase: str, apart: bool = False) -> Iterator[Event]:
        """Feed the tips' prompts as one radix tree (sharing what the cache holds; `apart`: nothing,
        laid down in a cache of their own and appended, Run.prefill_apart)."""
        prompts = [t.path_ids for t in tips]
        results = yield from (self.run.prefill_apart(prompts, phase) if apart else self.run.prefill(prompts, phase))
        for tip, result in zip(tips, results):
            tip.row, tip.logits, tip.cached = result.row, result.logits, len(tip.path_ids)

    def start_at(self, tip: Tip, row: torch.Tensor, chain: list[int], depth: int) -> None:
        """Feed `chain` hanging off `row` with its first token at position `depth` (a deliberate
        approximation: the position is no longer the number of tokens attended to); the tip
        keeps counting its own depth from there. Counted as prefill."""
        start = self.engine.forward(row[None], [chain], start_depths=torch.tensor([depth]))[0]
        self.explicit_depths = True
        self.counters.prefill_tokens += len(chain)
        tip.row, tip.logits, tip.depth, tip.cached = start.row, start.logits, depth + len(chain), len(tip.path_ids)

    def capped_notes(self, tips: list[Tip]) -> Iterator[Event]:
        for tip in tips:
            note = self.run.capped_note(tip.label, tip.id, tip.max_new_tokens, tip.asked_new_tokens)
            if note is not None:
                yield note

    def run_tips(self, tips: list[Tip], admit: Callable[[StepLoop], Iterator[Event]] | None = None) -> Iterator[Event]:
        """Step the given tips (and every tip forked from them) until none is live. `admit`, when
        given, runs before every step (the first too) and may lay new tips down mid-run (`join`):
        --each admits the next document as others finish; the loop ends when nothing is live after it."""
        started = time.perf_counter()
        self.live = list(tips)
        while True:
            if admit is not None:
                yield from admit(self)
            if not self.live:
                break
            yield from self._step() if self.speculation is None else time_step(self, self._step())
            if self.notes:
                yield from self.notes
                self.notes = []
            progress = self.policy.progress(self)
            if progress is not None:
                yield progress
        self.counters.decode_seconds += time.perf_counter() - started

    def join(self, tips: list[Tip]) -> None:
        """Tips laid down between steps (prefilled: each has its row and logits) decode from the
        next step on, beside the live ones (an `admit` hook's; see run_tips)."""
        self.live.extend(tips)

    # -- the verbs -----------------------------------------------------------------------------

    def choose(self, tips: Sequence[Tip]) -> tuple[list[int], list[float]]:
        """Each tip's next token by its own sampler, and its logprob (batched; a token already
        chosen after a speculative step is taken as it is)."""
        tokens = [t.pending[0] if t.pending else -1 for t in tips]
        logprobs = [t.pending[1] if t.pending else 0.0 for t in tips]
        todo = [i for i, t in enumerate(tips) if t.pending is None]
        if todo:
            sub = [tips[i] for i in todo]
            chosen, picked = choose_next(torch.stack([t.logits for t in sub]), [t.sampler for t in sub],  # [k, V], a copy
                                         ignore_eos=[t.ignore_eos for t in sub], eos=self.eos,
                                         constraints=[t.constraint for t in sub])
            for i, token, logprob in zip(todo, chosen, picked):
                tokens[i], logprobs[i] = token, logprob
        for t in tips:
            t.pending = None
        return tokens, logprobs

    def suppress_eos(self, logits: torch.Tensor, tips: Sequence[Tip], in_place: bool = False) -> torch.Tensor:
        """[k, V] -> EOS at -inf for tips that ignore it, as generate's min_new_tokens does
        (in a copy, unless `in_place`)."""
        rows = [i for i, t in enumerate(tips) if t.ignore_eos]
        if not rows or not self.eos:
            return logits
        return suppress(logits if in_place else logits.clone(), rows, self.eos)

    def accept(self, tip: Tip, token: int, logprob: float) -> tuple[Token, str | None]:
        """The tip generated `token`: count it, detokenize it, and say whether it ends the branch
        (EOS or a stop string: "stop"; its budget: "length"). Feeding it is the caller's call."""
        self.counters.generated_tokens += 1
        tip.logprob += logprob
        detok = tip.detok
        text = detok.add(token)
        constraint = tip.constraint
        if constraint is not None and token not in self.eos:
            constraint.advance(token)
        if token in self.eos or detok.stopped_at is not None:
            reason = "stop"
        elif constraint is not None and constraint.is_stopped():
            reason = "stop"  # the answer is complete: nothing but EOS could follow
        elif len(detok.token_ids) >= tip.max_new_tokens:
            reason = "length"
        else:
            return Token(branch=tip.id, token_id=token, text=text, logprob=logprob), None
        return Token(branch=tip.id, token_id=token, text=text + detok.finish(), logprob=logprob), reason

    def feed(self, tip: Tip, tokens: list[int]) -> None:
        self._fed.append((tip, tokens))

    def wait(self, tip: Tip) -> None:
        self._waiting.append(tip)

    def finish(self, tip: Tip, reason: str, *, score: float | None = None) -> Finish:
        """The branch's Finish event. Under a constraint it carries the answer as the constraint
        reads it (`parsed`) when complete; an incomplete one is said in a note after the step."""
        self._ended = True
        text = tip.detok.final_text if tip.detok is not None else ""
        parsed = None
        if tip.constraint is not None:
            cut = tip.detok is not None and tip.detok.stopped_at is not None  # a stop string cut the answer
            parsed = tip.constraint.parse(text) if tip.constraint.is_accepting() and not cut else None
            if parsed is None:
                self.notes.append(_incomplete(tip, reason))
        return Finish(
            branch=tip.id,
            label=tip.label,
            text=text,
            token_ids=list(tip.tokens),
            finish_reason=reason,  # type: ignore[arg-type]
            cumulative_logprob=tip.logprob,
            score=score,
            parsed=parsed,
        )

    def prune(self, tip: Tip, reason: str) -> Prune:
        self._ended = True
        return Prune(branch=tip.id, label=tip.label, reason=reason)

    def ended(self, tip: Tip, reason: str) -> Iterator[Event]:
        """A token accepted outside the policy's `step` (by the verify walk) ended `tip`: the
        policy's `ended` decides what follows."""
        return self.policy.ended(self, tip, reason)

    def fork(
        self,
        parent: Tip,
        label: str,
        continuation: Sequence[int] = (),
        *,
        sampling: SamplingParams | None = None,
        seed_key: int | None = None,
        max_new_tokens: int = 256,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        data: object = None,
        prompt_ids: list[int] | None = None,
        counted: bool = True,
        constraint: TokenConstraint | None = None,
        continues: ConstraintState | None = None,
    ) -> tuple[Tip, Fork]:
        """A child of `parent` (module docstring). `prompt_ids`: what the Fork event shows as
        the child's prompt, by default its whole path; `counted`: add the path to prompt_tokens;
        `constraint`: the child's own answer decodes under it, from its start; `continues`: the
        child goes on with this constraint state instead (a copy is taken), e.g. a candidate
        continuing its parent's constrained answer."""
        path = parent.path_ids + parent.tokens + list(continuation)
        child = self.tip(
            label, path, sampling=sampling, seed_key=seed_key, max_new_tokens=max_new_tokens, stop=stop,
            ignore_eos=ignore_eos, parent=parent.id, data=data, counted=counted, constraint=constraint,
        )
        if continues is not None:
            child.constraint, child.constraint_label = continues.copy(), parent.constraint_label
        child.row, child.cached, child.depth, child.exact = parent.row, parent.cached, parent.depth, parent.exact
        chain = path[parent.cached :]
        if not chain:
            child.logits = parent.logits
        elif self._walking:
            child.chain = chain  # this step's forward already ran: fed first thing next step
            self.deferred.append(child)
        else:
            self._fed.append((child, chain))
        info = child.info() if prompt_ids is None else BranchInfo(
            id=child.id, label=label, prompt_token_ids=prompt_ids, parent=parent.id, exact=child.exact,
            constraint=child.constraint_label,
        )
        return child, Fork(branch=info)

    # -- one step ------------------------------------------------------------------------------

    def _step(self) -> Iterator[Event]:
        deciding = self.live
        fed: list[tuple[Tip, list[int]]] = []
        if self.deferred:  # children forked after the last forward (a verify walk): their chains go first
            fed = [(tip, tip.chain) for tip in self.deferred]
            deciding = [tip for tip in self.live if tip.chain is None]
            for tip in self.deferred:
                tip.chain = None
            self.deferred = []
        self._fed, self._waiting, self._ended = fed, [], False
        yield from self.policy.step(self, deciding)
        if self._ended:
            self.compact([t for t, _ in fed] + self._waiting)
        if not fed:
            self.live = self._waiting
            return
        if self.speculation is not None:
            self._walking, self.deferred = True, []
            try:
                going = yield from feed_with_drafts(self, fed)
            finally:
                self._walking = False
            self.live = going + self.deferred + self._waiting
            return
        self.forward(fed)
        self.live = [t for t, _ in fed] + self._waiting

    def forward(self, fed: list[tuple[Tip, list[int]]]) -> None:
        """ONE forward for every chain (several, when chains exceed the engine's forward budget)."""
        rows = [t.row for t, _ in fed]
        chains = [chain for _, chain in fed]
        if self.explicit_depths:
            n = len(self.engine)
            stacked = stack_rows(rows, n)  # [k, N]
            depths = torch.tensor([t.depth if t.depth is not None else int(r.sum()) for (t, _), r in zip(fed, stacked)])
            results = self.engine.forward(stacked, chains, start_depths=depths)
            for (tip, chain), result in zip(fed, results):
                if tip.depth is not None:
                    tip.depth += len(chain)
        elif all(len(c) == 1 for c in chains):  # a decode step: one token per tip
            n = len(self.engine)
            stacked = stack_rows(rows, n)  # [k, N]
            results = self.engine.forward(stacked, chains)
            self.counters.steps += 1
            for (tip, _), result in zip(fed, results):
                tip.row, tip.logits = result.row, result.logits
                tip.cached += 1
            return
        else:
            results = self.engine.extend(rows, chains)
        self.counters.steps += 1
        for (tip, chain), result in zip(fed, results):
            tip.row, tip.logits = result.row, result.logits
            tip.cached += len(chain)

    def compact(self, live: list[Tip]) -> None:
        """Reclaim the slots no live tip reaches (their rows: the places the next tokens hang off)."""
        remapped = self.run.maybe_compact([t.row for t in live])
        if remapped is not None:
            for tip, row in zip(live, remapped):
                tip.row = row


def _incomplete(tip: Tip, reason: str) -> Note:
    """The one-line note for a constrained branch that ended before its answer was complete."""
    why = f"its {len(tip.tokens)}-token budget (-n) ran out" if reason == "length" else f"it ended ({reason})"
    return Note(
        "constraint",
        f"{tip.label}: {why} before the answer satisfied its constraint ({tip.constraint_label}); "
        "the text is incomplete, not a valid answer",
        {"branch": tip.id, "finish_reason": reason},
    )
