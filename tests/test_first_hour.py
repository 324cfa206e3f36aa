"""What a new user meets in the first hour (issue 38), each item a property: -n bounds every
phase, scripts get answers in question order, think's vote and defaults, live and plain agree,
beam shows what differs, errors teach, cut answers are marked, help shows examples, and the
first seconds are not silent. Real embedded model, real commands, small -n."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mdcli.cli.app import app
from mdcli.render import LiveRenderer, PlainRenderer
from mdcli.render.base import summary_line, visible_trailing_whitespace
from mdcli.events import Stats

runner = CliRunner()
STORY = (
    "Mara lived in a small lighthouse on the coast of Brittany. Every night she climbed the one hundred "
    "steps to light the great lamp. One stormy evening, a fishing boat named the Petrel lost its way.\n"
)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def story(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text(STORY)
    return path


def mdcli(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input, env={"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})


def records(result) -> list[dict]:
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def finishes(result) -> dict[str, dict]:
    return {e["label"]: e for e in records(result) if e["type"] == "finish"}


# -- 1. -n bounds every phase unless the phase's own limit is given ----------------------------------


def test_n_bounds_margins_classifications_and_answers_alike(story):
    done = finishes(mdcli("margins", str(story), "-q", "Who?", "-q", "What boat?", "-n", "5", "--jsonl"))
    assert {label: len(f["token_ids"]) <= 5 for label, f in done.items()} == {label: True for label in done}
    assert {"Who?", "What boat?"} <= set(done)  # the answers, bounded like the margins


def test_a_phase_limit_given_wins_over_n(story):
    done = finishes(mdcli("margins", str(story), "-q", "Who?", "-n", "6", "--answer-tokens", "2", "--jsonl"))
    assert len(done["answer"]["token_ids"]) <= 2
    assert max(len(f["token_ids"]) for label, f in done.items() if label != "answer") <= 6


def test_job_limits_follow_n_unless_given_and_keep_their_defaults_without_it():
    from mdcli.api import Margins, Think

    assert (lambda j: (j.margin_tokens, j.classify_tokens, j.answer_tokens))(
        Margins(documents=["x"], query="q")) == (48, 24, 256)
    assert (lambda j: (j.margin_tokens, j.classify_tokens, j.answer_tokens))(
        Margins(documents=["x"], query="q", margin_tokens=10)) == (10, 10, 10)
    assert (lambda j: (j.margin_tokens, j.classify_tokens, j.answer_tokens))(
        Margins(documents=["x"], query="q", margin_tokens=100, answer_tokens=7)) == (100, 24, 7)
    assert (lambda j: (j.plan_tokens, j.conclusion_tokens))(Think(question="q")) == (128, 256)
    assert (lambda j: (j.plan_tokens, j.conclusion_tokens))(Think(question="q", max_new_tokens=32)) == (32, 32)
    assert Think(question="q", max_new_tokens=32, conclusion_tokens=64).conclusion_tokens == 64


def test_a_saved_margins_recipe_pins_the_limits_n_gave(tmp_path, story):
    from mdcli.recipes import load_recipe
    from mdcli.recipes.margins import margins_job

    saved = tmp_path / "m.yaml"
    result = mdcli("margins", str(story), "-q", "Who?", "-n", "3", "--no-classify", "--save-recipe", str(saved),
                   "--jsonl")
    assert result.exit_code == 0, result.stderr
    job = margins_job(load_recipe(saved), input_text=STORY)
    assert (job.margin_tokens, job.classify_tokens, job.answer_tokens) == (3, 3, 3)


# -- 2. scripts get every answer in question order ----------------------------------------------------


QUESTIONS = ("Who is the main character?", "What is the boat called?", "Where does it happen?")


def test_json_is_one_document_with_every_answer_in_question_order(story):
    args = ["ask-many", str(story), *[a for q in QUESTIONS for a in ("-q", q)], "-n", "6"]
    result = mdcli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert [a["question"] for a in document["answers"]] == list(QUESTIONS)
    assert {"label", "text", "finish_reason", "tokens"} <= set(document["answers"][0])
    jsonl = finishes(mdcli(*args, "--jsonl"))
    assert [a["text"] for a in document["answers"]] == [jsonl[q]["text"] for q in QUESTIONS]


def test_jsonl_ends_with_an_answers_line_in_question_order(story):
    lines = records(mdcli("ask-many", str(story), *[a for q in QUESTIONS for a in ("-q", q)], "-n", "6", "--jsonl"))
    answers, done = lines[-2], lines[-1]
    assert answers["type"] == "answers" and done["type"] == "done"
    finish_text = {e["label"]: e["text"] for e in lines if e["type"] == "finish"}
    assert [(a["label"], a["text"]) for a in answers["answers"]] == [(q, finish_text[q]) for q in QUESTIONS]


def test_the_readme_jq_recipe_selects_the_answers_line():
    readme = (PACKAGE_ROOT / "docs" / "commands.md").read_text()
    assert "select(.type==\"answers\")" in readme and "select(.type==\"finish\") | .text" not in readme


# -- 3. think's vote: on stdout, honestly counted, never read from the question ------------------------


def test_the_vote_goes_to_stdout_with_its_count():
    result = mdcli("think", "What is 17 + 25? End with Answer: N", "--paths", "3", "--vote", "-n", "24", "--plain")
    assert result.exit_code == 0, result.stderr
    vote = result.stdout.split("## vote\n", 1)[1]
    assert re.search(r"\(\d of 3 paths", vote.splitlines()[0]) or vote.startswith("no answer")
    assert "Answer: N" not in vote and not re.search(r"path \d +N$", vote, re.MULTILINE)


def test_one_path_of_three_is_not_a_majority():
    from mdcli.strategies.think import majority_vote

    assert "majority" in majority_vote({"p1": "42", "p2": "42", "p3": "41"}).headline()
    assert majority_vote({"p1": "42", "p2": "42", "p3": "41"}).majority
    split = majority_vote({"p1": "42", "p2": "41", "p3": "40"})
    assert not split.majority and split.headline().startswith("no majority")
    assert "no majority" in majority_vote({"p1": "1", "p2": "1", "p3": "2", "p4": "3", "p5": "4"}).headline()


def test_the_answer_format_the_question_asks_for_is_not_an_answer():
    from mdcli.strategies.think import extract_answer

    question = "What is 17 + 25? End with Answer: N"
    assert extract_answer("Sure! 17 + 25 = 42. Answer: 42", question=question) == "42"
    assert extract_answer("I will end with Answer: N. 17 + 25 = 42", question=question) == "42"
    assert extract_answer("The answer is: Answer: 50") == "50"
    assert extract_answer('I end it with "Answer:". Here is a step-by-step') is None  # mentioned, not used
    assert extract_answer('The answer is "Answer: 32"') == "32"


# -- 4. think's paths differ by default; exact greedy is one flag away -------------------------------


def path_texts(result) -> list[str]:
    return [f["text"] for label, f in finishes(result).items() if label.startswith("path")]


def test_think_paths_are_sampled_by_default_reproducibly_and_greedy_on_request():
    question = "Name a colour of the sky."
    default = path_texts(mdcli("think", question, "--paths", "3", "-n", "8", "--merge", "none", "--jsonl"))
    assert len(set(default)) > 1  # different paths
    again = path_texts(mdcli("think", question, "--paths", "3", "-n", "8", "--merge", "none", "--jsonl"))
    assert again == default  # a fixed default seed: the same run twice
    greedy = path_texts(mdcli("think", question, "--paths", "3", "-n", "8", "--merge", "none", "--greedy", "--jsonl"))
    assert len(set(greedy)) == 1
    assert path_texts(mdcli("think", question, "--paths", "3", "-n", "8", "--merge", "none", "-t", "0",
                            "--jsonl")) == greedy


# -- 5. live and plain print the same answers; one name for classification --------------------------


def test_live_and_plain_print_the_same_answers_for_margins(embedded):
    from mdcli.api import margins

    events = list(margins(embedded, STORY, questions=["Who?", "What boat?"], max_new_tokens=4))
    plain_out = io.StringIO()
    plain = PlainRenderer(plain_out, io.StringIO(), quiet=True)
    live_out = io.StringIO()
    live = LiveRenderer(Console(file=live_out, width=100, no_color=True), Console(file=io.StringIO()), quiet=True,
                        answers=lambda out, err: PlainRenderer(out, err, quiet=True, notes=False))
    for event in events:
        plain.handle(event)
        live.handle(event)
    live.close()
    assert plain_out.getvalue().startswith("## Who?\n")
    assert live_out.getvalue().endswith(plain_out.getvalue())
    assert "segment 1/1\n" not in live_out.getvalue().split("## Who?", 1)[1]


def test_margins_calls_its_second_phase_classification_everywhere(story):
    lines = records(mdcli("margins", str(story), "-q", "Who?", "-n", "3", "--jsonl"))
    labels = [b["branch"]["label"] for b in lines if b["type"] == "fork"]
    assert "classification 1/1" in labels
    assert "relevance" not in json.dumps(lines)


# -- 6. beam shows each hypothesis's score and finish reason, and what differs ------------------------


def test_beam_headings_carry_score_and_finish_reason_and_whitespace_is_drawn():
    result = mdcli("beam", "Translate to French: The cat sleeps.", "--width", "4", "--num-return", "3", "-n", "24",
                   "--plain")
    assert result.exit_code == 0, result.stderr
    headings = re.findall(r"^## .*$", result.stdout, re.MULTILINE)
    assert len(headings) == 3 and all(re.search(r"score -?\d+\.\d{4} · (stop \(EOS\)|length \(-n\))", h)
                                      for h in headings)
    blocks = [block.split("\n", 1)[1].strip("\n") for block in result.stdout.split("## ")[1:]]
    assert len(set(blocks)) == 3  # no two hypotheses print alike
    assert visible_trailing_whitespace("Le chat dort.\n") == "Le chat dort.⏎"


def test_beam_hypotheses_cut_by_n_are_marked_and_named_like_every_cut_answer():
    # issue 53: the README's " …" and stderr note were missing for beam alone
    result = mdcli("beam", "Translate to French: The cat sleeps.", "--width", "2", "--num-return", "2", "-n", "3",
                   "--plain")
    assert result.exit_code == 0, result.stderr
    blocks = [block.split("\n", 1)[1].strip("\n") for block in result.stdout.split("## ")[1:]]
    assert len(blocks) == 2 and all(block.endswith(" …") for block in blocks)
    assert "2 answers stopped at -n 3 (cut short, marked …)" in result.stderr


# -- 7. errors that teach -----------------------------------------------------------------------------


def test_an_extra_argument_to_ask_many_suggests_q(story):
    result = mdcli("ask-many", str(story), "Who is the main character?")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "mdcli: error: 'Who is the main character?' is no file, folder or glob; a question goes after -q; "
        '-q "Who is the main character?"'
    ]


def test_click_usage_errors_are_one_mdcli_line(story):
    for args in (["beam", "hi", "--width", "many"], ["ask-many", str(story), "--plaine"], ["think", "x", "-k", "3"]):
        result = mdcli(*args)
        assert result.exit_code == 2, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mdcli: error: "), result.stderr
    assert "--paths" in mdcli("think", "x", "-k", "3").stderr


def test_plain_and_json_are_spellings_of_output_and_two_modes_are_refused(story):
    plain = mdcli("ask-many", str(story), "-q", "Who?", "-n", "2", "--plain")
    assert plain.exit_code == 0 and not plain.stdout.startswith("{")
    both = mdcli("ask-many", str(story), "-q", "Who?", "-n", "2", "--plain", "--jsonl")
    assert both.exit_code == 2 and "two output modes" in both.stderr


def test_a_utf16_document_is_named_utf16(tmp_path):
    path = tmp_path / "windows.txt"
    path.write_bytes("Mara lived in a lighthouse.".encode("utf-16"))
    result = mdcli("ask-many", str(path), "-q", "Who?")
    assert result.exit_code == 2
    assert "UTF-16" in result.stderr and "latin" not in result.stderr.lower()


# -- 8. an answer cut by -n is marked in plain output, unchanged in JSONL ------------------------------


def test_an_answer_cut_by_n_is_marked_in_plain_output_only(story):
    plain = mdcli("ask-many", str(story), "-q", "Who is the main character?", "-n", "3", "--plain")
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout.endswith(" …\n")
    assert "stopped at -n 3" in plain.stderr
    [done] = finishes(mdcli("ask-many", str(story), "-q", "Who is the main character?", "-n", "3", "--jsonl")).values()
    assert done["finish_reason"] == "length" and not done["text"].endswith("…")
    assert plain.stdout == done["text"] + " …\n"


# -- 9. help that shows ---------------------------------------------------------------------------------


COMMANDS = ("ask-many", "beam", "margins", "think", "explore", "run", "explain", "info", "bench")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_opens_with_examples(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    examples = lines.index("  Examples:")
    assert examples < 8 and lines[examples + 1].startswith("    mdcli ")
    assert all(len(line) <= 80 for line in lines[examples: examples + 4])


def test_top_level_help_groups_commands_and_cuts_no_summary():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "100"}, terminal_width=100)
    assert result.exit_code == 0
    for section in ("Ask commands:", "Reason commands:", "Recipes commands:", "Tools commands:"):
        assert section in result.stdout
    commands = result.stdout.split("Ask commands:", 1)[1]
    assert commands.index("ask-many") < commands.index("Tools commands:") < commands.index("bench")
    assert "..." not in commands  # every summary whole


def test_minus_k_is_explore_candidates_only():
    assert "-k, --candidates, --k" in runner.invoke(app, ["explore", "--help"], env={"COLUMNS": "120"}).stdout
    assert not re.search(r"(^|[\s,])-k\b", runner.invoke(app, ["think", "--help"]).stdout)


@pytest.mark.parametrize("command", ["ask-many", "beam", "margins"])
def test_every_command_that_takes_questions_spells_them_question(command):
    assert "-q, --question" in runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"}).stdout


def test_margins_takes_question_and_its_old_spelling_query_alike(tmp_path, story):
    saved = {}
    for spelling in ("--question", "--query", "-q"):
        recipe = tmp_path / f"{spelling.strip('-')}.yaml"
        # the recipe is written before the model loads; the missing model path then stops the run
        result = runner.invoke(app, ["margins", str(story), spelling, "Who is it about?", "--save-recipe", str(recipe),
                                     "-m", "/nonexistent/model"])
        assert "model path '/nonexistent/model' does not exist" in result.stderr, result.output
        saved[spelling] = recipe.read_text()
    assert saved["--question"] == saved["--query"] == saved["-q"] and "Who is it about?" in saved["-q"]


@pytest.mark.parametrize("spelling", ["--candidates", "-k", "--k"])
def test_explore_candidates_has_a_name_and_keeps_its_old_spellings(spelling):
    result = runner.invoke(app, ["explore", "Why?", spelling, "0", "-m", "/nonexistent/model"])
    assert result.exit_code == 2
    assert result.stderr.startswith("mdcli: error: --candidates 0: explore needs at least 1 candidate per step")


def test_the_summary_line_counts_steps_with_or_without_drafts():
    from mdcli.render.base import BranchBook

    stats = Stats(prompt_tokens=1, prefill_tokens=1, generated_tokens=80, steps=46, seconds=2.0, prefill_seconds=0.1,
                  decode_seconds=2.0, peak_cache_tokens=219, final_cache_tokens=219, compactions=0)
    drafts = dataclasses.replace(stats, draft_tokens=100, accepted_tokens=23)
    plain, drafted = summary_line(BranchBook(), stats), summary_line(BranchBook(), drafts)
    assert "80 tokens in 46 steps" in plain and "80 tokens in 46 steps (23% of drafts accepted)" in drafted
    assert "forwards" not in plain + drafted


def test_the_summary_line_says_the_rate_is_per_decode_second_and_splits_the_seconds():
    # issue 53: "21 tokens ... 20.9 s · 21.7 tok/s" set a decode-only rate beside the whole run's seconds
    from mdcli.render.base import BranchBook

    stats = Stats(prompt_tokens=900, prefill_tokens=900, generated_tokens=21, steps=20, seconds=20.9,
                  prefill_seconds=19.9, decode_seconds=0.97, peak_cache_tokens=921, final_cache_tokens=921, compactions=0)
    assert "20.9 s (prefill 19.9 s, decode 1.0 s at 21.6 tok/s)" in summary_line(BranchBook(), stats)


def test_the_summary_line_of_answers_read_off_the_prefill_shows_no_rate():
    # issue 53: a --choices run printed "2 tokens in 0 steps · 298.5 tok/s"
    from mdcli.render.base import BranchBook

    stats = Stats(prompt_tokens=300, prefill_tokens=160, generated_tokens=2, steps=0, seconds=0.34, prefill_seconds=0.33,
                  decode_seconds=0.0067, peak_cache_tokens=160, final_cache_tokens=160, compactions=0)
    line = summary_line(BranchBook(), stats)
    assert "2 tokens from the prefill, no decode step · 0.3 s (prefill 0.3 s) ·" in line
    assert "tok/s" not in line and "0 steps" not in line


# -- 10. the first seconds -------------------------------------------------------------------------------


def test_the_loading_line_comes_before_torch_is_imported(story):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mdcli", "ask-many", str(story), "-q", "Who?", "-n", "1",
         "--progress", "--plain"],
        capture_output=True, text=True, timeout=300, cwd=PACKAGE_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(PACKAGE_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    loading = next(i for i, line in enumerate(lines) if line.startswith("mdcli: loading "))
    first_torch = next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch(\.|$)", line))
    assert loading < first_torch
    assert sum(line.startswith("mdcli: loading ") for line in lines) == 1  # said once, not again by the loader


def test_the_cli_names_the_embedded_model_as_the_loader_does():
    from mdcli.cli.common import EMBEDDED_NAME
    from mdcli.models.embedded import EMBEDDED_NAME as loader_name

    assert EMBEDDED_NAME == loader_name
