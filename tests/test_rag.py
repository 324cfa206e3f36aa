"""Retrieval-augmented runs stay exact and name their sources: ask-many over a folder with and
without --retrieve, margins over a folder, the refusal of a context the model cannot hold. Every
branch is compared with `generate` on its own prompt alone, on the embedded model and a tiny one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mdcli.api import AskMany, ask_many, read_inputs
from mdcli.cli.app import app
from mdcli.errors import UsageError
from mdcli.events import Start
from mdcli.models.load import load_model
from tests.rag_corpus import CORPUS, QUESTIONS
from tests.test_ask_many import assert_each_branch_equals_generate

runner = CliRunner()


def mdcli(*args: str):
    return runner.invoke(app, list(args), env={"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})


def corpus():
    return read_inputs([str(CORPUS)]).documents


def test_each_question_reads_its_retrieved_passages_and_its_answer_equals_generate_alone(embedded):
    """The check of issue 33: ten files, ten questions, --retrieve 2 with the default chunks of
    256 model tokens: the file holding each answer is among its sources for at least 9 (here all
    10), every branch is exact, and the shared leading passages are prefilled once."""
    job = AskMany(documents=corpus(), questions=list(QUESTIONS), retrieve=2, max_new_tokens=12)
    events = list(ask_many(embedded, job))
    assert_each_branch_equals_generate(embedded.model, events)
    start = events[0]
    assert isinstance(start, Start)
    cited = [{Path(s.path).name for s in b.sources} for b in start.branches]
    assert all(1 <= len(b.sources) <= 2 and all(s.score > 0 for s in b.sources) for b in start.branches)
    assert sum(QUESTIONS[b.label] in files for b, files in zip(start.branches, cited)) >= 9
    text = embedded.tokenizer.decode(start.branches[0].prompt_token_ids)
    for source in start.branches[0].sources:
        assert f"[{source.chunk}] {source.path}:{source.first_line}-{source.last_line}\n" in text
    stats = events[-1].stats
    assert stats.prompt_tokens == sum(len(b.prompt_token_ids) for b in start.branches)
    assert stats.prefill_tokens < stats.prompt_tokens  # the system prompt and common passages, once


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_retrieved_branches_are_exact_on_tiny_models(tiny_dir, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True)
    job = AskMany(documents=corpus(), questions=list(QUESTIONS)[:6], retrieve=3, chunk_tokens=24, max_new_tokens=6)
    events = list(ask_many(lm, job))
    assert_each_branch_equals_generate(lm.model, events)
    assert all(1 <= len(b.sources) <= 3 for b in events[0].branches)


def test_passages_laid_out_in_corpus_order_are_prefilled_once_for_every_question_that_retrieved_them(tiny_dir):
    """Retrieving every chunk gives every question the same passages in the same order: the
    prompts differ only after them, so the passages enter the cache once."""
    lm = load_model(str(tiny_dir("llama")), quiet=True)
    questions = list(QUESTIONS)[:4]
    job = AskMany(documents=corpus()[:3], questions=questions, retrieve=100, chunk_tokens=64, max_new_tokens=4)
    events = list(ask_many(lm, job))
    assert_each_branch_equals_generate(lm.model, events)
    prompts = [b.prompt_token_ids for b in events[0].branches]
    stats = events[-1].stats
    shared = min(len(p) for p in prompts) - 40  # every prompt's question fits in its last 40 tokens
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.prefill_tokens <= stats.prompt_tokens - (len(prompts) - 1) * shared


def test_several_documents_without_retrieval_are_one_shared_context_under_path_headers(embedded):
    documents = corpus()[:3]
    job = AskMany(documents=documents, questions=["What is the Falcon budget?", "What is in the tank?"],
                  max_new_tokens=12)
    events = list(ask_many(embedded, job))
    assert_each_branch_equals_generate(embedded.model, events)
    prompt = embedded.tokenizer.decode(events[0].branches[0].prompt_token_ids)
    assert all(f"# {d.path}\n\n" in prompt for d in documents)
    assert prompt.index(documents[0].path) < prompt.index(documents[1].path) < prompt.index(documents[2].path)
    assert all(b.sources == () for b in events[0].branches)


def test_a_context_too_long_for_the_model_is_refused_before_the_run_starts(embedded, tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("The committee met again and read the minutes aloud. " * 600)
    job = AskMany(documents=read_inputs([str(tmp_path)]).documents, questions=["What happened?"])
    with pytest.raises(UsageError) as refused:
        ask_many(embedded, job)  # refused when called, before any event (no forward) is asked for
    message = str(refused.value)
    assert "the 3 documents" in message and f"more than the model's context of {embedded.context_length} allows" in message
    assert "retrieve" in message and "margins" in message


def test_the_over_long_refusal_suggests_only_a_margins_layout_that_fits(embedded):
    # issue 53: the refusal said "or mdcli margins", whose default layout for one document (chain)
    # reads it whole by the last segment and was refused in turn
    from mdcli.documents.inputs import Document
    from mdcli.strategies.margins import Margins, check_fits

    document = "The committee met again and read the minutes aloud. " * 1800
    with pytest.raises(UsageError) as refused:
        ask_many(embedded, AskMany(documents=[Document("report.txt", document)], questions=["What happened?"]))
    message = str(refused.value)
    assert "the document and the question make a prompt of" in message
    assert "mdcli margins --context independent" in message
    independent = Margins(documents=[document], questions=["What happened?"], layout="independent")
    segments = independent.segments(embedded.tokenizer)
    check_fits(embedded, independent, segments, independent.margin_specs(embedded.tokenizer, segments))
    chain = Margins(documents=[document], questions=["What happened?"])  # margins' default for one document
    with pytest.raises(UsageError, match="use .*layout.* independent"):
        check_fits(embedded, chain, segments, chain.margin_specs(embedded.tokenizer, segments))


# -- the command line ------------------------------------------------------------------------


@pytest.fixture()
def folder_with_binary(tmp_path) -> Path:
    folder = tmp_path / "docs"
    shutil.copytree(CORPUS, folder)
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    return folder


def test_a_folder_with_a_binary_file_skips_it_in_one_stderr_line_and_answers_exactly(embedded, folder_with_binary):
    result = mdcli("ask-many", str(folder_with_binary / "budget.md"), str(folder_with_binary), "-q",
                   "Which project went over budget?", "-n", "10", "--jsonl")
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.stderr.splitlines() if "skipped" in line]
    assert skipped == [f"mdcli: skipped '{folder_with_binary}/logo.png': binary (it holds NUL bytes)"]
    events = [json.loads(line) for line in result.stdout.splitlines()]
    prompt = events[0]["branches"][0]["prompt_token_ids"]
    finish = next(e for e in events if e["type"] == "finish")
    from tests.reference import generate_alone

    assert finish["token_ids"] == generate_alone(embedded.model, prompt, len(finish["token_ids"]))
    assert embedded.tokenizer.decode(prompt).count("# ") >= 11  # budget.md named first, then the folder's ten


def test_retrieve_names_the_sources_in_plain_text_and_in_jsonl(folder_with_binary):
    questions = ["-q", "What is the name of the keeper's cat?", "-q", "How high is the summit of the Puy de Dome?"]
    plain = mdcli("ask-many", str(folder_with_binary), *questions, "--retrieve", "2", "-n", "8", "-o", "plain")
    assert plain.exit_code == 0, plain.output
    sources = [line for line in plain.stdout.splitlines() if line.startswith("Sources: ")]
    assert len(sources) == 2
    assert "lighthouse.txt:" in sources[0] and "volcano.md:" in sources[1]
    jsonl = mdcli("ask-many", str(folder_with_binary), *questions, "--retrieve", "2", "-n", "8", "--jsonl")
    start = json.loads(jsonl.stdout.splitlines()[0])
    for branch in start["branches"]:
        assert 1 <= len(branch["sources"]) <= 2
        assert all(set(s) == {"path", "first_line", "last_line", "chunk", "score"} for s in branch["sources"])


def test_an_over_long_corpus_without_retrieve_is_refused_in_one_line_with_exit_2(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("The committee met again and read the minutes aloud. " * 600)
    result = mdcli("ask-many", str(tmp_path), "-q", "What happened?")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("mdcli: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output
    assert "--retrieve K" in errors[0] and "mdcli margins" in errors[0] and "tokens" in errors[0]
    assert result.stdout == ""  # no start event: nothing ran


def test_margins_over_a_folder_names_the_documents_and_lines_its_answer_kept(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("lighthouse.txt", "budget.md"):
        shutil.copy(CORPUS / name, folder / name)
    result = mdcli("margins", str(folder), "-q", "What is the cat called?", "-n", "12", "--answer-tokens", "12",
                   "--no-classify", "-o", "plain")
    assert result.exit_code == 0, result.output
    sources = [line for line in result.stdout.splitlines() if line.startswith("Sources: ")]
    assert sources == [f"Sources: [1] {folder}/budget.md:1-7, [2] {folder}/lighthouse.txt:1-7"]


# -- recipes ---------------------------------------------------------------------------------


def finishes_of(result) -> dict[str, list[int]]:
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    return {e["label"]: e["token_ids"] for e in events if e["type"] == "finish"}


def test_a_recipe_reads_context_files_relative_to_itself_and_dumps_them_back(tmp_path):
    from mdcli.recipes import dump_recipe, load_recipe

    shutil.copytree(CORPUS, tmp_path / "docs")
    recipe_file = tmp_path / "rag.yaml"
    recipe_file.write_text(
        "version: 1\nstrategy: ask-many\ncontext:\n  files: [docs/lighthouse.txt, 'docs/b*.md']\n"
        "questions:\n  - What is the cat called?\nretrieve: 2\nchunk_tokens: 32\n"
    )
    recipe = load_recipe(str(recipe_file))
    assert recipe.context.files == ["docs/lighthouse.txt", "docs/b*.md"]
    again = tmp_path / "again.yaml"
    again.write_text(dump_recipe(recipe))
    reloaded = load_recipe(str(again))
    assert (reloaded.context.files, reloaded.retrieve, reloaded.chunk_tokens) == (recipe.context.files, 2, 32)
    result = mdcli("run", str(recipe_file), "-n", "6", "--jsonl")
    start = json.loads(result.stdout.splitlines()[0])
    assert {Path(s["path"]).name for s in start["branches"][0]["sources"]} <= {"lighthouse.txt", "bicycle.md", "budget.md"}
    assert start["branches"][0]["sources"][0]["path"].startswith("docs/")


def test_a_recipe_whose_context_files_match_nothing_is_refused_in_one_line(tmp_path):
    recipe_file = tmp_path / "rag.yaml"
    recipe_file.write_text("version: 1\nstrategy: ask-many\ncontext: {files: ['*.nothing']}\nquestions:\n  - Why?\n")
    result = mdcli("run", str(recipe_file))
    assert result.exit_code == 2
    assert "context.files" in result.stderr and "matches no file" in result.stderr


def test_ask_many_with_retrieve_saved_as_a_recipe_runs_again_to_the_same_tokens(tmp_path):
    shutil.copytree(CORPUS, tmp_path / "docs")
    saved = tmp_path / "saved.yaml"
    questions = ["-q", "Who chaired the residents' meeting?", "-q", "How often should the chain be oiled?"]
    first = mdcli("ask-many", str(tmp_path / "docs"), *questions, "--retrieve", "2", "--chunk-tokens", "48", "-n", "8",
                  "--save-recipe", str(saved), "--jsonl")
    assert "retrieve: 2" in saved.read_text() and "chunk_tokens: 48" in saved.read_text()
    again = mdcli("run", str(saved), "--input", str(tmp_path / "docs"), "--jsonl")
    assert finishes_of(first) == finishes_of(again)
    plain = mdcli("ask-many", str(tmp_path / "docs"), *questions, "--retrieve", "2", "--chunk-tokens", "48", "-n", "8",
                  "--jsonl", "--speculate", "off")
    assert finishes_of(plain) == finishes_of(first)


def test_explain_retrieve_draws_the_passages_questions_share(tmp_path):
    shutil.copytree(CORPUS, tmp_path / "docs")
    recipe_file = tmp_path / "rag.yaml"
    recipe_file.write_text(
        "version: 1\nstrategy: ask-many\ncontext: {files: [docs]}\n"
        "questions:\n  - What is the name of the keeper's cat?\n  - How long should the apple cake bake?\n"
    )
    result = mdcli("explain", str(recipe_file), "--retrieve", "4", "--chunk-tokens", "32")
    assert result.exit_code == 0, result.output
    # each question's own run starts with its first passage's tag, "[n] docs/..."
    assert "2 branches" in result.stdout and "] docs" in result.stdout
    refused = mdcli("explain", "follow-ups", "--retrieve", "2")
    assert refused.exit_code == 2 and "--retrieve applies to an ask-many recipe" in refused.stderr


# -- think with a context --------------------------------------------------------------------


def test_think_with_context_documents_reads_them_before_the_question_and_stays_exact(embedded):
    from mdcli.api import Think, think
    from tests.test_think import assert_exact_branches_equal_generate

    documents = corpus()[:2]
    job = Think(question="Which project went over budget?", documents=documents, paths=2,
                path_instructions=["Answer briefly.", "Quote the document."], max_new_tokens=10, conclusion_tokens=10)
    events = list(think(embedded, job))
    assert_exact_branches_equal_generate(embedded.model, events)
    for branch in events[0].branches:
        text = embedded.tokenizer.decode(branch.prompt_token_ids)
        assert text.index(f"# {documents[0].path}") < text.index(f"# {documents[1].path}") < text.index("Which project")


def test_think_context_flag_takes_a_folder(tmp_path):
    shutil.copytree(CORPUS, tmp_path / "docs")
    result = mdcli("think", "Who won the chess tournament?", "--context", str(tmp_path / "docs" / "chess.txt"),
                   "--paths", "1", "--merge", "none", "-n", "6", "--jsonl")
    assert result.exit_code == 0, result.output
    prompt = json.loads(result.stdout.splitlines()[0])["branches"][0]["prompt_token_ids"]
    assert len(prompt) > 80  # the chess report came before the question


def test_a_margins_recipe_over_several_inputs_gives_each_document_its_segment_group():
    from mdcli.api import Document
    from mdcli.recipes import load_recipe
    from mdcli.recipes.margins import margins_job

    documents = [Document("a.txt", "Alpha.\n"), Document("notes/b.md", "Bravo.\n")]
    job = margins_job(load_recipe("margins"), input_text=documents)
    assert (job.documents, job.names) == (["Alpha.\n", "Bravo.\n"], ["a.txt", "notes/b.md"])
    assert margins_job(load_recipe("margins"), input_text=documents[:1]).documents == ["Alpha.\n"]


def test_a_question_that_retrieves_nothing_gets_a_note_in_every_output(tmp_path):
    # issue 53: it got no Sources line and no note, and the model invented an answer
    question, unrelated = "How often should the chain be oiled?", "Who is Zorblax?"
    args = ["ask-many", str(CORPUS), "-q", question, "-q", unrelated, "--retrieve", "2", "-n", "4"]
    plain = mdcli(*args, "-o", "plain")
    assert plain.exit_code == 0, plain.output
    notes = [line for line in plain.stderr.splitlines() if line.startswith("retrieval: ")]
    assert len(notes) == 1 and "'Who is Zorblax?' shares no word with the documents" in notes[0]
    records = [json.loads(line) for line in mdcli(*args, "--jsonl").stdout.splitlines()]
    assert [r["data"] for r in records if r["type"] == "note" and r["kind"] == "retrieval"] == [
        {"question": unrelated, "passages": 0}]
    recipe = tmp_path / "saved.yaml"
    saved = mdcli(*args, "-o", "plain", "--save-recipe", str(recipe))  # the recipe's run says it too
    assert [line for line in saved.stderr.splitlines() if line.startswith("retrieval: ")] == notes
