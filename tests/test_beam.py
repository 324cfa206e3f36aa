"""Beam search as one tree in one cache returns what `generate(num_beams=W)` returns.

References are transformers' own `model.generate(..., num_beams=W, do_sample=False,
output_scores=True, return_dict_in_generate=True)`: the same sequences, and scores within 1e-4 of
`sequences_scores`, for every early_stopping mode, several length penalties, widths 1..8 and
num_return 1..W, on tiny random models of three architectures (fp32) and on the real embedded
SmolLM2. Tiny models get an EOS id that greedy decoding actually produces, so hypotheses end both
ways (EOS and max length).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from mdcli.cli.app import app
from mdcli.events import Done, Finish, Fork, Progress, Prune, Start, Token
from mdcli.render.base import BranchBook
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.beam import BeamParams, BeamPrompt, BeamSearch
from tests.reference import plain
from tests.test_engine_exactness import engine_for, random_prompts, tiny_model

NEW_TOKENS = 10
TINY_ARCHS = ["llama", "gpt2", "mistral"]

# (width, num_return, early_stopping, length_penalty): every mode, penalties 1/0/2, W 2..8, R 1..W
CASES = [
    (2, 1, False, 1.0),
    (2, 2, True, 0.0),
    (3, 2, "never", 2.0),
    (4, 4, False, 0.0),
    (4, 1, True, 2.0),
    (5, 3, "never", 1.0),
    (6, 6, False, 2.0),
    (7, 2, True, 1.0),
    (8, 5, "never", 0.0),
    (8, 8, False, 1.0),
]


def case_id(case) -> str:
    width, num_return, early, penalty = case
    return f"W{width}-R{num_return}-es={early}-lp={penalty}"


# -- references and runners -------------------------------------------------------------------


def hf_beam(model, prompt: list[int], params: BeamParams, eos: list[int]) -> list[tuple[list[int], float]]:
    """transformers' beam search: (generated ids, sequences_score) per returned sequence, best first."""
    model = plain(model)
    model.generation_config.eos_token_id = list(eos) or None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=params.width,
            num_return_sequences=params.num_return,
            do_sample=False,
            max_new_tokens=params.max_new_tokens,
            early_stopping=params.early_stopping,
            length_penalty=params.length_penalty,
            output_scores=True,
            return_dict_in_generate=True,
        )
    rows = out.sequences[:, len(prompt):].tolist()
    return [(row, float(score)) for row, score in zip(rows, out.sequences_scores)]


def hf_greedy(model, prompt: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    model = plain(model)
    model.generation_config.eos_token_id = list(eos) or None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def hf_fill_value(model, eos: list[int]) -> int:
    """What generate pads shorter returned sequences with (its `output_fill_value`)."""
    pad = plain(model).generation_config.pad_token_id
    return (pad or eos[0]) if eos else -1


def run_search(model, prompts: list[list[int]], params: BeamParams, eos: list[int], **options):
    """mdcli's beam search over one engine: (results per prompt, every event, the search)."""
    search = BeamSearch(engine_for(model), [BeamPrompt(f"p{i}", p) for i, p in enumerate(prompts)], params, eos,
                        **options)
    events: list = [Start(model="tiny", device="cpu", dtype="float32", dtype_reason="test", attn="sdpa",
                          strategy="beam", seed=None, branches=search.announce())]
    events += list(search.run())
    events.append(Done(stats=search.stats(0.0)))
    finishes = [e for e in events if isinstance(e, Finish)]
    per_prompt = [[(f.token_ids, f.score) for f in finishes if f.label.split(" [")[0] == f"p{i}"]
                  for i in range(len(prompts))]
    return per_prompt, events, search


SCORE_TOLERANCE = 1e-4  # scores are sums of float32 logprobs: a different batch or kernel moves the last bits


def assert_same_results(ours, other) -> None:
    """Same sequences token for token; the same scores to float32 summation order (a search run in a
    different batch composition, or on another host's kernels, rounds differently: 4e-6 was seen
    on an AVX2 host)."""
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in other]
    for (_, score), (_, other_score) in zip(ours, other):
        assert abs(score - other_score) < SCORE_TOLERANCE, (score, other_score)


def assert_same_as_generate(ours, reference, fill: int) -> None:
    assert len(ours) == len(reference), (ours, reference)
    longest = max(len(tokens) for tokens, _ in ours)
    for (tokens, score), (row, hf_score) in zip(ours, reference):
        assert len(row) == longest  # generate crops to the longest returned sequence
        assert tokens + [fill] * (longest - len(tokens)) == row, (ours, reference)
        assert abs(score - hf_score) < SCORE_TOLERANCE, (score, hf_score)


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads that wait for each other
    made these small forwards ~200x slower (7.6 s instead of 0.04 s for a tiny search)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """arch -> (model, prompts, eos ids): two prompts, EOS = the token greedy repeats most."""
    made = {}
    for arch in TINY_ARCHS:
        model = tiny_model(arch, "sdpa")
        prompts = random_prompts(16, [3, 6], seed=len(arch))
        greedy = [t for p in prompts for t in hf_greedy(model, p, 16, [])]
        ranked = [token for token, _ in Counter(greedy).most_common()]
        made[arch] = (model, prompts, ranked[:2])
    return made


# -- the same sequences and scores as generate -----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_return_the_sequences_and_scores_of_generate(tiny, arch, case):
    width, num_return, early, penalty = case
    model, prompts, ranked = tiny[arch]
    prompt = prompts[width % 2]
    eos = ranked[:1] if width % 3 else ranked[:2]  # two EOS ids: HF keeps 3W candidates, not 2W
    params = BeamParams(width=width, num_return=num_return, early_stopping=early, length_penalty=penalty,
                        max_new_tokens=NEW_TOKENS)
    [ours], _, _ = run_search(model, [prompt], params, eos)
    assert_same_as_generate(ours, hf_beam(model, prompt, params, eos), hf_fill_value(model, eos))


def test_hypotheses_end_both_by_eos_and_by_length(tiny):
    """The EOS chosen for tiny models really ends hypotheses, mid-search and among the results."""
    model, prompts, ranked = tiny["llama"]
    reasons = Counter()
    for prompt in prompts:
        for width in (2, 4, 6):
            params = BeamParams(width=width, num_return=width, max_new_tokens=NEW_TOKENS)
            _, events, _ = run_search(model, [prompt], params, ranked[:1])
            reasons.update(e.finish_reason for e in events if isinstance(e, Finish))
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons


def test_scores_are_the_length_normalised_logprobs_best_first(tiny):
    model, prompts, ranked = tiny["gpt2"]
    params = BeamParams(width=5, num_return=5, length_penalty=2.0, max_new_tokens=NEW_TOKENS)
    _, events, _ = run_search(model, prompts[:1], params, ranked[:1])
    finishes = [e for e in events if isinstance(e, Finish)]
    scores = [f.score for f in finishes]
    assert scores == sorted(scores, reverse=True)
    for f in finishes:
        assert abs(f.score - f.cumulative_logprob / len(f.token_ids) ** 2.0) < 1e-5
        assert f.finish_reason == ("stop" if f.token_ids[-1] in ranked[:1] else "length")


@pytest.mark.parametrize("case", [(2, 2, False, 1.0), (4, 3, True, 0.0), (3, 1, "never", 2.0)], ids=case_id)
def test_the_real_model_returns_the_sequences_and_scores_of_generate(embedded, case):
    from mdcli.api import beam_search

    width, num_return, early, penalty = case
    events = list(beam_search(embedded, "Translate to French: The cat sleeps.", width=width, num_return=num_return,
                              early_stopping=early, length_penalty=penalty, max_new_tokens=NEW_TOKENS))
    prompt = events[0].branches[0].prompt_token_ids
    ours = [(e.token_ids, e.score) for e in events if isinstance(e, Finish)]
    eos = sorted(embedded.eos_token_ids)
    reference = hf_beam(embedded.model, prompt, BeamParams(width, num_return, penalty, early, NEW_TOKENS), eos)
    assert_same_as_generate(ours, reference, hf_fill_value(embedded.model, eos))


# -- width 1, several prompts --------------------------------------------------------------------------


def test_width_one_is_greedy_decoding(tiny, embedded):
    model, prompts, ranked = tiny["mistral"]
    for prompt in prompts:
        [[(tokens, _)]], _, _ = run_search(model, [prompt], BeamParams(width=1, max_new_tokens=16), ranked[:1])
        assert tokens == hf_greedy(model, prompt, 16, ranked[:1])

    from mdcli.api import beam_search

    events = list(beam_search(embedded, "What is the capital of France?", width=1, max_new_tokens=12))
    [finish] = [e for e in events if isinstance(e, Finish)]
    prompt = events[0].branches[0].prompt_token_ids
    assert finish.token_ids == hf_greedy(embedded.model, prompt, 12, sorted(embedded.eos_token_ids))
    assert finish.finish_reason == "stop" and "Paris" in finish.text


def test_several_prompts_at_once_equal_each_searched_alone(tiny):
    """Three beam sets over a shared prefix step in ONE forward each, yet each gets exactly its own
    search's result (and generate's)."""
    model, _, ranked = tiny["llama"]
    prompts = random_prompts(24, [2, 5, 1], seed=11)
    params = BeamParams(width=3, num_return=2, length_penalty=0.0, max_new_tokens=NEW_TOKENS)
    together, _, search = run_search(model, prompts, params, ranked[:1])
    for prompt, ours in zip(prompts, together):
        [alone], _, _ = run_search(model, [prompt], params, ranked[:1])
        assert_same_results(ours, alone)
        assert_same_as_generate(ours, hf_beam(model, prompt, params, ranked[:1]), hf_fill_value(model, ranked[:1]))
    assert search.engine.forwards == 2 + search.counters.steps  # prefill: trunk, then suffixes; one per step
    assert search.counters.steps <= NEW_TOKENS - 1


def test_several_questions_about_one_document_equal_each_alone(embedded):
    from mdcli.api import beam_search

    document = "Mara lives in a lighthouse in Brittany. Every night she lights the great lamp."
    questions = ["Where does Mara live?", "What does Mara do every night?"]
    events = list(beam_search(embedded, document, questions, width=2, num_return=2, max_new_tokens=8))
    start = events[0]
    assert [b.label for b in start.branches] == questions
    eos = sorted(embedded.eos_token_ids)
    for info in start.branches:
        ours = [(e.token_ids, e.score) for e in events if isinstance(e, Finish) and e.label.startswith(info.label)]
        reference = hf_beam(embedded.model, info.prompt_token_ids, BeamParams(2, 2, max_new_tokens=8), eos)
        assert_same_as_generate(ours, reference, hf_fill_value(embedded.model, eos))
    stats = events[-1].stats
    assert stats.prefill_tokens < sum(len(b.prompt_token_ids) for b in start.branches)  # document shared


# -- the cache ---------------------------------------------------------------------------------------


def test_the_cache_holds_one_prompt_and_the_live_beams_not_width_copies(tiny):
    model, _, _ = tiny["llama"]
    [prompt] = random_prompts(150, [0], seed=5)
    width, new = 4, 24
    _, events, search = run_search(model, [prompt], BeamParams(width=width, max_new_tokens=new), [])
    stats = events[-1].stats
    assert stats.steps == new - 1  # no EOS: every step runs
    assert stats.peak_cache_tokens < len(prompt) + width * new  # pruned beams are reclaimed...
    assert stats.peak_cache_tokens < width * len(prompt) / 2  # ...and HF holds W copies of the prompt
    assert stats.compactions >= 1
    assert search.engine.cache_bytes() == len(search.engine) * kv_bytes_per_token(model.config, 4)


# -- events ---------------------------------------------------------------------------------------------


def test_events_describe_a_tree_every_renderer_can_follow(tiny):
    """Forks carry their full path, every id is announced before use, the search leaves no branch
    running, and the results come as new branches, best first, one Finish each."""
    model, prompts, ranked = tiny["llama"]
    params = BeamParams(width=4, num_return=3, max_new_tokens=NEW_TOKENS)
    _, events, _ = run_search(model, prompts, params, ranked[:1])
    book = BranchBook()
    paths: dict[int, list[int]] = {b.id: list(b.prompt_token_ids) for b in events[0].branches}
    for event in events:
        book.apply(event)  # raises on an unannounced or twice-announced branch
        if isinstance(event, Fork):
            parent = event.branch.parent
            if event.branch.prompt_token_ids != paths[parent][: len(event.branch.prompt_token_ids)]:
                pytest.fail(f"fork {event.branch.id} does not extend its parent's path")
            paths[event.branch.id] = list(event.branch.prompt_token_ids)
        elif isinstance(event, Token):
            paths[event.branch].append(event.token_id)
    assert not book.with_status("running")
    finishes = [e for e in events if isinstance(e, Finish)]
    assert len(finishes) == 3 * len(prompts)
    shown = [b.label for b in book.in_tree_order() if b.status == "finished"]  # how renderers list answers
    assert shown == [f"p{i} [{rank}/3]" for i in range(len(prompts)) for rank in (1, 2, 3)]
    assert all(isinstance(e, (Start, Token, Fork, Prune, Finish, Progress, Done)) for e in events)
    assert len(events) < 4 * params.width * NEW_TOKENS * len(prompts)  # modest: about a token per beam-step


# -- the command line ----------------------------------------------------------------------------------

runner = CliRunner()


def mdcli(*args: str, input: str | None = None):
    return runner.invoke(app, ["beam", *args], input=input, env={"HF_HUB_OFFLINE": "1"})


def assert_usage_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdcli: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_jsonl_events_carry_scores_and_token_ids():
    result = mdcli("What is the capital of France?", "--width", "2", "--num-return", "2", "-n", "6", "--jsonl")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["type"] == "start" and events[0]["strategy"] == "beam"
    assert events[-1]["type"] == "done" and events[-1]["stats"]["peak_cache_tokens"] > 0
    assert "compactions" in events[-1]["stats"]
    finishes = [e for e in events if e["type"] == "finish"]
    assert len(finishes) == 2
    assert all(isinstance(f["score"], float) and f["token_ids"] for f in finishes)
    assert finishes[0]["score"] >= finishes[1]["score"]


def test_cli_a_prompt_from_stdin_is_the_same_prompt_as_inline_text():
    def answers(*args, input=None):
        result = mdcli(*args, "-w", "2", "-n", "8", "--jsonl", input=input)
        assert result.exit_code == 0, result.stderr
        return [json.loads(line)["token_ids"] for line in result.stdout.splitlines() if '"finish"' in line]

    question = "What is the capital of France?"
    assert answers("-", input=question + "\n") == answers(question)


def test_cli_a_document_and_questions_give_one_beam_set_each(tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("Mara lives in a lighthouse in Brittany.\n")
    result = mdcli(str(story), "-q", "Where does Mara live?", "-q", "Who lives there?", "-w", "2", "-n", "4",
                   "--jsonl")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [b["label"] for b in events[0]["branches"]] == ["Where does Mara live?", "Who lives there?"]
    assert [e["label"] for e in events if e["type"] == "finish"] == ["Where does Mara live?", "Who lives there?"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--width", "0"], "--width must be at least 1"),
        (["--width", "2", "--num-return", "3"], "--num-return 3 is more than --width 2"),
        (["--num-return", "0"], "--num-return must be at least 1"),
        (["--early-stopping", "sometimes"], "--early-stopping must be true, false or never"),
    ],
)
def test_cli_bad_options_are_one_line_usage_errors(args, needle):
    assert_usage_error(mdcli("Hello", *args), needle)


def test_cli_refuses_a_width_too_large_for_memory_before_running():
    result = mdcli("Hello", "--width", str(10**7), "--jsonl", "--quiet")
    assert_usage_error(result, "--width 10000000 needs about", "GiB", "lower --width")
    assert result.stdout == ""  # not even a start event


# -- settings mdcli does not apply ---------------------------------------------------------------------


def test_generation_config_settings_that_generate_would_apply_are_named():
    from transformers import GenerationConfig

    from mdcli.strategies.beam import ignored_generation_settings

    assert list(ignored_generation_settings(GenerationConfig(repetition_penalty=1.0, eos_token_id=2))) == []
    [note] = ignored_generation_settings(GenerationConfig(repetition_penalty=1.2, no_repeat_ngram_size=3))
    assert note.data["settings"] == ["repetition_penalty", "no_repeat_ngram_size"]


# -- the benchmark still runs ------------------------------------------------------------------------


def test_the_benchmark_compares_identical_sequences(embedded):
    from mdcli.bench.beam import bench_beam

    [row] = bench_beam(embedded, prompt_tokens=40, widths=(3,), new_tokens=4)
    assert row["identical"] and row["score_difference"] < 1e-4
    assert row["mdcli_peak_cache_tokens"] < 3 * 40


def test_cli_save_recipe_then_run_gives_the_same_hypotheses_with_a_prompt_or_a_document(tiny_dir, tmp_path):
    # issue 53: --save-recipe existed only on ask-many and margins
    model = str(tiny_dir("llama"))
    document = tmp_path / "story.txt"
    document.write_text("Mara keeps the lighthouse; the boat costs $5.\n")

    def finishes(stdout):
        return sorted((e["label"], e["token_ids"]) for e in map(json.loads, stdout.splitlines()) if e["type"] == "finish")

    for given, rerun in [(["Costs in $5?"], []), ([str(document), "-q", "Who?", "-q", "What costs $5?"],
                                                  ["--input", str(document)])]:
        saved = tmp_path / "beam.yaml"
        first = mdcli(*given, "-m", model, "--width", "3", "--num-return", "2", "-n", "5", "--save-recipe", str(saved),
                      "--jsonl")
        assert first.exit_code == 0, first.stderr
        again = runner.invoke(app, ["run", str(saved), *rerun, "-m", model, "--jsonl"], env={"HF_HUB_OFFLINE": "1"})
        assert again.exit_code == 0, again.stderr
        assert finishes(again.stdout) == finishes(first.stdout) and finishes(first.stdout)
