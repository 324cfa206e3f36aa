"""explore is step-level search over the step loop, and exact:

* every candidate's tokens are what sampling its prompt (the prompt + the steps chosen so far)
  alone gives with candidate i's generator, seeded once from (seed, i) and continuing round to
  round (greedy: what `model.generate` gives);
* with --k 1 the answer is plain decoding (greedy: `generate`; sampled: ask-many's one branch);
* losing candidates leave the cache; judges are branches of the same forest;
* JSONL: candidates are forks, each ending in a prune with its score; the answer is the final finish.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from mdcli.api import explore, run_specs
from mdcli.backends.reference import cache_argument
from mdcli.core.cache import output_cache
from mdcli.cli.app import app
from mdcli.core.decoding import BranchSpec
from mdcli.events import Done, Finish, Fork, Prune, Token
from mdcli.models.load import load_model
from mdcli.core.sampling import Sampler, SamplingParams
from mdcli.strategies.explore import RATING_QUESTION, ends_step
from tests.reference import generate_alone

PROMPT = "Write three short sentences about a lighthouse keeper."
SCORED = re.compile(r"^(kept|outscored|ended): score [-+]\d+\.\d{4} \(rank (\d+) of (\d+)\)$")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir("llama")), quiet=True)


def candidates(events):
    """Each candidate fork with its lane (0-based candidate index) and streamed tokens, in order."""
    tokens: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, Token):
            tokens.setdefault(e.branch, []).append(e.token_id)
    out = []
    for e in events:
        if isinstance(e, Fork) and e.branch.label.startswith("step "):
            lane = int(e.branch.label.rsplit("#", 1)[1]) - 1
            out.append((e.branch, lane, tokens.get(e.branch.id, [])))
    return out


def answer(events) -> Finish:
    finish = [e for e in events if isinstance(e, Finish)]
    assert len(finish) == 1 and isinstance(events[-1], Done) and events[-2] is finish[0]
    return finish[0]


def sample_alone(model, prompt_ids: list[int], count: int, sampler: Sampler) -> list[int]:
    """The prompt run alone through the plain model (its own KV cache), `count` tokens drawn by
    `sampler` (whose generator carries on from earlier calls)."""
    out, past, ids = [], None, torch.tensor([prompt_ids])
    with torch.inference_mode():
        for _ in range(count):
            result = model(ids, **cache_argument(model, past), use_cache=True)
            past = output_cache(result)
            out.append(sampler(result.logits[0, -1].float()))
            ids = torch.tensor([[out[-1]]])
    return out


# -- exactness ------------------------------------------------------------------------------------


def test_with_k_1_and_greedy_the_answer_is_what_generate_writes(embedded):
    events = list(explore(embedded, PROMPT, k=1, sampling=SamplingParams(), max_new_tokens=40))
    start, final = events[0], answer(events)
    assert len(candidates(events)) >= 2, "the answer should span several steps (sentences)"
    prompt = start.branches[0].prompt_token_ids
    assert final.branch == start.branches[0].id
    assert final.token_ids == generate_alone(embedded.model, prompt, len(final.token_ids))


def test_with_k_1_and_sampling_the_answer_is_ask_many_sampling_with_seed_key_0(embedded):
    sampling = SamplingParams(temperature=0.8, seed=5)
    events = list(explore(embedded, PROMPT, k=1, sampling=sampling, max_new_tokens=30, chunk_tokens=7))
    prompt = events[0].branches[0].prompt_token_ids
    plain = run_specs(embedded, [BranchSpec("alone", prompt, sampling, 30, seed_key=0)], strategy="test")
    (alone,) = [e for e in plain if isinstance(e, Finish)]
    assert answer(events).token_ids == alone.token_ids


@pytest.mark.parametrize("keep", [1, 2])
def test_every_sampled_candidate_is_its_prompt_sampled_alone_with_its_generator(tiny, keep):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    events = list(explore(tiny, PROMPT, k=3, keep=keep, chunk_tokens=4, sampling=sampling, max_new_tokens=12))
    lanes: dict[int, Sampler] = {}
    found = candidates(events)
    assert len(found) == 3 + 3 * keep * 2  # one path forks in round 1, `keep` paths in rounds 2 and 3
    for info, lane, tokens in found:  # forks come round by round: each lane's generator in order
        sampler = lanes.setdefault(lane, Sampler(sampling, lane))
        assert tokens == sample_alone(tiny.model, info.prompt_token_ids, len(tokens), sampler), info.label
    final = answer(events)
    chosen = [c for c in found if c[0].label.startswith("step 3")]
    assert any(info.prompt_token_ids + tokens == events[0].branches[0].prompt_token_ids + final.token_ids
               for info, _, tokens in chosen)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_greedy_candidate_is_what_generate_writes_for_its_prompt(tiny_dir, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True)
    events = list(explore(lm, PROMPT, k=2, keep=2, chunk_tokens=5, sampling=SamplingParams(), max_new_tokens=15))
    for info, _, tokens in candidates(events):
        assert tokens == generate_alone(lm.model, info.prompt_token_ids, len(tokens)), info.label
    prompt = events[0].branches[0].prompt_token_ids
    final = answer(events)
    assert final.token_ids == generate_alone(lm.model, prompt, len(final.token_ids))


# -- the cache ------------------------------------------------------------------------------------


def test_losing_candidates_leave_the_cache(tiny):
    k, chunk = 4, 4
    events = list(explore(tiny, PROMPT, k=k, chunk_tokens=chunk, max_new_tokens=16, compact_ratio=0.0,
                          sampling=SamplingParams(temperature=1.0, seed=2)))
    stats = events[-1].stats
    prompt = len(events[0].branches[0].prompt_token_ids)
    kept = len(answer(events).token_ids)
    assert stats.generated_tokens == k * kept  # every round, k candidates of `chunk` tokens
    assert stats.compactions >= 3  # once per round after the first
    # what stays: the prompt, the chosen path, and the last round's candidates
    assert stats.final_cache_tokens <= prompt + kept + (k - 1) * chunk
    assert stats.peak_cache_tokens < prompt + stats.generated_tokens


# -- the judge ------------------------------------------------------------------------------------


def test_judges_are_branches_of_the_same_forest_and_score_the_candidates(tiny):
    events = list(explore(tiny, PROMPT, k=2, chunk_tokens=3, score="judge", max_new_tokens=6,
                          sampling=SamplingParams(temperature=1.0, seed=4)))
    forks = {e.branch.id: e.branch for e in events if isinstance(e, Fork)}
    prunes = {e.branch: e.reason for e in events if isinstance(e, Prune)}
    judges = [b for b in forks.values() if b.label.startswith("judge ")]
    assert len(judges) == 4  # one per candidate, two rounds of two
    tok = tiny.tokenizer
    rating = f"<|im_start|>user\n{RATING_QUESTION}<|im_end|>\n<|im_start|>assistant\n"  # a new turn, then the answer
    yes, no = tok("Yes", add_special_tokens=False)["input_ids"][0], tok("No", add_special_tokens=False)["input_ids"][0]
    streamed = {info.id: tokens for info, _, tokens in candidates(events)}
    for judge in judges:
        candidate = forks[judge.parent]
        path = candidate.prompt_token_ids + streamed[candidate.id]
        assert judge.prompt_token_ids[: len(path)] == path
        assert tok.decode(judge.prompt_token_ids[len(path):]).endswith(rating)
        score = float(prunes[judge.id].removeprefix("rated: score "))
        with torch.inference_mode():
            logits = tiny.model(torch.tensor([judge.prompt_token_ids])).logits[0, -1].float()
        assert score == pytest.approx(float(logits[yes] - logits[no]), abs=1e-3)
        assert f"score {prunes[judge.id].removeprefix('rated: score ')} " in prunes[candidate.id]


# -- the command line -----------------------------------------------------------------------------

runner = CliRunner()


def mdcli(*args: str):
    return runner.invoke(app, ["explore", *args], env={"HF_HUB_OFFLINE": "1"})


def test_jsonl_shows_candidates_as_forks_losers_as_scored_prunes_and_the_answer_as_final_finish(tiny_dir):
    result = mdcli(PROMPT, "-m", str(tiny_dir("llama")), "--k", "3", "--chunk-tokens", "3", "-n", "6",
                   "--seed", "1", "--jsonl")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-3:] == ["finish", "answers", "done"]
    assert events[0]["strategy"] == "explore" and [b["label"] for b in events[0]["branches"]] == ["explore"]
    forks = [e["branch"] for e in events if e["type"] == "fork"]
    assert [f["label"] for f in forks] == [f"step {r} #{i}" for r in (1, 2) for i in (1, 2, 3)]
    assert [f["parent"] for f in forks[:3]] == [0, 0, 0]
    prunes = {e["branch"]: e["reason"] for e in events if e["type"] == "prune"}
    assert sorted(prunes) == [f["id"] for f in forks]  # every candidate ends in a prune
    for round_forks in (forks[:3], forks[3:]):
        verdicts = [SCORED.match(prunes[f["id"]]) for f in round_forks]
        assert all(verdicts) and sorted(int(v[2]) for v in verdicts) == [1, 2, 3]
        (best,) = [f for f, v in zip(round_forks, verdicts) if v[2] == "1"]
        assert prunes[best["id"]].startswith("kept: ")
        scores = {int(v[2]): float(prunes[f["id"]].split()[2]) for f, v in zip(round_forks, verdicts)}
        assert scores[1] >= scores[2] >= scores[3]
    assert {f["parent"] for f in forks[3:]} == {next(f["id"] for f in forks[:3] if prunes[f["id"]].startswith("kept"))}
    final = events[-3]
    assert final["branch"] == 0 and len(final["token_ids"]) == 6


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--k", "0"], "--candidates 0"),
        (["--k", "2", "--keep", "3"], "--keep 3"),
        (["--chunk-tokens", "0"], "--chunk-tokens 0"),
        (["--score", "vibes"], "--score 'vibes'"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_loading_the_model(args, needle):
    result = mdcli(PROMPT, *args, "-m", "/nonexistent/model")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdcli: error: ") and needle in lines[0], result.stderr


# -- step boundaries ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ends"),
    [
        (" The sea is calm.", True),
        (" Is it?", True),
        (' He said "stop!"', True),
        ("A list:\n", True),
        ("\n", False),  # nothing said yet
        (" It costs 3.", False),  # "3." may be "3.14" or a numbered item
        (" The sea is", False),
    ],
)
def test_a_step_ends_at_the_end_of_a_sentence_or_line(text, ends):
    assert ends_step(text, 5, None) is ends


def test_with_chunk_tokens_a_step_is_that_many_tokens_whatever_the_text():
    assert ends_step(" The sea.", 3, 4) is False
    assert ends_step(" The sea is", 4, 4) is True


# -- the recipe -----------------------------------------------------------------------------------

STORY = "Mara kept the lighthouse for forty years. One foggy night she rang the bell until the boat was safe.\n"


def test_the_builtin_explore_recipe_runs_through_mdcli_run_as_explore_with_its_settings(embedded, tmp_path):
    from mdcli.recipes import load_recipe

    story = tmp_path / "story.txt"
    story.write_text(STORY, encoding="utf-8")
    result = runner.invoke(app, ["run", "explore", "--input", str(story), "-n", "8", "--jsonl"],
                           env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["strategy"] == "explore" and events[-3]["type"] == "finish" and events[-2]["type"] == "answers"
    recipe = load_recipe("explore")
    expected = explore(
        embedded, recipe.prompt.replace("$context", STORY.rstrip("\n")), k=recipe.k, keep=recipe.keep,
        sampling=SamplingParams(temperature=0.8, seed=1), max_new_tokens=8,
    )
    assert events[-3]["token_ids"] == answer(list(expected)).token_ids


def test_a_recipe_keep_above_k_is_refused_naming_the_field():
    from mdcli.errors import RecipeError
    from mdcli.recipes import load_recipe_text

    with pytest.raises(RecipeError, match="keep"):
        load_recipe_text("version: 1\nstrategy: explore\nprompt: hi\nk: 2\nkeep: 3\n")


def test_save_recipe_then_run_gives_the_same_tokens(tiny_dir, tmp_path):
    # issue 53: --save-recipe existed only on ask-many and margins
    saved, model = tmp_path / "explore.yaml", str(tiny_dir("llama"))
    first = mdcli("Costs in $5?", "-m", model, "-k", "3", "--keep", "2", "--chunk-tokens", "3", "-n", "6", "--seed", "1",
                  "--save-recipe", str(saved), "--jsonl")
    assert first.exit_code == 0, first.stderr
    again = runner.invoke(app, ["run", str(saved), "-m", model, "--jsonl"], env={"HF_HUB_OFFLINE": "1"})
    assert again.exit_code == 0, again.stderr

    def tokens(stdout):
        return [(e["branch"], e["token_id"]) for e in map(json.loads, stdout.splitlines()) if e["type"] == "token"]

    assert tokens(again.stdout) == tokens(first.stdout) and tokens(first.stdout)
    assert "Costs in $$5?" in saved.read_text()
