"""The benchmark compares equal work: every approach produces the forest's tokens, and the
report records the machine. (Speed itself is recorded in BENCHMARKS.md, never asserted here.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mdcli.bench import random_model
from mdcli.bench.ask import APPROACHES, Case, run_case
from mdcli.cli import app


def test_every_approach_generates_the_forests_tokens_on_a_random_model():
    lm = random_model("tiny")
    for case in (Case(1, 40, 5), Case(3, 120, 6)):
        results = run_case(lm, case)
        assert [r.approach for r in results] == list(APPROACHES)
        for result in results:
            assert result.matches_forest, result.approach
            assert all(len(t) == case.new_tokens for t in result.tokens)


def test_the_forest_holds_one_copy_of_the_document_and_the_copies_hold_one_per_branch():
    lm = random_model("tiny")
    results = {r.approach: r for r in run_case(lm, Case(4, 200, 4), ("forest", "prefix-copy"))}
    assert results["prefix-copy"].kv_bytes > 3 * results["forest"].kv_bytes


def test_bench_command_writes_json_with_machine_facts_and_ratios(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--branches", "1,2", "--context", "50",
                                      "--new-tokens", "3", "--no-warmup", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["machine"]["torch_threads"] == 1 and "load_average_1m" in report["machine"]
    assert len(report["results"]) == 2 * len(APPROACHES)
    assert all(r["same_tokens_as_forest"] for r in report["results"])
    assert all(r["forest_speedup"] > 0 for r in report["results"])


def test_bench_can_give_the_alternatives_mdclis_kernels_and_records_which_ran(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--branches", "2", "--context", "40",
                                      "--new-tokens", "3", "--no-warmup", "--quiet", "--baseline-kernels", "mdcli",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["machine"]["baseline_kernels"] == "mdcli"
    assert report["machine"]["mdcli_kernels"] in ("oneDNN", "torch")
    assert all(r["same_tokens_as_forest"] for r in report["results"])


def test_bench_rejects_unknown_baseline_kernels_in_one_line():
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--baseline-kernels", "fast"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "mdcli: error: unknown --baseline-kernels 'fast'; choose stock or mdcli"


def test_bench_rejects_an_unknown_approach_in_one_line():
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--approaches", "forest,magic"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "mdcli: error: unknown approach 'magic'; choose from forest, sequential, batched, prefix-copy, forest+speculate, hf-prompt-lookup"


def test_kernel_benchmark_reports_both_kernels_agreeing_to_float32_rounding():
    from mdcli.bench.kernels import attention_table, linear_table

    linear_row = linear_table([2], repeats=1).splitlines()[-1].split("|")
    attention_row = attention_table([(4, 40)], repeats=1).splitlines()[-1].split("|")
    assert linear_row[1].strip() == "2" and float(linear_row[5]) < 1e-5
    assert attention_row[1].strip() == "4 x 40" and float(attention_row[5]) < 1e-5


def test_bench_reports_what_a_decode_step_reads_and_its_share_of_a_given_peak(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--branches", "2", "--context", "40",
                                      "--new-tokens", "3", "--no-warmup", "--quiet", "--approaches", "forest,sequential",
                                      "--peak-bandwidth", "100", "--json", str(out)])
    assert result.exit_code == 0, result.output
    forest, sequential = json.loads(out.read_text())["results"]
    assert forest["step_read_gbps"] > 0
    assert forest["step_bandwidth_fraction"] == round(forest["step_read_gbps"] / 100, 3)
    assert sequential["step_read_gbps"] is None


def test_weight_bytes_count_a_tied_embedding_once(embedded):
    from mdcli.bench.ask import weight_bytes

    model = embedded.model  # SmolLM2 ties its output head to the input table
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    assert weight_bytes(model) == sum(unique.values())


def test_weight_bytes_skip_an_untied_input_table():
    from mdcli.bench.ask import weight_bytes

    lm = random_model("tiny")  # untied: the input table is not read whole by a step
    model = lm.model
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == every - table.numel() * table.element_size() + buffers
