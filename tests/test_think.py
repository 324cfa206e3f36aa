"""`think` is exact where it says so and honest where it is not.

* every path (and the plan) equals `model.generate` on its announced prompt alone;
* the reencode conclusion equals `model.generate` on question + plan + the paths' texts + the
  conclusion request, rebuilt here from the documented template, and only its new tokens are fed;
* with sampling, path i's tokens do not depend on how many paths run;
* the attend merge is announced approximate (exact=False, "(approximate)"), and with a single path,
  where it has nothing to approximate, it equals `model.generate` on path + merge prompt;
* plan parsing and answer extraction on hand-written texts, plus a property for parse_plan;
* the command line: JSONL events, one-line usage errors, the vote note.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mdcli.api import think
from mdcli.cli.app import app
from mdcli.errors import UsageError
from mdcli.events import Done, Finish, Fork, Note, Start
from mdcli.models.load import load_model
from mdcli.strategies.prompts import prompt_token_ids
from mdcli.core.sampling import SamplingParams
from mdcli.strategies.think import (
    ATTEND_INSTRUCTION,
    CONCLUSION_INTRO_PLAN,
    CONCLUSION_TEMPLATE,
    ITEM_TEMPLATE,
    PLAN_INSTRUCTION,
    REASONING_INSTRUCTION,
    after_answer_token_ids,
    conversation_token_ids,
    extract_answer,
    majority_vote,
    normalize_answer,
    parse_plan,
)
from mdcli.core.decoding import common_prefix_length
from tests.reference import generate_alone

QUESTION = "A shop sells pens at 3 dollars each. Tom buys 4 pens and pays with a 20 dollar bill. How much change does he get?"
INSTRUCTIONS = ["Work it out with a short equation.", "Explain it in words first.", "Check your answer at the end."]
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two spinning OpenMP threads run 10-25x slower
    than one (measured: generate of 14 tokens, 1.0 s vs 12-27 s at load average 9)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir("llama")), quiet=True)


# -- helpers ----------------------------------------------------------------------------------



def announced(events) -> dict[int, object]:
    infos = {b.id: b for e in events if isinstance(e, Start) for b in e.branches}
    infos.update({e.branch.id: e.branch for e in events if isinstance(e, Fork)})
    return infos


def finishes(events) -> dict[int, Finish]:
    return {e.branch: e for e in events if isinstance(e, Finish)}


def notes(events, kind: str) -> list[Note]:
    return [e for e in events if isinstance(e, Note) and e.kind == kind]


def assert_exact_branches_equal_generate(model, events) -> None:
    infos, done = announced(events), finishes(events)
    assert sorted(done) == sorted(infos)
    for branch_id, info in infos.items():
        if not info.exact:
            continue
        tokens = done[branch_id].token_ids
        assert tokens == generate_alone(model, info.prompt_token_ids, len(tokens)), info.label


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The documented prompt layout, rebuilt with the tokenizer alone (not with think's helpers)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def documented_conclusion(path_texts: list[str], *, intro: str) -> str:
    entries = "\n\n".join(f"Path {i}: {text.strip() or '(no output)'}" for i, text in enumerate(path_texts, 1))
    return CONCLUSION_TEMPLATE.replace("$intro", intro).replace("$paths", entries)


def labelled(events, prefix: str) -> list[Finish]:
    return [f for f in finishes(events).values() if f.label.startswith(prefix)]


# -- exactness: paths and the reencode conclusion ------------------------------------------------


@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_paths_and_reencoded_conclusion_equal_generate_on_their_prompts_alone(which, embedded, tiny):
    lm = embedded if which == "embedded" else tiny
    events = list(
        think(lm, QUESTION, paths=3, path_instructions=INSTRUCTIONS, max_new_tokens=14, conclusion_tokens=10)
    )
    assert isinstance(events[0], Start) and isinstance(events[-1], Done)
    assert_exact_branches_equal_generate(lm.model, events)

    paths = sorted(labelled(events, "path "), key=lambda f: f.branch)
    assert [f.label.split(" · ")[0] for f in paths] == ["path 1", "path 2", "path 3"]
    # each path's prompt is the documented user turn: question, its instruction, the reasoning request
    infos = announced(events)
    for finish, instruction in zip(paths, INSTRUCTIONS):
        user = f"{QUESTION}\n\n{instruction}\n\n{REASONING_INSTRUCTION}"
        assert infos[finish.branch].prompt_token_ids == prompt_token_ids(lm.tokenizer, user)

    [conclusion] = labelled(events, "conclusion")
    body = documented_conclusion([f.text for f in paths], intro="Here are 3 independent attempts at it:")
    rebuilt = chat_ids(lm.tokenizer, [{"role": "user", "content": f"{QUESTION}\n\n{body}"}])
    assert infos[conclusion.branch].prompt_token_ids == rebuilt
    assert conclusion.token_ids == generate_alone(lm.model, rebuilt, len(conclusion.token_ids))

    # only the conclusion's new tokens were fed: the question was not encoded again
    [merge] = notes(events, "merge")
    question_part = common_prefix_length(rebuilt, infos[paths[0].branch].prompt_token_ids)
    assert merge.data["prompt_tokens"] == len(rebuilt)
    assert merge.data["reused_tokens"] >= question_part > 20
    assert merge.data["fed_tokens"] == len(rebuilt) - merge.data["reused_tokens"]


def test_a_planned_run_is_exact_from_plan_to_conclusion(embedded):
    events = list(
        think(embedded, QUESTION, plan=True, max_paths=3, plan_tokens=40, max_new_tokens=10, conclusion_tokens=8)
    )
    assert_exact_branches_equal_generate(embedded.model, events)
    infos = announced(events)
    [plan] = labelled(events, "plan")
    plan_user = f"{QUESTION}\n\n{PLAN_INSTRUCTION}"
    assert infos[plan.branch].prompt_token_ids == chat_ids(embedded.tokenizer, [{"role": "user", "content": plan_user}])

    items = parse_plan(plan.text, 3)
    paths = sorted(labelled(events, "path "), key=lambda f: f.branch)
    [conclusion] = labelled(events, "conclusion")
    if items is None:  # the model wrote no outline: plain paths, and a note that says so
        assert notes(events, "plan-fallback") and len(paths) == 4
        return
    assert len(paths) == len(items)
    head = [{"role": "user", "content": plan_user}, {"role": "assistant", "content": plan.text}]
    for i, (finish, item) in enumerate(zip(paths, items), 1):
        work = ITEM_TEMPLATE.replace("$number", str(i)).replace("$item", item)
        expected = chat_ids(embedded.tokenizer, head + [{"role": "user", "content": f"{work}\n\n{REASONING_INSTRUCTION}"}])
        assert infos[finish.branch].prompt_token_ids == expected
        assert infos[finish.branch].parent == plan.branch
    body = documented_conclusion([f.text for f in paths], intro=CONCLUSION_INTRO_PLAN)
    rebuilt = chat_ids(embedded.tokenizer, head + [{"role": "user", "content": body}])
    assert infos[conclusion.branch].prompt_token_ids == rebuilt
    [merge] = notes(events, "merge")
    assert merge.data["reused_tokens"] >= common_prefix_length(rebuilt, infos[paths[0].branch].prompt_token_ids)
    assert merge.data["fed_tokens"] == len(rebuilt) - merge.data["reused_tokens"]


def test_an_unparseable_plan_falls_back_to_plain_paths_and_says_so(tiny):
    events = list(think(tiny, QUESTION, plan=True, paths=2, plan_tokens=12, max_new_tokens=4, merge="none"))
    [plan] = labelled(events, "plan")
    assert parse_plan(plan.text, 8) is None  # a random model writes no outline
    [fallback] = notes(events, "plan-fallback")
    assert "2 plain paths" in fallback.message
    assert len(labelled(events, "path ")) == 2
    assert all(info.parent is None for info in announced(events).values())  # they do not read the plan
    assert_exact_branches_equal_generate(tiny.model, events)


# -- sampling: a path does not depend on the others ----------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_with_a_seed_path_i_samples_the_same_tokens_whether_1_4_or_8_paths_run(which, embedded, tiny):
    lm = embedded if which == "embedded" else tiny
    counts = [1, 4, 8] if which == "tiny" else [1, 4]
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    runs = {}
    for count in counts:
        events = list(think(lm, QUESTION, paths=count, sampling=sampling, max_new_tokens=5, merge="none"))
        runs[count] = [f.token_ids for f in sorted(labelled(events, "path "), key=lambda f: f.branch)]
    for count in counts[1:]:
        assert runs[count][: len(runs[counts[0]])] == runs[counts[0]]
    assert runs[counts[-1]][: counts[1]] == runs[counts[1]]
    assert len({tuple(tokens) for tokens in runs[counts[-1]]}) > 1  # the paths did diverge


# -- the attend merge ------------------------------------------------------------------------------


def test_attend_merge_is_announced_approximate(tiny):
    events = list(think(tiny, QUESTION, paths=3, path_instructions=INSTRUCTIONS, max_new_tokens=5,
                        conclusion_tokens=4, merge="attend"))
    [fork] = [e for e in events if isinstance(e, Fork) and not e.branch.exact]
    assert "approximate" in fork.branch.label
    assert notes(events, "approximate")
    assert fork.branch.id in finishes(events)
    assert isinstance(events[-1], Done) and events[-1].stats.generated_tokens == 3 * 5 + 4


def test_attend_merge_finds_paths_that_share_their_first_tokens_then_diverge(embedded):
    """Two sampled paths that begin alike hold duplicate cache nodes for their common start; each
    path's later tokens hang under its own duplicate and must still be found."""
    sampling = SamplingParams(temperature=0.7, seed=0)
    events = list(think(embedded, QUESTION, paths=4, sampling=sampling, max_new_tokens=8, conclusion_tokens=3,
                        merge="attend"))
    paths = [f.token_ids for f in sorted(labelled(events, "path "), key=lambda f: f.branch)]
    assert any(a[:2] == b[:2] and a != b for i, a in enumerate(paths) for b in paths[i + 1 :])  # the case at hand
    [conclusion] = labelled(events, "conclusion")
    assert len(conclusion.token_ids) == 3


def test_attend_merge_over_a_single_path_is_just_that_path_continued(tiny):
    """With one path there is nothing to approximate: positions continue from the path's end, so
    the depth bookkeeping must give exactly `generate` on path + merge prompt."""
    events = list(think(tiny, QUESTION, paths=1, max_new_tokens=6, conclusion_tokens=6, merge="attend"))
    infos = announced(events)
    [path] = labelled(events, "path ")
    [conclusion] = labelled(events, "conclusion")
    chain = after_answer_token_ids(tiny.tokenizer, ATTEND_INSTRUCTION)
    spoken = path.token_ids[:-1] if path.token_ids[-1] in tiny.eos_token_ids else path.token_ids
    sequence = infos[path.branch].prompt_token_ids + spoken + chain
    assert infos[conclusion.branch].prompt_token_ids == sequence
    assert conclusion.token_ids == generate_alone(tiny.model, sequence, len(conclusion.token_ids))


# -- prompts --------------------------------------------------------------------------------------


def test_a_single_user_turn_is_exactly_the_ordinary_prompt(tiny):
    for system in (None, "Be brief."):
        assert conversation_token_ids(tiny.tokenizer, [("user", QUESTION)], system=system) == prompt_token_ids(
            tiny.tokenizer, QUESTION, system=system
        )


def test_a_question_longer_than_the_context_is_refused_before_anything_runs(tiny):
    with pytest.raises(UsageError, match=r"the question's prompt is \d+ tokens, \d+ more than the model's context"):
        next(think(tiny, "word " * 3000, paths=2))


def test_bad_arguments_fail_when_think_is_called(tiny):
    # the API names the job's field; the command line names its flag (test_cli_bad_input below)
    with pytest.raises(UsageError, match="^paths must be at least 1"):
        think(tiny, QUESTION, paths=0)
    with pytest.raises(UsageError, match="unknown merge mode"):
        think(tiny, QUESTION, merge="blend")
    with pytest.raises(UsageError, match="not a valid regular expression"):
        think(tiny, QUESTION, vote=True, answer_pattern="(")


# -- plan parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1. Find the distance\n2. Find the speed\n3. Divide", ["Find the distance", "Find the speed", "Divide"]),
        ("Here is my plan:\n1) Read the question\n2) Solve it", ["Read the question", "Solve it"]),
        ("- apples\n- pears\n* plums", ["apples", "pears", "plums"]),
        ("Step 1: Add the numbers.\nStep 2: Check the sum.", ["Add the numbers.", "Check the sum."]),
        ("**Step 1:**\nCompute x\n\n**Step 2:**\nCompute y", ["Compute x", "Compute y"]),
        ("**1.** Bold start\n**2.** Bold end", ["Bold start", "Bold end"]),
        ("(1) first\n(2) second", ["first", "second"]),
        ("1. Plan A\n   - detail\n2. Plan B\n\nStep 1: now solve\nStep 2: done", ["Plan A", "Plan B"]),
        ("Plan: 1. compute speed 2. compute time 3. answer", ["compute speed", "compute time", "answer"]),
        ("1. a\n2. b\n3. c\n4. d\n5. e", ["a", "b", "c"]),
    ],
)
def test_parse_plan_reads_the_usual_outline_shapes(text, expected):
    assert parse_plan(text, 3 if "5. e" in text else 8) == expected


@pytest.mark.parametrize(
    "text",
    ["", "To solve this we need to think carefully.", "It takes 1.5 hours.", "1.\n2.\n", "1. 1. 2. 3.",
     "In 2024 there were 3 trains."],
)
def test_parse_plan_returns_none_when_there_is_no_outline(text):
    assert parse_plan(text, 8) is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("12.)-*• :\nStepabc(")) | st.characters(), max_size=200),
       st.integers(min_value=1, max_value=10))
def test_parse_plan_never_raises_and_returns_none_or_1_to_max_non_empty_items(text, max_items):
    items = parse_plan(text, max_items)
    assert items is None or (1 <= len(items) <= max_items and all(isinstance(i, str) and i.strip() for i in items))


# -- answer extraction and the vote ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern", "expected"),
    [
        ("So 4 pens cost 12 dollars.\nAnswer: 8", None, "8"),
        ("The answer is 5 pm. They meet near the middle.", None, "5 pm"),
        ("**Answer:** $1,000.", None, "1,000"),
        ("Answer: 3.5 hours", None, "3.5 hours"),
        ("First 3, then 7, so 12 in total", None, "12"),
        ("answer: 4\nWait, the final answer is 6.", None, "6"),
        ("no numbers at all", None, None),
        ("Answer:", None, None),
        ("Result = 42 units", r"Result = (\d+)", "42"),
        ("x=1; x=2", r"x=(?P<answer>\d)", "2"),
        ("The answer is 8", r"RESULT (\d+)", None),
    ],
)
def test_extract_answer(text, pattern, expected):
    assert extract_answer(text, pattern) == expected


def test_votes_group_equal_answers_and_ties_go_to_the_first_path():
    vote = majority_vote({"path 1": "7", "path 2": "$1,000", "path 3": "1000.0", "path 4": None})
    assert (vote.winner, vote.votes) == ("$1,000", 2)
    assert majority_vote({"path 1": "a", "path 2": "b"}).winner == "a"
    assert normalize_answer("5 PM") == normalize_answer("5pm")
    empty = majority_vote({"path 1": None, "path 2": None})
    assert empty.winner is None and "no path gave an extractable answer" in empty.note().message
    note = vote.note()
    assert note.kind == "vote" and note.data["answers"]["path 4"] is None and note.data["winner"] == "$1,000"
    assert "path 3" in note.message and "$1,000 (2 of 4 paths: the most common answer, no majority)" in note.message
    assert note.data["majority"] is False and note.data["paths"] == 4


# -- the command line ------------------------------------------------------------------------------


def mdcli(*args: str, input: str | None = None):
    return runner.invoke(app, ["think", *args], input=input, env={"HF_HUB_OFFLINE": "1"})


def jsonl_events(result) -> list[dict]:
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdcli: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_jsonl_events_parse_and_attend_is_marked_approximate(tiny_dir):
    result = mdcli(QUESTION, "--model", str(tiny_dir("llama")), "--jsonl", "-n", "3", "--paths", "2",
                   "--merge", "attend", "--conclusion-tokens", "3")
    events = jsonl_events(result)
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    assert [b["exact"] for b in events[0]["branches"]] == [True, True]
    [fork] = [e for e in events if e["type"] == "fork"]
    assert fork["branch"]["exact"] is False and fork["branch"]["label"] == "conclusion (approximate)"


def test_cli_paths_zero_is_a_one_line_usage_error():
    assert_one_line_error(mdcli(QUESTION, "--paths", "0"), "--paths must be at least 1")


def test_cli_a_question_too_long_for_the_context_is_a_one_line_usage_error(tiny_dir, tmp_path):
    question = tmp_path / "question.txt"
    question.write_text("word " * 3000)
    result = mdcli(str(question), "--model", str(tiny_dir("llama")), "-n", "2", "--quiet")
    assert_one_line_error(result, "the question's prompt is", "context of 2048")


def test_cli_a_missing_question_file_is_a_usage_error():
    assert_one_line_error(mdcli("nowhere/question.txt"), "does not exist")


def test_cli_vote_prints_the_vote_on_stdout_and_reads_the_question_from_stdin(tiny_dir):
    result = mdcli("-", "--model", str(tiny_dir("llama")), "-o", "plain", "-n", "3", "--paths", "2", "--vote",
                   "--answer-pattern", "(?s)(.+)", input=QUESTION)
    assert result.exit_code == 0, result.stderr
    assert "\n## vote\n" in result.stdout and " of 2 paths" in result.stdout
    assert "## path 1" in result.stdout and "conclusion" not in result.stdout


def test_cli_vote_without_answers_says_so_on_stderr_and_still_shows_the_paths(tiny_dir):
    result = mdcli(QUESTION, "--model", str(tiny_dir("llama")), "--jsonl", "-n", "3", "--paths", "2", "--vote",
                   "--answer-pattern", r"NEVER(\d+)")
    events = jsonl_events(result)
    [vote] = [e for e in events if e["type"] == "note" and e["kind"] == "vote"]
    assert vote["data"]["winner"] is None and vote["data"]["answers"] == {"path 1": None, "path 2": None}
    assert "no path gave an extractable answer" in result.stderr
    assert len([e for e in events if e["type"] == "finish"]) == 2


def test_cli_refuses_paths_too_many_for_memory_before_running_as_beam_refuses_a_width():
    # issue 53: --paths 100000 -n 2 was killed by the kernel (exit 137, 23 GiB)
    result = mdcli("What is 2+2?", "--paths", "100000", "-n", "2", "--jsonl", "--quiet")
    assert_one_line_error(result, "--paths 100000 needs about", "GiB", "lower --paths")
    assert result.stdout == ""  # not even a start event


def test_cli_save_recipe_then_run_gives_the_same_tokens_and_context_is_refused(tiny_dir, tmp_path):
    # issue 53: --save-recipe existed only on ask-many and margins
    saved, model = tmp_path / "think.yaml", str(tiny_dir("llama"))
    first = mdcli("What costs $5?", "-m", model, "--paths", "3", "--path-instruction", "Be $hort.", "-n", "5",
                  "--conclusion-tokens", "4", "--seed", "3", "--save-recipe", str(saved), "--jsonl")
    assert first.exit_code == 0, first.stderr
    again = runner.invoke(app, ["run", str(saved), "-m", model, "--jsonl"], env={"HF_HUB_OFFLINE": "1"})
    assert again.exit_code == 0, again.stderr

    def finishes(stdout):
        return {e["branch"]: (e["label"], e["token_ids"])
                for e in map(json.loads, stdout.splitlines()) if e["type"] == "finish"}

    assert finishes(again.stdout) == finishes(first.stdout) and len(finishes(first.stdout)) == 4
    story = tmp_path / "story.txt"
    story.write_text("Mara keeps the lighthouse.")
    refused = mdcli("Who?", "--context", str(story), "--save-recipe", str(tmp_path / "x.yaml"), "-m", model)
    assert_one_line_error(refused, "a think recipe reads no documents")
