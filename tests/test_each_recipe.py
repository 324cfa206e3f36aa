"""--each beyond ask-many: margins' --budget-tokens, the API's list of paths, and `mdcli run RECIPE --each`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mdcli import api
from mdcli.events import DocumentDone
from tests.test_each import QUESTIONS, invoices, mdcli


def test_ask_each_passes_budget_tokens_to_a_margins_job(tiny_dir, tmp_path, monkeypatch):
    seen = {}

    def spy(model, job, documents, skipped, **kwargs):
        seen.update(kwargs)
        return iter(())

    monkeypatch.setattr(api, "run_each", spy)
    job = api.Margins(documents=["(each)"], questions=QUESTIONS)
    list(api.ask_each(None, invoices(tmp_path / "docs", 1), job, budget_tokens=77))
    assert seen["budget_tokens"] == 77


def test_margins_each_takes_budget_tokens_and_only_with_each(tiny_dir, tmp_path):
    invoices(tmp_path / "docs", 3)
    model = str(tiny_dir("llama"))
    args = ["margins", str(tmp_path / "docs"), "-q", "Who?", "-n", "3", "-m", model, "--json"]
    assert "--budget-tokens" in mdcli("margins", "--help").stdout
    refused = mdcli(*args, "--budget-tokens", "1")
    assert refused.exit_code == 2 and "go with --each" in refused.stderr
    one = mdcli(*args, "--each", "--budget-tokens", "1")  # a forest per document
    every = mdcli(*args, "--each", "--budget-tokens", "100000")  # every document in one forest
    assert one.exit_code == every.exit_code == 0, one.stderr + every.stderr
    assert one.stdout == every.stdout


def test_a_list_of_paths_places_an_unreadable_file_where_it_was_given(tiny_dir, tmp_path):
    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    a, b, c = invoices(tmp_path / "docs", 3)
    scan = tmp_path / "docs" / "scan.pdf"
    scan.write_bytes(b"%PDF\x00binary")
    done = sorted((e for e in api.ask_each(model, [a, b, scan, c], ["Who?"], max_new_tokens=2)
                   if isinstance(e, DocumentDone)), key=lambda e: e.index)
    assert [(e.index, Path(e.document.path).name, e.error is not None) for e in done] == [
        (0, "invoice0.txt", False), (1, "invoice1.txt", False), (2, "scan.pdf", True), (3, "invoice2.txt", False)]


# -- mdcli run RECIPE --each -----------------------------------------------------------------------

ASK_MANY_RECIPE = """\
version: 1
strategy: ask-many
context: {input: true}
vars: {what: supplier}
template: "$context\\n\\nAnswer this question about the text above.\\nQuestion: $question"
questions: ["Who is the $what?", "What is the total?"]
"""
MARGINS_RECIPE = """\
version: 1
strategy: margins
context: {files: ["docs/*.txt"]}
questions: ["Who is the supplier?", "What is the total?"]
segment_tokens: 32
classify_tokens: 3
answer_tokens: 5
"""


def test_run_each_on_an_ask_many_recipe_gives_the_output_of_ask_many_each(embedded, tmp_path):
    invoices(tmp_path / "docs", 3)
    (tmp_path / "docs" / "scan.pdf").write_bytes(b"%PDF\x00binary")
    recipe = tmp_path / "ask.yaml"
    recipe.write_text(ASK_MANY_RECIPE)
    asks = ["-q", "Who is the supplier?", "-q", "What is the total?", "-n", "6"]
    for form in ("--plain", "--json", "--jsonl"):
        by_flags = mdcli("ask-many", str(tmp_path / "docs"), "--each", *asks, form, "--budget-tokens", "400")
        by_recipe = mdcli("run", str(recipe), "--input", str(tmp_path / "docs"), "--each", "-n", "6", form,
                          "--budget-tokens", "400")
        assert by_flags.exit_code == by_recipe.exit_code == 1  # scan.pdf: one error record
        assert "scan.pdf: skipped" in by_recipe.stderr
        assert by_recipe.stdout == by_flags.stdout and by_flags.stdout.strip()
    results = tmp_path / "out.jsonl"
    first = mdcli("run", str(recipe), "--input", str(tmp_path / "docs"), "--each", "-n", "6", "--output", str(results))
    again = mdcli("run", str(recipe), "--input", str(tmp_path / "docs"), "--each", "-n", "6", "--output", str(results))
    assert first.exit_code == again.exit_code == 1
    assert "3 of 4 documents already answered in the output: skipped" in again.stderr
    assert len([line for line in results.read_text().splitlines() if '"answer"' in line]) == 6


def test_run_each_on_a_margins_recipe_gives_the_output_of_margins_each(tiny_dir, tmp_path):
    invoices(tmp_path / "docs", 3)
    (tmp_path / "recipe.yaml").write_text(MARGINS_RECIPE)
    model = ["-m", str(tiny_dir("llama")), "-n", "4", "--json"]
    by_flags = mdcli("margins", str(tmp_path / "docs" / "*.txt"), "--each", "-q", "Who is the supplier?",
                     "-q", "What is the total?", "--segment-tokens", "32", "--classify-tokens", "3",
                     "--answer-tokens", "5", *model)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the recipe's files are relative to it; the flags' paths as typed
    try:
        by_recipe = mdcli("run", "recipe.yaml", "--each", *model)
        assert by_recipe.exit_code == 0, by_recipe.stderr
    finally:
        os.chdir(cwd)
    documents = json.loads(by_recipe.stdout)["documents"]
    assert [d["document"]["path"] for d in documents] == [f"docs/invoice{n}.txt" for n in range(3)]
    expected = json.loads(by_flags.stdout)["documents"]
    assert [d["answers"] for d in documents] == [d["answers"] for d in expected]


def test_run_each_is_refused_in_one_line_for_other_recipes_and_without_documents(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    tree = mdcli("run", "follow-ups", "--input", str(tmp_path / "a.txt"), "--each")
    assert tree.exit_code == 2
    assert tree.stderr.strip().splitlines() == [
        "mdcli: error: follow-ups.yaml (built-in): strategy: --each runs ask-many and margins recipes, not a tree recipe; "
        "run it without --each"]
    (tmp_path / "ask.yaml").write_text(ASK_MANY_RECIPE)
    missing = mdcli("run", str(tmp_path / "ask.yaml"), "--each")
    assert missing.exit_code == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "--input" in missing.stderr
    flags = mdcli("run", str(tmp_path / "ask.yaml"), "--input", str(tmp_path / "a.txt"), "--budget-tokens", "9")
    assert flags.exit_code == 2 and "go with --each" in flags.stderr
    assert "--each" in mdcli("run", "--help").stdout
