"""--each beyond ask-many: margins' --budget-tokens, the API's list of paths, and `mdcli run RECIPE --each`."""

from __future__ import annotations

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
