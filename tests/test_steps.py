"""The step loop's contract: whatever a policy does (fork, wait, prune, feed a judge prompt), every
surviving branch gets exactly the tokens its prompt gets alone, and dropped branches leave the cache.

A scripted policy on tiny random models: greedy branches compared with `model.generate` on each
branch's own prompt; k sampled children of one tip compared with each child's prompt sampled alone
with the same seed key; a judge child's logits compared with the plain model on its whole text.
"""

from __future__ import annotations

import pytest
import torch

from mdcli.core.decoding import BranchSpec, Decoder
from mdcli.events import Finish, Fork, Prune, Token
from mdcli.core.run import Run
from mdcli.core.sampling import SamplingParams
from mdcli.core.steps import Policy, StepLoop, Tip
from tests.reference import generate_alone
from tests.test_engine_exactness import alone_logits, engine_for, random_prompts, tiny_model
from tests.tiny_models import tiny_tokenizer

NEW_TOKENS = 10


class Scripted(Policy):
    """Greedy tips; at given steps a tip forks children, waits or is pruned. After every step
    the live rows must cover the whole cache once something was dropped (compact_ratio 0)."""

    def __init__(self, script: dict[tuple[str, int], str], children: dict[str, list[list[int]]]):
        self.script, self.children, self.steps = script, children, 0
        self.reclaimed_checks = 0

    def step(self, loop: StepLoop, tips: list[Tip]):
        self.steps += 1
        self._check_cache_holds_only_live_paths(loop, tips)
        going = []
        for tip in tips:
            action = self.script.get((tip.label, self.steps))
            if action == "wait":
                loop.wait(tip)
            elif action == "prune":
                yield loop.prune(tip, "scripted")
            elif action == "fork":
                for i, continuation in enumerate(self.children[tip.label]):
                    child, fork = loop.fork(tip, f"{tip.label}/{i}", continuation, sampling=SamplingParams(),
                                            max_new_tokens=NEW_TOKENS)
                    yield fork
                    if child.logits is not None:  # nothing to feed: it shares tip's logits, decided now
                        going.append(child)
                going.append(tip)
            else:
                going.append(tip)
        yield from self.advance(loop, going)

    def _check_cache_holds_only_live_paths(self, loop: StepLoop, tips: list[Tip]) -> None:
        if not tips or self.steps < 3:
            return
        n = len(loop.engine)
        rows = torch.stack([torch.nn.functional.pad(t.row, (0, n - t.row.shape[0])) for t in tips])  # [L, N]
        assert int(rows.any(0).sum()) == n, "a dropped branch's slots are still in the cache"
        self.reclaimed_checks += 1


def run_scripted(model, prompts, script, children):
    run = Run(engine_for(model), compact_ratio=0.0)
    policy = Scripted(script, children)
    loop = StepLoop(run, policy, tiny_tokenizer())
    roots = [loop.tip(f"r{i}", p, sampling=SamplingParams(), max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]
    events = list(loop.prefill(roots, "prefill")) + list(loop.run_tips(roots))
    return run, policy, events


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_forked_waiting_and_surviving_branches_get_their_tokens_alone(arch):
    model = tiny_model(arch, "eager")
    prompts = random_prompts(12, [3, 5, 4])
    script = {("r0", 3): "fork", ("r0", 5): "prune", ("r1", 2): "wait", ("r1", 3): "wait", ("r2", 4): "prune",
              ("r0/1", 6): "prune"}
    children = {"r0": [[7, 8, 9], [], [11]]}  # a prompt continuation, none (shares r0's logits), one token
    run, policy, events = run_scripted(model, prompts, script, children)

    prompt_of = {i: p for i, p in enumerate(prompts)}
    prompt_of.update({e.branch.id: e.branch.prompt_token_ids for e in events if isinstance(e, Fork)})
    finished = {e.branch: e for e in events if isinstance(e, Finish)}
    pruned = {e.branch for e in events if isinstance(e, Prune)}
    assert pruned == {0, 2, 4}  # r0 after forking, r2, and the child r0/1 (branch 4: ids 3, 4, 5)
    assert set(finished) == {1, 3, 5}
    for branch, finish in finished.items():
        assert finish.token_ids == generate_alone(model, prompt_of[branch], len(finish.token_ids)), finish.label
        assert len(finish.token_ids) == NEW_TOKENS
        logprobs = [e.logprob for e in events if isinstance(e, Token) and e.branch == branch]
        assert finish.cumulative_logprob == pytest.approx(sum(logprobs))
    assert prompt_of[3] == prompts[0] + [e.token_id for e in events if isinstance(e, Token) and e.branch == 0][:2] + [7, 8, 9]
    assert run.engine.compactions > 0 and policy.reclaimed_checks > 0


def test_k_sampled_children_of_one_tip_are_each_what_their_prompt_samples_alone():
    model = tiny_model("llama", "eager")
    [prompt] = random_prompts(8, [4])
    sampling = SamplingParams(temperature=1.0, seed=5)

    class Fan(Policy):
        def step(self, loop, tips):
            for tip in tips:
                if tip.parent is None:  # the root: k children, each drawing its own first token now
                    kids = []
                    for i in range(4):
                        kid, fork = loop.fork(tip, f"c{i}", sampling=sampling, seed_key=100 + i, max_new_tokens=6)
                        yield fork
                        kids.append(kid)
                    yield loop.prune(tip, "fanned out")
                    tips = kids
            yield from self.advance(loop, tips)

    run = Run(engine_for(model))
    loop = StepLoop(run, Fan(), tiny_tokenizer())
    root = loop.tip("root", prompt, max_new_tokens=6)
    events = list(loop.prefill([root], "p")) + list(loop.run_tips([root]))
    together = {e.label: e.token_ids for e in events if isinstance(e, Finish)}
    assert len({tuple(t) for t in together.values()}) > 1  # the children really differ

    for i in range(4):
        alone = Decoder(engine_for(model), tiny_tokenizer(), frozenset())
        alone.announce([BranchSpec(f"c{i}", prompt, sampling=sampling, max_new_tokens=6, seed_key=100 + i)])
        [finish] = [e for e in alone.decode() if isinstance(e, Finish)]
        assert together[f"c{i}"] == finish.token_ids


def test_a_judge_child_fed_as_one_chain_reads_the_logits_of_its_whole_text():
    model = tiny_model("qwen2", "eager")
    [prompt] = random_prompts(6, [3])
    rating = [21, 22, 23, 24]
    seen = {}

    class Judge(Policy):
        def step(self, loop, tips):
            for tip in tips:
                if tip.label == "judge":
                    seen["logits"], seen["path"] = tip.logits, tip.path_ids
                    yield loop.finish(tip, "stop")
                    continue
                [token], [logprob] = loop.choose([tip])
                event, reason = loop.accept(tip, token, logprob)
                yield event
                if len(tip.tokens) == 3:  # a boundary: judge the candidate, then stop it
                    _, fork = loop.fork(tip, "judge", rating, sampling=SamplingParams(), max_new_tokens=1)
                    yield fork
                    yield loop.finish(tip, "length")
                else:
                    loop.feed(tip, [token])

    loop = StepLoop(Run(engine_for(model)), Judge(), tiny_tokenizer())
    root = loop.tip("cand", prompt, sampling=SamplingParams(), max_new_tokens=8)
    events = list(loop.prefill([root], "p")) + list(loop.run_tips([root]))
    candidate = next(e for e in events if isinstance(e, Finish) and e.label == "cand").token_ids
    assert seen["path"] == prompt + candidate + rating
    assert torch.allclose(seen["logits"], alone_logits(model, prompt + candidate + rating), atol=1e-4)
