"""The benchmark compares equal work: every approach produces the forest's tokens, and the
report records the machine. (Speed itself is recorded in BENCHMARKS.md, never asserted here.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from mdcli.backends.select import KernelChoice, select
from mdcli.backends.weights import gguf_blocks
from mdcli.bench.ask import APPROACHES, Case, run_case
from mdcli.bench.harness import random_model
from mdcli.cli.app import app
from tests.test_engine_exactness import settings_with


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
    assert report["machine"]["cpu"] and report["machine"]["avx512"] in (True, False)  # every table names the host
    assert report["machine"]["mdcli_kernels"] in ("oneDNN", "torch") and report["machine"]["mdcli_kernels_reason"]
    assert len(report["results"]) == 2 * len(APPROACHES)
    assert all(r["same_tokens_as_forest"] for r in report["results"])
    assert all(r["forest_speedup"] > 0 for r in report["results"])
    assert report["process_peak_rss_bytes"] > 0  # one figure for the whole process, not per row
    assert all("rss" not in key for r in report["results"] for key in r)
    assert "Peak RSS of the whole bench process" in result.stdout


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
    assert result.stderr.strip() == "mdcli: error: unknown approach 'magic'; choose from forest, sequential, batched, prefix-copy, forest+speculate, hf-prompt-lookup, forest-no-blocks, forest-no-graphs, forest-int8"


def test_kernel_benchmark_reports_both_kernels_agreeing_to_float32_rounding():
    from mdcli.bench.kernels import attention_table, linear_table

    linear_row = linear_table([2], repeats=1).splitlines()[-1].split("|")
    attention_row = attention_table([(4, 40)], repeats=1).splitlines()[-1].split("|")
    assert linear_row[1].strip() == "2" and float(linear_row[5]) < 1e-5
    assert attention_row[1].strip() == "4 x 40" and float(attention_row[5]) < 1e-5


@pytest.mark.skipif(gguf_blocks.library() is None, reason="the block kernel does not build on this CPU")
def test_wide_block_benchmark_reports_the_blocks_agreeing_with_the_float32_weights():
    """`--blocks-wide`: one layer of the embedded model's blocks against its float32 weights, a row
    per M with every kernel's time and the largest relative difference (float32 rounding at most)."""
    from mdcli.bench.kernels import blocks_wide_table

    header, _, row = blocks_wide_table([9], repeats=1, tile_rows=[256]).splitlines()
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == len(header.strip("|").split("|"))
    assert cells[0] == "9" and float(cells[-1]) < 1e-5 and cells[-2].endswith("x")


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


def test_bench_reports_the_forest_step_against_transformers_own_single_sequence_step(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--random-model", "tiny", "--branches", "1,2", "--context", "40",
                                      "--new-tokens", "3", "--no-warmup", "--quiet", "--approaches", "forest,sequential",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    forests = [r for r in rows if r["approach"] == "forest"]
    assert [r["branches"] for r in forests] == [1, 2]
    for r in forests:
        assert r["reference_step_ms"] > 0
        # all three are rounded to 2 decimals: the ratio lies between what the rounded ms allow
        low = (r["step_ms"] - 0.005) / (r["reference_step_ms"] + 0.005)
        high = (r["step_ms"] + 0.005) / (r["reference_step_ms"] - 0.005)
        assert low - 0.005 <= r["step_vs_reference"] <= high + 0.005
    assert all(r["reference_step_ms"] is None for r in rows if r["approach"] == "sequential")
    assert "single-sequence step" in result.output and "1 branch" in result.output and "2 branches" in result.output


def test_weight_bytes_count_a_tied_embedding_once(embedded_float32):
    from mdcli.bench.ask import weight_bytes

    model = embedded_float32.model  # SmolLM2 ties its output head to the input table
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


def test_whole_process_bench_times_real_commands_that_all_produce_mdclis_tokens(tmp_path):
    """Each row is a fresh process (mdcli ask-many, mdcli with one question, and the plain-transformers
    script three ways), timed once a repeat after an untimed one picked the longest question; the report names the CPU and the branching overhead, and every approach
    reproduced mdcli's tokens (equal work)."""
    out = tmp_path / "whole.json"
    result = CliRunner().invoke(app, ["bench", "--whole-process", "--branches", "2", "--context", "120",
                                      "--new-tokens", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "AVX-512: " in result.stdout and "Branching overhead" in result.stdout
    assert "**NO**" not in result.stdout
    report = json.loads(out.read_text())
    runs = {run["approach"]: run for run in report["runs"]}
    assert list(runs) == ["mdcli, 2 questions", "mdcli, longest question alone", "sequential", "batched", "prefill-once"]
    # one timed process per row and repeat: the run that picked the longest question (cold) is not among them
    assert [len(run["seconds"]) for run in runs.values()] == [1] * 5
    mdcli_tokens = runs["mdcli, 2 questions"]["token_ids"]
    assert len(mdcli_tokens) == 2 and all(0 < len(t) <= 4 for t in mdcli_tokens)
    for mode in ("sequential", "batched", "prefill-once"):
        assert runs[mode]["token_ids"] == mdcli_tokens, mode


def test_whole_process_report_states_the_overhead_against_each_reference_and_checks_its_tokens():
    """With --slowest-reference the report gives a second overhead, against the question that took
    the most forwards alone, and that row must reproduce that question's own tokens from the forest."""
    from mdcli.bench.whole_process import ProcessRun, markdown

    forest = ProcessRun("mdcli, 2 questions", [20.0], [[1, 2, 3, 4], [5, 6]],
                        {"prefill": 1.0, "decode": 4.0, "steps": 40, "step_ms": 100.0})
    longest = ProcessRun("mdcli, longest question alone", [16.0], [[1, 2, 3, 4]],
                         {"prefill": 0.5, "decode": 1.5, "steps": 24, "step_ms": 62.5, "question": "where?", "index": 0})
    slowest = ProcessRun("mdcli, slowest question alone", [18.0], [[5, 6]],
                         {"prefill": 0.5, "decode": 3.5, "steps": 46, "step_ms": 76.1, "question": "mood?", "index": 1,
                          "forwards alone": [24, 46]})
    report = markdown([forest, longest, slowest], 2, 64, 1700, 1)
    assert '/ the longest-answering one alone, "where?"): **1.25x**' in report
    assert '/ the one that takes the most forwards alone (each alone: [24, 46]), "mood?"): **1.11x**' in report
    assert "**NO**" not in report
    slowest.token_ids = [[5, 7]]
    assert "| mdcli, slowest question alone | 18.0 | 0.90 | **NO** |" in markdown([forest, longest, slowest], 2, 64, 1700, 1)


def test_step_benchmark_times_both_forwards_and_its_profile_accounts_for_the_whole_step():
    from mdcli.bench.step import (
        EngineStepper,
        ReferenceStepper,
        StepProfile,
        median_step_seconds,
    )

    lm = random_model("tiny")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12]]
    steppers = {"reference": ReferenceStepper(lm, prompts[0]),
                "transformers": EngineStepper(lm, prompts, "transformers"),
                "mdcli": EngineStepper(lm, prompts, "mdcli")}
    assert steppers["mdcli"].engine.model_forward.own is not None
    assert steppers["transformers"].engine.model_forward.own is None
    assert all(seconds > 0 for seconds in median_step_seconds(steppers, 2).values())
    profile = StepProfile(lm)
    median_step_seconds({"mdcli": EngineStepper(lm, prompts, "mdcli")}, 2, observe=profile.observe)
    parts = dict(profile.table())
    assert parts["linears"] > 0 and parts["attention"] > 0 and parts["lm_head"] > 0
    assert abs(sum(ms for name, ms in parts.items() if name != "step") - parts["step"]) < 1e-6


def test_a_partial_step_profile_times_only_its_parts_by_name_and_leaves_the_rest_to_the_glue():
    from mdcli.bench.step import EngineStepper, StepProfile, median_step_seconds

    lm = random_model("tiny")
    lm.forward.plan = select(lm.model, settings_with(cpu_kernels="auto"))  # this host's own plan, whatever the environment forces
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12]]
    profile = StepProfile(lm, parts=("linears", "lm_head", "attention"))
    median_step_seconds({"mdcli": EngineStepper(lm, prompts, "mdcli")}, 2, observe=profile.observe)
    parts = dict(profile.table())
    assert list(parts) == ["linears", "lm_head", "attention", "Python and dispatch glue (the rest)", "step"]
    assert parts["linears"] > 0 and parts["lm_head"] > 0 and parts["attention"] > 0
    assert parts["Python and dispatch glue (the rest)"] > 0, "norms, rotary and the cache's writes are glue now"
    # by name only: transformers' forward, whose products and attention are torch functions, shows
    # none, on a plan that leaves its linears to torch (an AVX-512 host's plan routes them through
    # mdcli's own oneDNN linears, which are timed by name: forced off here, so this holds on every host)
    lm.forward.plan = replace(lm.forward.plan, linears=KernelChoice("torch", "this test's"))
    by_name = StepProfile(lm, parts=("linears", "lm_head", "attention"))
    median_step_seconds({"transformers": EngineStepper(lm, prompts, "transformers")}, 2, observe=by_name.observe)
    assert dict(by_name.table())["linears"] == 0 and dict(by_name.table())["attention"] == 0
    with pytest.raises(ValueError, match="no part 'softmax'"):
        StepProfile(lm, parts=("softmax",))


def test_step_benchmark_steps_on_the_cpu_unless_told_names_it_and_refuses_a_profile_elsewhere(capsys):
    from mdcli.backends.host import cpu_model
    from mdcli.bench.step import main

    main(["--random-model", "tiny", "--branches", "1,2", "--steps", "2", "--context", "40", "--forwards", "mdcli"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"host: {cpu_model()}") and first.endswith("steps on cpu")
    with pytest.raises(SystemExit) as refused:
        main(["--device", "cuda", "--profile"])
    assert refused.value.code == 2
    # on a GPU machine the profile is what is refused; without one, the device itself
    expected = "--profile times the parts of a CPU step" if torch.cuda.is_available() else "CUDA is not available"
    assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:
        main(["--device", "tpu"])
    assert unknown.value.code == 2 and "unknown device 'tpu'" in capsys.readouterr().err


def test_step_benchmark_variants_name_the_forwards_choices_and_guesses_feed_a_speculative_chain():
    from mdcli.bench.step import EngineStepper

    lm = random_model("tiny")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12]]
    plain = EngineStepper(lm, prompts, "mdcli:bmm:packed")
    ahead = EngineStepper(lm, prompts, "mdcli:bmm:packed+ahead", guesses=2)
    assert not plain.engine.model_forward.own.read_ahead and ahead.engine.model_forward.own.read_ahead
    before = len(ahead.engine)
    ahead.step()
    plain.step()
    assert len(ahead.engine) == before + 2 * 3, "each branch's token and its two guesses"
    assert ahead.engine.forwards == plain.engine.forwards


def test_the_fused_step_variant_attends_on_the_kernel_where_the_plan_would_not():

    from mdcli.backends.attention import fused
    from mdcli.bench.step import EngineStepper

    lm = random_model("tiny")
    if not fused.fused_serves(lm.model.config.hidden_size // lm.model.config.num_attention_heads):
        pytest.skip("mdcli's attention kernel does not build or serve this head size here")
    auto = select(lm.model, settings_with(cpu_kernels="auto"))  # this host's own plan, whatever the environment forces
    lm.forward.plan = replace(auto, fused_attention=False)  # as on an Intel AVX-512 host
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12]]
    steppers = {name: EngineStepper(lm, prompts, name) for name in ("mdcli", "mdcli+fused")}
    for stepper in steppers.values():
        stepper.step()
    assert steppers["mdcli"].engine.model_forward.own.fused_forwards == 0
    assert steppers["mdcli+fused"].engine.model_forward.own.fused_forwards >= 1, "the two-branch step on the kernel"


def test_the_margins_questions_bench_compares_equal_work_and_reports_every_phase(capsys):
    from mdcli.bench.margins import bench_document
    from mdcli.bench.margins_questions import compare_questions, run_stage

    lm = random_model("tiny")
    document = bench_document(lm.tokenizer, 200)
    limits = {"margin_tokens": 3, "classify_tokens": 2, "answer_tokens": 3}
    assert compare_questions(lm, document, 3, 64, limits)
    table = capsys.readouterr().out
    for row in ("total, s", "margins, s", "classification, s", "answers, s", "identical tokens (every branch) | 3/3",
                "warm-up (untimed)"):
        assert row in table
    together = run_stage(lm, document, ["A?", "B?"], 64, limits)
    assert set(together.phases) == {"margins", "classification", "answers"} and len(together.tokens) == 2


def test_the_margins_questions_bench_speculates_on_both_sides_when_asked(capsys):
    from mdcli.bench.margins import bench_document
    from mdcli.bench.margins_questions import compare_questions

    lm = random_model("tiny")
    limits = {"margin_tokens": 6, "classify_tokens": 2, "answer_tokens": 6}
    assert compare_questions(lm, bench_document(lm.tokenizer, 200), 2, 64, limits, speculate="4")
    table = capsys.readouterr().out
    assert "--speculate 4 on both sides" in table and "identical tokens (every branch) | 2/2" in table


def test_a_repeat_run_last_to_first_reports_its_approaches_in_the_order_asked():
    lm = random_model("tiny")
    asked = ("forest", "sequential", "prefix-copy")
    results = run_case(lm, Case(2, 40, 4), asked, reverse=True)
    assert [r.approach for r in results] == list(asked)
    assert all(r.matches_forest for r in results)


def test_ratios_over_repeats_are_taken_pair_by_pair_so_a_drifting_machine_cannot_tip_them():
    from mdcli.bench.ask import Measurement
    from mdcli.bench.report import combine_repeats, rows

    case = Case(1, 40, 4)

    def run(forest_seconds, other_seconds):
        return [Measurement("forest", case, forest_seconds, 1, [[1]]), Measurement("sequential", case, other_seconds, 1, [[1]])]

    # the other approach is 10% slower within every pair; the third pair ran on a machine 3x slower for the forest
    table = rows(combine_repeats([run(10.0, 11.0), run(20.0, 22.0), run(30.0, 33.0)]))
    assert table[1]["forest_speedup"] == 1.1
    assert table[1]["repeat_seconds"] == [11.0, 22.0, 33.0]  # kept in the JSON, so others can pair them too
    skewed = rows(combine_repeats([run(10.0, 11.0), run(20.0, 22.0), run(90.0, 9.0)]))
    assert skewed[1]["forest_speedup"] == 1.1  # the ratio of the medians would say 11 / 20 = 0.55


def test_the_int8_forest_runs_beside_the_float32_one_and_is_not_held_to_its_tokens(tmp_path):
    from mdcli.backends.weights.int8 import has_int8_weights
    from mdcli.bench.ask import int8_copy

    lm = random_model("tiny")
    run_case(lm, Case(2, 40, 2), ("forest",))  # a forest first: it may leave weight copies on the model
    results = {r.approach: r for r in run_case(lm, Case(2, 40, 4), ("forest", "forest-int8"))}
    assert results["forest"].matches_forest and results["forest-int8"].matches_forest is None
    assert all(len(t) == 4 for t in results["forest-int8"].tokens)
    assert has_int8_weights(int8_copy(lm).model) and not has_int8_weights(lm.model)  # the float32 model untouched
    assert int8_copy(lm) is int8_copy(lm)  # quantized once per model


def test_the_forest_without_blocks_runs_beside_the_forest_and_must_give_its_tokens(embedded_float32):
    """forest-no-blocks: the embedded_float32 model's forest on the float32 kernels only (a plan chosen
    with gguf_blocks off for that run, the environment untouched and the loaded model's plan kept),
    the same weights, so the same tokens are required."""
    import os

    from mdcli.backends.select import select
    from mdcli.backends.weights.gguf_blocks import blocks_work, library

    environment = dict(os.environ)
    forward, plan = embedded_float32.forward, embedded_float32.forward.plan
    results = {r.approach: r for r in run_case(embedded_float32, Case(2, 40, 4), ("forest", "forest-no-blocks"))}
    assert results["forest-no-blocks"].matches_forest is True
    assert dict(os.environ) == environment
    serving = "Q4_1/Q8_0" if library() is not None and blocks_work() else None
    assert embedded_float32.forward is forward and embedded_float32.forward.plan is plan and plan.blocks == serving
    assert (embedded_float32.forward.own.blocks is not None) == (serving is not None)
    assert select(embedded_float32.model).blocks == serving  # read again after it

