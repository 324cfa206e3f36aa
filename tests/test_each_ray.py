"""ask-many --each on Ray (issue 51): actors pulling documents from one queue, the same tokens as one
process, an actor killed mid-run costing nothing but time. A real local Ray cluster of two CPUs,
started once for this module; tiny models, so each actor loads in a few seconds."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mdcli import api
from mdcli.cli.app import app
from mdcli.events import DocumentDone, Note

ray = pytest.importorskip("ray", reason='Ray is the optional extra pip install "mdcli[ray]" (in .[test])')

from mdcli.distributed.ray_each import RayEach  # noqa: E402
from tests.test_each import QUESTIONS, answered, invoices  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_an_actor_killed_mid_run_loses_nothing_and_answers_nothing_twice(cluster, tiny_dir, tmp_path):
    folder = str(tiny_dir("llama"))
    paths = invoices(tmp_path / "docs", 8)
    inputs = api.read_inputs([str(tmp_path / "docs")])
    job = api.AskMany(questions=QUESTIONS, max_new_tokens=6)
    runner = RayEach(api.LoadOptions(model=folder), job, inputs, workers=2, chunk_documents=1)
    events, killed = [], False
    for event in runner.events():
        events.append(event)
        if isinstance(event, DocumentDone) and not killed:
            ray.kill(runner.actors[0])  # it holds a document, or is handed one next
            killed = True
    done = [e for e in events if isinstance(e, DocumentDone)]
    assert sorted(e.document.path for e in done) == sorted(str(p) for p in paths)  # each once
    assert [e.kind for e in events if isinstance(e, Note)] == ["worker"]  # the death was seen and survived
    model = api.load_model(folder, quiet=True)
    assert answered(done) == answered(api.ask_each(model, paths, QUESTIONS, max_new_tokens=6))


def test_workers_on_the_command_line_write_the_results_file_a_single_process_writes(cluster, tiny_dir, tmp_path):
    folder = str(tiny_dir("llama"))
    invoices(tmp_path / "docs", 4)
    args = ["ask-many", str(tmp_path / "docs"), "--each", "-q", QUESTIONS[0], "-q", QUESTIONS[1], "-n", "5", "-m",
            folder]
    env = {"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    on_ray = CliRunner().invoke(app, [*args, "--workers", "2", "--output", str(tmp_path / "ray.jsonl")], env=env)
    here = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "here.jsonl")], env=env)
    assert (on_ray.exit_code, here.exit_code) == (0, 0), on_ray.stderr + here.stderr

    def records(name: str) -> list[dict]:
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for row in rows:  # a sum of float32 logprobs, in forests of other shapes: equal up to rounding
            row["cumulative_logprob"] = round(row["cumulative_logprob"], 3)
        return sorted(rows, key=lambda r: (r["index"], r["question"]))

    assert records("ray.jsonl") == records("here.jsonl")
    again = CliRunner().invoke(app, [*args, "--workers", "2", "--output", str(tmp_path / "ray.jsonl")], env=env)
    assert "4 of 4 documents already answered" in again.stderr and again.stdout == ""
