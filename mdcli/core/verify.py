"""One speculative decode step: every branch's next token plus its drafts, verified in ONE forward.

Each branch feeds a token tree: its next token (node 0, already chosen and shown) and the draft
nodes the policy kept (mdcli/speculative/planner.py), all laid out at their own depths (forest.layout_trees)
beside every other branch's tree. After the forward the branch walks down from node 0: at each
node it chooses its next token exactly as an unspeculated step would (argmax, or a draw from its
own generator over that node's logits), and while that token is one of the node's draft children
it is accepted: shown, checked for a finish, and walked into. The first token that no draft
guessed is kept for the next step (`pending`), so the branch's tokens, logprobs and random draws
are those of the run without drafts. Draft nodes nobody accepted then leave the cache
(`Engine.keep_tail`), so later steps see only accepted paths. A tip under an output constraint
(mdcli/core/constraint.py) drafts nothing and chooses nothing in the walk: it takes its new logits,
and the next step's `choose` masks them, exactly as without speculation.

A run's `Speculate.watch`, when set, is shown each verified step as a `VerifiedStep`
(mdcli/speculative/planner.py): what every branch fed, the mask rows the engine gave those tokens
and what was accepted (`mdcli explain --speculate` draws one).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mdcli.core.engine import Engine
from mdcli.core.forest import stack_rows
from mdcli.core.run import DecodeCounters
from mdcli.core.sampling import choose_next, greedy_tokens, logprobs_of
from mdcli.core.tip import Tip
from mdcli.events import Event, Token
from mdcli.speculative.drafting import DraftTree
from mdcli.speculative.planner import SpeculationPolicy, VerifiedBranch, VerifiedStep


class Loop(Protocol):
    """What the verify walk needs of the step loop whose step it finishes (mdcli/core/steps.py):
    the engine and the run's counters, the speculation policy, the plain forward, the one accept
    path, the policy's `ended` for a tip a token finished, compaction, and the children forked
    during the walk (`deferred`, fed next step)."""

    engine: Engine
    counters: DecodeCounters
    speculation: SpeculationPolicy  # set: the walk runs only in a loop that speculates
    deferred: list[Tip]
    eos: frozenset[int]  # the model's end tokens, suppressed for tips that ignore them

    def forward(self, fed: list[tuple[Tip, list[int]]]) -> None: ...

    def accept(self, tip: Tip, token: int, logprob: float) -> tuple[Token, str | None]: ...

    def ended(self, tip: Tip, reason: str) -> Iterator[Event]: ...

    def suppress_eos(self, logits: torch.Tensor, tips: Sequence[Tip], in_place: bool = False) -> torch.Tensor: ...

    def compact(self, live: list[Tip]) -> None: ...


def feed_with_drafts(loop: Loop, to_feed: list[tuple[Tip, list[int]]]) -> Iterator[Event]:
    """Feed every tip (with drafts where they pay); returns the tips still decoding (children
    forked by a finishing tip wait in `loop.deferred`, to be fed next step)."""
    policy, engine = loop.speculation, loop.engine
    fed = sum(len(chain) for _, chain in to_feed)
    # a constrained tip drafts nothing: its tokens are chosen under its mask at the next step
    trees = [_draft(loop, tip) if len(chain) == 1 and tip.constraint is None else DraftTree() for tip, chain in to_feed]
    room = engine.max_forward_tokens - fed
    remaining = [t.max_new_tokens - len(t.tokens) for t, _ in to_feed]
    trees = policy.plan(trees, room, remaining) if room > 0 else [DraftTree() for _ in trees]
    guesses = sum(len(t) for t in trees)
    if not guesses:
        loop.forward(to_feed)
        # a plain decode step is timed (by the step loop, `time_step`); one that feeds a fork's
        # chain of several tokens is not
        policy.timing = (fed, 0) if all(len(chain) == 1 for _, chain in to_feed) else None
        return [t for t, _ in to_feed]
    policy.timing = (fed, guesses)
    return (yield from _verify(loop, to_feed, trees))


def time_step(loop: Loop, step: Generator[Event, None, None]) -> Generator[Event, None, None]:
    """Run one step of a speculating loop and tell its policy what the step cost in all: choosing
    its tokens, drafting, the forward and, when it verified guesses, the walk and the rollback (a
    step that saves forwards must pay for all of that, and a plain step's choosing is a good part
    of it), not counting the time the events' consumers take (they take it for every token either
    way) (measured: notebook/speculation.md, "auto keeps learning through the run")."""
    policy = loop.speculation
    policy.timing = None
    started, consumers = time.perf_counter(), [0.0]
    yield from _without_consumers(step, consumers)
    if policy.timing is not None:
        fed, guesses = policy.timing
        seconds = _synced(loop.engine, started) - consumers[0]
        if guesses:
            policy.observe_verified(fed, guesses, seconds)
        else:
            policy.observe_plain(fed, seconds)


def _without_consumers(events: Generator[Event, None, list], consumers: list[float]):
    """Pass `events` on and return what they return, adding the time spent in the consumer
    (between handing an event on and being resumed) to consumers[0]. Closed early (the consumer
    stopped, e.g. on Ctrl-C), it closes `events` at once, as `yield from` would."""
    try:
        event = next(events)
        while True:
            handed = time.perf_counter()
            yield event
            consumers[0] += time.perf_counter() - handed
            event = next(events)
    except StopIteration as stop:
        return stop.value
    finally:
        events.close()


def _draft(loop: Loop, tip: Tip) -> DraftTree:
    """The tip's candidate tree, no deeper than the tokens it may still generate."""
    if tip.drafts is None:
        tip.drafts = loop.speculation.state(tip.path_ids)
    generated = tip.tokens
    room = min(tip.max_new_tokens - len(generated), loop.speculation.setting.most)
    return loop.speculation.draft(tip.drafts, generated, room)


def _verify(loop: Loop, to_feed, trees: list[DraftTree]) -> Iterator[Event]:
    engine = loop.engine
    start = len(engine)
    parents = [_fed_parents(len(chain), tree) for (_, chain), tree in zip(to_feed, trees)]
    tokens = [chain + tree.tokens for (_, chain), tree in zip(to_feed, trees)]
    rows = stack_rows([t.row for t, _ in to_feed], start)  # [C, N]
    results = engine.forward_trees(rows, parents, tokens)
    greedy = _greedy_choices(loop, to_feed, trees, results)
    loop.counters.steps += 1
    loop.counters.draft_tokens += sum(len(t) for t in trees)

    watch = loop.speculation.setting.watch
    live, kept, finished, offset, seen, counts = [], [], False, start, [], []
    for (tip, chain), tree, fed, result, argmax in zip(to_feed, trees, tokens, results, greedy):
        path, accepted, going = yield from _walk(loop, tip, len(chain), tree, result, argmax)
        counts.append(len(accepted))
        if watch is not None:
            seen.append(_seen(engine, tip, start, offset, len(chain), fed, result.rows, accepted, going))
        kept.extend(offset + i for i in path)
        offset += len(chain) + len(tree)
        if going:
            live.append(tip)
        finished |= not going
    loop.speculation.settle(counts)
    if watch is not None:
        watch(VerifiedStep(step=loop.counters.steps, cache_slots=start, branches=seen))
    keep = torch.tensor(kept, dtype=torch.long, device=engine.device) - start
    engine.keep_tail(start, keep + start)
    for tip in live + loop.deferred:
        if tip.row.shape[0] > start:
            tip.row = torch.cat([tip.row[:start], tip.row[start:][keep]])
    if finished:
        loop.compact(live + loop.deferred)
    return live


def _seen(engine, tip: Tip, start: int, offset: int, chain: int, tokens: list[int], rows, accepted, going: bool):
    """What `watch` is shown of one branch. rows: [n, N] the mask rows the engine gave its fed
    tokens (slots offset.. offset + n; the step's first fed slot is `start`); accepted: its draft
    nodes accepted, as indices into its tree."""
    return VerifiedBranch(
        label=tip.label,
        tokens=list(tokens),
        depths=engine.forest.depth[offset : offset + len(tokens)].tolist(),
        drafts_from=chain,
        sees=[row.nonzero().flatten().tolist() for row in rows[:, start:]],
        path_slots=int(rows[0, :start].sum()),
        accepted=[chain + a for a in accepted],
        next_token=tip.pending[0] if going else None,
    )


def _fed_parents(chain: int, tree: DraftTree) -> list[int]:
    """Parents within the fed tree: the chain's tokens in a line, then the drafts, whose roots
    hang off the chain's last token."""
    return list(range(-1, chain - 1)) + [chain - 1 if p < 0 else chain + p for p in tree.parents]


@dataclass
class _Greedy:
    """A greedy tip's choices in a verified step, by index among its fed tokens."""

    tokens: list[int]  # the argmax after each fed token
    logprobs: dict[int, float]  # its logprob, after the fed tokens the walk visits
    logits: torch.Tensor  # [n, V] with EOS suppressed where the tip ignores it


def _greedy_choices(loop: Loop, to_feed, trees: list[DraftTree], results) -> list[_Greedy | None]:
    """Every greedy tip's choices (None for sampled tips), in a few ops over the whole step and two
    reads from the device, not a few per node (on a GPU each read waits for the device): the
    argmax after every fed token, then the logprobs where each walk will go (the chain's last
    token, then every guess the argmax confirms; a finish may stop it sooner)."""
    greedy = [i for i, (tip, _) in enumerate(to_feed) if tip.sampler.params.greedy and tip.constraint is None]
    if not greedy:
        return [None] * len(to_feed)
    sizes = [results[i].logits.shape[0] for i in greedy]
    row_tips = [to_feed[i][0] for i, n in zip(greedy, sizes) for _ in range(n)]
    logits = torch.cat([results[i].logits for i in greedy])  # [n, V], a copy: suppressed in place
    logits = loop.suppress_eos(logits, row_tips, in_place=True)
    argmax = greedy_tokens(logits)
    visits: list[int] = []  # rows of `logits` the walks visit
    starts = [0]
    for i, n in zip(greedy, sizes):
        kids, node, offset = trees[i].children(), -1, starts[-1]
        chain = len(to_feed[i][1])
        while node is not None:
            visits.append(offset + chain + node)
            node = kids[node + 1].get(argmax[visits[-1]])
        starts.append(offset + n)
    logprob_at = dict(zip(visits, logprobs_of(logits[visits], [argmax[v] for v in visits])))
    choices: list[_Greedy | None] = [None] * len(to_feed)
    for i, start, end in zip(greedy, starts, starts[1:]):
        own = {v - start: logprob_at[v] for v in range(start, end) if v in logprob_at}
        choices[i] = _Greedy(argmax[start:end], own, logits[start:end])
    return choices


def _walk(loop: Loop, tip: Tip, fed: int, tree: DraftTree, result, greedy: _Greedy | None) -> Iterator[Event]:
    """Accept the tip's guesses while they are its own tokens, through the loop's one accept
    path. Returns (the fed nodes it keeps, indices into its tree of fed tokens; the draft nodes it
    accepted; whether the tip goes on: a finished tip's children are forked by the policy into
    the next step)."""
    if tip.constraint is not None:  # no drafts: it only takes its new logits; `choose` masks them next step
        at = fed - 1
        tip.row, tip.logits = result.rows[at], result.logits[at]
        tip.cached += fed
        return list(range(fed)), [], True
    children = tree.children()
    node, accepted = -1, []  # node: draft index, -1 is the chain's last token
    while True:
        at = fed + node  # index of `node` among the fed tokens
        if greedy is not None:
            token, logprob, logits = greedy.tokens[at], greedy.logprobs[at], greedy.logits[at]
        else:
            logits = result.logits[at][None].clone()  # [1, V]: EOS suppressed in it where the tip ignores it
            [token], [logprob] = choose_next(logits, [tip.sampler], ignore_eos=[tip.ignore_eos], eos=loop.eos)
            logits = logits[0]
        guess = children[node + 1].get(token)
        if guess is None:  # the model's own token: shown at the next step, fed after it
            tip.pending, tip.row, tip.logits = (token, logprob), result.rows[at], logits
            tip.cached += fed + len(accepted)
            loop.speculation.observe(tip.drafts, tree, accepted)
            return list(range(fed)) + [fed + a for a in accepted], accepted, True
        accepted.append(guess)
        loop.counters.accepted_tokens += 1
        event, reason = loop.accept(tip, token, logprob)
        yield event
        if reason is None:
            node = guess
            continue
        loop.speculation.observe(tip.drafts, tree, accepted)
        tip.row = result.rows[at]  # the finishing token is never fed, as without drafts
        tip.cached += fed + len(accepted) - 1
        yield from loop.ended(tip, reason)
        return list(range(fed)) + [fed + a for a in accepted[:-1]], accepted, False


def _synced(engine, started: float) -> float:
    """Seconds since `started`, after the device finished its work."""
    if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    return time.perf_counter() - started
