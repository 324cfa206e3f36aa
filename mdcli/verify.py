"""One speculative decode step: every branch's next token plus its drafts, verified in ONE forward.

Each branch feeds a token tree: its next token (node 0, already chosen and shown) and the draft
nodes the policy kept (mdcli/speculate.py), all laid out at their own depths (forest.layout_trees)
beside every other branch's tree. After the forward the branch walks down from node 0: at each
node it chooses its next token exactly as an unspeculated step would (argmax, or a draw from its
own generator over that node's logits), and while that token is one of the node's draft children
it is accepted: shown, checked for a finish, and walked into. The first token that no draft
guessed is kept for the next step (`pending`), so the branch's tokens, logprobs and random draws
are those of the run without drafts. Draft nodes nobody accepted then leave the cache
(`Engine.keep_tail`), so later steps see only accepted paths.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mdcli.events import Event, Fork, Token
from mdcli.forest import pad_rows

if TYPE_CHECKING:
    import torch

    from mdcli.decoding import Decoder, _Branch
    from mdcli.drafting import DraftTree


def feed_with_drafts(decoder: Decoder, to_feed: list[tuple[_Branch, list[int]]]) -> Iterator[Event]:
    """Feed every branch (with drafts where they pay); returns the branches still decoding."""
    policy, engine = decoder.policy, decoder.engine
    fed = sum(len(chain) for _, chain in to_feed)
    trees = [_draft(decoder, branch) if len(chain) == 1 else _empty() for branch, chain in to_feed]
    room = engine.max_forward_tokens - fed
    remaining = [b.max_new_tokens - len(b.detok.token_ids) for b, _ in to_feed]
    trees = policy.plan(trees, room, remaining) if room > 0 else [_empty() for _ in trees]
    if not any(len(t) for t in trees):
        started = time.perf_counter()
        decoder._feed(to_feed)
        if all(len(chain) == 1 for _, chain in to_feed):
            policy.observe_forward(fed, _synced(engine, started))
        return [b for b, _ in to_feed]
    return (yield from _verify(decoder, to_feed, trees))


def _empty() -> DraftTree:
    from mdcli.drafting import DraftTree

    return DraftTree()


def _draft(decoder: Decoder, branch: _Branch) -> DraftTree:
    """The branch's candidate tree, no deeper than the tokens it may still generate."""
    if branch.drafts is None:
        branch.drafts = decoder.policy.state(branch.path_ids)
    generated = branch.detok.token_ids
    room = min(branch.max_new_tokens - len(generated), decoder.policy.setting.most)
    return decoder.policy.draft(branch.drafts, generated, room)


def _verify(decoder: Decoder, to_feed, trees: list[DraftTree]) -> Iterator[Event]:
    import torch

    engine = decoder.engine
    start = len(engine)
    parents = [_fed_parents(len(chain), tree) for (_, chain), tree in zip(to_feed, trees)]
    tokens = [chain + tree.tokens for (_, chain), tree in zip(to_feed, trees)]
    rows = torch.stack([pad_rows(b.row[None], start)[0] for b, _ in to_feed])  # [C, N]
    started = time.perf_counter()
    results = engine.forward_trees(rows, parents, tokens)
    greedy = [_greedy_choices(decoder, b, r.logits) for (b, _), r in zip(to_feed, results)]
    engine_seconds = _synced(engine, started)
    decoder.counters.steps += 1
    decoder.counters.draft_tokens += sum(len(t) for t in trees)
    decoder.policy.observe_forward(sum(map(len, tokens)), engine_seconds)

    live, kept, finished, offset = [], [], False, start
    for (branch, chain), tree, result, argmax in zip(to_feed, trees, results, greedy):
        path, survivors = yield from _walk(decoder, branch, len(chain), tree, result, argmax)
        kept.extend(offset + i for i in path)
        offset += len(chain) + len(tree)
        live.extend(survivors)
        finished |= not any(s is branch for s in survivors)
    keep = torch.tensor(kept, dtype=torch.long, device=engine.device) - start
    engine.keep_tail(start, keep + start)
    for branch in live:
        if branch.row.shape[0] > start:
            branch.row = torch.cat([branch.row[:start], branch.row[start:][keep]])
    if finished:
        decoder._maybe_compact(live)
    return live


def _fed_parents(chain: int, tree: DraftTree) -> list[int]:
    """Parents within the fed tree: the chain's tokens in a line, then the drafts, whose roots
    hang off the chain's last token."""
    return list(range(-1, chain - 1)) + [chain - 1 if p < 0 else chain + p for p in tree.parents]


def _greedy_choices(decoder: Decoder, branch: _Branch, logits: torch.Tensor) -> list[int] | None:
    """[n, V] -> the argmax after every node, in one op (None for sampled branches)."""
    if not branch.sampler.params.greedy:
        return None
    return decoder._suppress_eos(logits, [branch] * logits.shape[0]).argmax(-1).tolist()


def _walk(decoder: Decoder, branch: _Branch, fed: int, tree: DraftTree, result, argmax) -> Iterator[Event]:
    """Accept the branch's guesses while they are its own tokens. Returns (the fed nodes it keeps,
    indices into its tree of fed tokens; the branches that go on: itself and/or its children)."""
    import torch

    children = tree.children()
    node, accepted = -1, []  # node: draft index, -1 is the chain's last token
    while True:
        at = fed + node  # index of `node` among the fed tokens
        logits = decoder._suppress_eos(result.logits[at][None], [branch])[0]  # [V]
        token = argmax[at] if argmax is not None else branch.sampler(logits)
        logprob = float(torch.log_softmax(logits, -1)[token])
        guess = children[node + 1].get(token)
        if guess is None:  # the model's own token: shown at the next step, fed after it
            branch.pending, branch.row, branch.logits = (token, logprob), result.rows[at], logits
            decoder.policy.observe(branch.drafts, tree, accepted)
            return list(range(fed)) + [fed + a for a in accepted], [branch]
        accepted.append(guess)
        decoder.counters.generated_tokens += 1
        decoder.counters.accepted_tokens += 1
        branch.logprob += logprob
        text = branch.detok.add(token)
        reason = decoder._finish_reason(branch, token)
        if reason is None:
            yield Token(branch=branch.id, token_id=token, text=text, logprob=logprob)
            node = guess
            continue
        yield Token(branch=branch.id, token_id=token, text=text + branch.detok.finish(), logprob=logprob)
        yield decoder._finish_event(branch, reason)
        decoder.policy.observe(branch.drafts, tree, accepted)
        branch.row = result.rows[at]  # the finishing token is never fed, as without drafts
        survivors = []
        for child in decoder._spawn_children(branch):
            yield Fork(branch=child.info())
            child.chain = child.path_ids[child.fork_at - 1 :]
            survivors.append(child)
        return list(range(fed)) + [fed + a for a in accepted[:-1]], survivors


def _synced(engine, started: float) -> float:
    """Seconds since `started`, after the device finished its work."""
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - started
