"""ask-many --each (issue 51): the same questions about every document, one tree per document,
many documents in one forest, each document's answers exactly those of it run alone; results
appended per document, reruns skipping what is there, bad files as error records. The real
embedded model where tokens are compared to a run alone, tiny models for the sampled matrix."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mdcli import api
from mdcli.cli.app import app
from mdcli.events import DocumentDone
from mdcli.render.each import answered_keys
from tests.test_cli import sigint_default

QUESTIONS = ["Who is the supplier?", "What is the total?"]
SUPPLIERS = ["Ana", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal"]
CITIES = ["Paris", "Oslo", "Lima", "Rome", "Kyiv", "Bern", "Riga", "Doha"]


def invoices(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(count):
        path = folder / f"invoice{n}.txt"
        path.write_text(
            f"Invoice {n + 1}00 from {SUPPLIERS[n % 8]} Supplies Ltd, {CITIES[(3 * n) % 8]}. "
            f"Total due: {37 * (n + 1)} euros, payable by March {n + 3}. Items: paper, ink, {n + 1} chairs.\n"
        )
        paths.append(path)
    return paths


def alone(model, path: Path, questions=QUESTIONS, **options) -> list[list[int]]:
    """The document's answers from ask_many on it alone, in question order."""
    finishes = {e.label: e.token_ids for e in api.ask_many(model, path.read_text(), questions, **options)
                if e.type == "finish"}
    return [finishes[q] for q in questions]


def answered(events) -> dict[str, list[list[int]]]:
    return {e.document.path: [a.token_ids for a in e.answers] for e in events
            if isinstance(e, DocumentDone) and e.error is None}


def sha256(text: str) -> str:
    """A document's key hash, as docs/cli.md states it: sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def mdcli(*args: str):
    return CliRunner().invoke(app, list(args), env={"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})


# -- exactness -------------------------------------------------------------------------------------


def test_each_document_in_a_shared_forest_gets_the_tokens_of_its_run_alone(embedded, tmp_path):
    paths = invoices(tmp_path / "docs", 4)
    events = list(api.ask_each(embedded, [tmp_path / "docs"], QUESTIONS, max_new_tokens=12))
    got = answered(events)
    assert got == {str(p): alone(embedded, p, max_new_tokens=12) for p in paths}
    done = [e for e in events if isinstance(e, DocumentDone)]
    assert [e.document.sha256 for e in done] == [sha256(Path(e.document.path).read_text())
                                                  for e in done]


def test_a_document_admitted_mid_forest_as_another_finishes_gets_the_tokens_of_its_run_alone(embedded, tmp_path):
    from mdcli.core.steps import StepLoop

    paths = invoices(tmp_path / "docs", 5)
    for n, path in enumerate(paths):  # documents of different lengths, answers of different lengths
        path.write_text(path.read_text() + "Notes: " + "the goods were delivered on time. " * (3 * n) + "\n")
    questions = ["What is the total? Answer with one number.", "Who is the supplier? Answer with the name only."]
    joined: list[list[int]] = []  # at each admission, the tokens each live branch had generated
    join = StepLoop.join

    def spy(loop, tips):
        joined.append([len(tip.tokens) for tip in loop.live])
        join(loop, tips)

    StepLoop.join = spy
    try:  # room for about two documents: the next is admitted as one finishes
        got = answered(api.ask_each(embedded, paths, questions, max_new_tokens=24, budget_tokens=400))
    finally:
        StepLoop.join = join
    assert any(tokens and min(tokens) > 0 for tokens in joined), f"no document was admitted mid-decode: {joined}"
    assert got == {str(p): alone(embedded, p, questions, max_new_tokens=24) for p in paths}


def test_documents_are_indexed_in_input_order_with_unreadable_files_where_they_were_found(tiny_dir, tmp_path):
    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    invoices(tmp_path / "docs", 3)
    (tmp_path / "docs" / "invoice0b.pdf").write_bytes(b"%PDF\x00binary")
    (tmp_path / "docs" / "a-empty.txt").write_text("")
    inputs = api.read_inputs([str(tmp_path / "docs")], lenient=True)
    done = sorted((e for e in api.ask_each(model, inputs, ["Who?"], max_new_tokens=2) if isinstance(e, DocumentDone)),
                  key=lambda e: e.index)
    assert [e.index for e in done] == [0, 1, 2, 3, 4]
    assert [Path(e.document.path).name for e in done] == [
        "a-empty.txt", "invoice0.txt", "invoice0b.pdf", "invoice1.txt", "invoice2.txt"]


@pytest.mark.parametrize("budget", [1, 10_000])  # a forest per document; every document in one forest
def test_sampled_answers_are_those_of_each_document_alone_whatever_the_forest(tiny_dir, tmp_path, budget):
    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    paths = invoices(tmp_path / "docs", 3)
    sampling = api.SamplingParams(temperature=0.9, seed=7)
    got = answered(api.ask_each(model, paths, QUESTIONS, max_new_tokens=6, sampling=sampling, budget_tokens=budget))
    assert got == {str(p): alone(model, p, max_new_tokens=6, sampling=sampling) for p in paths}


def test_a_document_already_answered_is_not_run_again(tiny_dir, tmp_path):
    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    paths = invoices(tmp_path / "docs", 3)
    first = [e for e in api.ask_each(model, paths, QUESTIONS, max_new_tokens=4) if isinstance(e, DocumentDone)]
    again = list(api.ask_each(model, paths, QUESTIONS, max_new_tokens=4, answered=[first[0].key]))
    assert sorted(answered(again)) == sorted(str(p) for p in paths[1:])
    assert [e.message for e in again if e.type == "note"] == ["1 of 3 documents already answered in the output: skipped"]
    # a different -n changes the tokens, so the key: nothing is skipped
    other = list(api.ask_each(model, paths, QUESTIONS, max_new_tokens=5, answered=[e.key for e in first]))
    assert len(answered(other)) == 3


# -- the command line ------------------------------------------------------------------------------


def test_each_on_the_command_line_plain_jsonl_json_results_file_and_bad_files(embedded, tmp_path):
    paths = invoices(tmp_path / "docs", 2)
    (tmp_path / "docs" / "scan.pdf").write_bytes(b"%PDF\x00\x01binary")
    (tmp_path / "docs" / "blank.txt").write_text("  \n")
    results = tmp_path / "out.jsonl"
    expected = {str(p): alone(embedded, p, max_new_tokens=8) for p in paths}

    plain = mdcli("ask-many", str(tmp_path / "docs"), "--each", *sum((["-q", q] for q in QUESTIONS), []), "-n", "8",
                  "--output", str(results))
    assert plain.exit_code == 1  # some documents failed
    headings = [line for line in plain.stdout.splitlines() if line.startswith("## ")]
    assert sorted(headings) == sorted(f"## {p} :: {q}" for p in paths for q in QUESTIONS)
    assert [line for line in plain.stderr.splitlines() if "scan.pdf" in line or "blank.txt" in line] == [
        f"mdcli: {tmp_path / 'docs' / 'blank.txt'}: skipped: empty",
        f"mdcli: {tmp_path / 'docs' / 'scan.pdf'}: skipped: binary (it holds NUL bytes)",
    ]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert {r["type"] for r in records} == {"answer", "error"}
    answers = [r for r in records if r["type"] == "answer"]
    assert {(r["document"]["path"], r["question"]): r["token_ids"] for r in answers} == {
        (path, q): tokens[i] for path, tokens in expected.items() for i, q in enumerate(QUESTIONS)
    }
    assert all(r["document"]["sha256"] == sha256(Path(r["document"]["path"]).read_text())
               for r in answers)
    assert len(answered_keys(results, len(QUESTIONS))) == 2

    rerun = mdcli("ask-many", str(tmp_path / "docs"), "--each", *sum((["-q", q] for q in QUESTIONS), []), "-n", "8",
                  "--output", str(results), "--json")
    assert rerun.exit_code == 1
    assert "2 of 4 documents already answered in the output: skipped" in rerun.stderr
    body = json.loads(rerun.stdout)  # only the bad files were tried again
    assert [d["document"]["path"] for d in body["documents"]] == [str(tmp_path / "docs" / n) for n in ("blank.txt", "scan.pdf")]
    assert len([json.loads(line) for line in results.read_text().splitlines() if '"answer"' in line]) == 4


def test_json_lists_documents_in_input_order_and_jsonl_records_name_their_document(tiny_dir, tmp_path):
    paths = invoices(tmp_path / "docs", 3)
    model = str(tiny_dir("llama"))
    args = ["ask-many", *map(str, reversed(paths)), "--each", "-q", "Who?", "-n", "3", "-m", model, "--budget-tokens", "1"]
    body = json.loads(mdcli(*args, "--json").stdout)
    assert [d["document"]["path"] for d in body["documents"]] == [str(p) for p in reversed(paths)]
    lines = [json.loads(line) for line in mdcli(*args, "--jsonl").stdout.splitlines()]
    assert sorted(r["document"]["path"] for r in lines) == sorted(str(p) for p in paths)
    assert all(set(r["document"]) == {"path", "sha256"} and r["type"] == "answer" for r in lines)


def test_output_file_without_each_and_each_flags_without_each_are_usage_errors(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    result = mdcli("ask-many", str(tmp_path / "a.txt"), "-q", "Who?", "--output", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 2 and "add --each" in result.stderr
    result = mdcli("ask-many", str(tmp_path / "a.txt"), "-q", "Who?", "--workers", "2")
    assert result.exit_code == 2 and "go with --each" in result.stderr


def test_workers_without_ray_says_in_one_line_how_to_install_it(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['mdcli', 'ask-many', sys.argv[1], '--each', "
            "'-q', 'Who?', '--workers', '2']; from mdcli.cli.app import main; main()")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.txt")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'mdcli: error: --workers and --ray-address need Ray, which is not installed; pip install "mdcli[ray]"'
    ]


def test_the_command_line_and_the_api_import_no_ray():
    code = "import sys, mdcli.api, mdcli.cli.app, mdcli.cli.each; assert 'ray' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- nothing lost ----------------------------------------------------------------------------------


def test_a_run_killed_midway_and_rerun_answers_every_document_once_with_the_tokens_of_one_run(embedded, tmp_path):
    paths = invoices(tmp_path / "docs", 8)
    results = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "mdcli", "ask-many", str(tmp_path / "docs"), "--each", "-q", QUESTIONS[0], "-q",
            QUESTIONS[1], "-n", "24", "--budget-tokens", "1", "--output", str(results), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if results.exists() and results.read_text().count("\n") >= 2:  # the first document is written
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    first = results.read_text().count("\n") // 2
    assert 1 <= first < len(paths), "the kill must land midway"
    rerun = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        counts[r["document"]["path"], r["question"]] = counts.get((r["document"]["path"], r["question"]), 0) + 1
    assert counts == {(str(p), q): 1 for p in paths for q in QUESTIONS}
    one_run = answered(api.ask_each(embedded, paths, QUESTIONS, max_new_tokens=24))
    assert {(r["document"]["path"], r["question"]): r["token_ids"] for r in records} == {
        (path, q): tokens[i] for path, tokens in one_run.items() for i, q in enumerate(QUESTIONS)
    }


def test_a_document_too_long_for_the_model_is_an_error_record_and_the_rest_go_on(tiny_dir, tmp_path):
    from tests.tiny_models import TINY_MAX_POSITIONS

    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    paths = invoices(tmp_path / "docs", 2)
    long = tmp_path / "docs" / "long.txt"
    long.write_text("word " * (2 * TINY_MAX_POSITIONS))
    done = {e.document.path: e for e in api.ask_each(model, [tmp_path / "docs"], QUESTIONS, max_new_tokens=3)
            if isinstance(e, DocumentDone)}
    assert sorted(done) == sorted(str(p) for p in [*paths, long])
    assert done[str(long)].answers == [] and "more than the model's context" in done[str(long)].error
    assert all(done[str(p)].error is None and len(done[str(p)].answers) == 2 for p in paths)


def test_progress_counts_documents_with_a_rate_and_an_eta_and_a_cut_line_is_passed_over(tmp_path):
    from mdcli.events import Answer, DocumentRef, Progress
    from mdcli.render.each import EachWriter, ResultsFile

    results = tmp_path / "out.jsonl"
    results.write_text('{"type": "answer", "key": "k0", "question": "Who?"}\n{"type": "ans')  # a write cut by a kill
    stdout, stderr = io.StringIO(), io.StringIO()
    writer = EachWriter("plain", stdout, stderr, progress=True, results=ResultsFile(results))
    writer.handle(Progress("documents", 0, 2, "documents"))
    event = DocumentDone(DocumentRef("a.txt", "00"), 0, [Answer("Who?", "Ana", [1, 2], "stop", -0.5)], key="k1")
    writer.handle(event)
    writer.handle(Progress("documents", 1, 2, "documents"))
    writer.close()
    assert stdout.getvalue() == "## a.txt :: Who?\nAna\n\n"
    assert re.fullmatch(r"mdcli: 1/2 documents · [0-9.]+ doc/s · ETA \d+s", stderr.getvalue().splitlines()[0])
    assert answered_keys(results, 1) == {"k0", "k1"}  # the cut line is skipped, the next record intact


@pytest.mark.parametrize("budget", [1, 100_000])  # a forest per document; every document in one forest
def test_margins_each_gives_every_document_the_answers_of_margins_on_it_alone(tiny_dir, tmp_path, budget):
    from mdcli.strategies.each import run_each

    model = api.load_model(str(tiny_dir("llama")), quiet=True)
    paths = invoices(tmp_path / "docs", 3)
    paths[1].write_text(paths[1].read_text() * 4)  # more segments than the others
    job = api.Margins(documents=["(each)"], questions=QUESTIONS, margin_tokens=4, classify_tokens=3, answer_tokens=5,
                      segment_tokens=32, sampling=api.SamplingParams(temperature=0.9, seed=3))
    documents = api.read_inputs([str(tmp_path / "docs")]).documents
    got = answered(run_each(model, job, documents, budget_tokens=budget))

    def margins_alone(path: Path) -> list[list[int]]:
        one = job.model_copy(update={"documents": [path.read_text()], "names": [path.name]})
        numbers, answers = {}, {}
        for event in api.margins(model, one):
            if event.type == "note" and event.kind == "answer-sources":
                numbers[event.data["branch"]] = event.data["question"]
            elif event.type == "finish" and event.branch in numbers:
                answers[numbers[event.branch]] = event.token_ids
        return [answers[n] for n in sorted(answers)]

    assert got == {str(p): margins_alone(p) for p in paths}


def test_ctrl_c_midway_exits_130_with_every_finished_document_in_the_results_file(embedded, tmp_path):
    paths = invoices(tmp_path / "docs", 8)
    results = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "mdcli", "ask-many", str(tmp_path / "docs"), "--each", "-q", QUESTIONS[0], "-n", "24",
            "--budget-tokens", "1", "--output", str(results)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               preexec_fn=sigint_default)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if results.exists() and results.read_text().count("\n") >= 1:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    written = [json.loads(line) for line in results.read_text().splitlines()]
    assert process.returncode == 130 and 1 <= len(written) < len(paths), stderr
    assert "mdcli: interrupted" in stderr and "Traceback" not in stderr
    assert sorted(line[3:].split(" :: ")[0] for line in stdout.splitlines() if line.startswith("## ")) == sorted(
        r["document"]["path"] for r in written)  # stdout and the file hold the same finished documents


def test_each_keeps_no_document_in_the_prompt_cache_unless_asked(tiny_dir, tmp_path, prompt_cache_folder):
    invoices(tmp_path / "docs", 2)
    args = ["ask-many", str(tmp_path / "docs"), "--each", "-q", "Who?", "-n", "2", "-m", str(tiny_dir("llama"))]

    def entries() -> set[Path]:
        return {path for path in prompt_cache_folder.rglob("*.safetensors")}

    before = entries()
    assert mdcli(*args).exit_code == 0
    assert entries() == before  # a folder of files would push every other entry out
    assert mdcli(*args, "--prompt-cache", "auto").exit_code == 0
    assert len(entries() - before) >= 1
