"""`mdcli info`: the host, the versions, the settings that differ from their defaults, and the plan
chosen for a model with its reasons, as text and as JSON; a run's header names the plan only
with --verbose."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mdcli.cli.app import app
DOCUMENT = "Mara kept the lighthouse on the coast of Brittany. Every night she climbed its steps."


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def test_info_without_a_model_names_the_host_and_versions_as_json():
    result = invoke("info", "--no-model", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    host = report["host"]
    assert {"cpu", "isa", "avx512", "cores", "memory_bytes", "gpus", "torch", "transformers"} <= set(host)
    assert host["cores"] >= 1 and isinstance(host["avx512"], bool)
    assert "plan" not in report and "model" not in report


def test_info_shows_the_settings_that_differ_from_their_defaults():
    result = invoke("info", "--no-model", "--json", env={"MDCLI_CPU_KERNELS": "torch"})
    assert json.loads(result.stdout)["settings"]["MDCLI_CPU_KERNELS"] == "torch"


def test_a_bad_setting_stops_info_with_exit_2_and_one_line():
    result = invoke("info", "--no-model", env={"MDCLI_TILED_GEMM": "sometimes"})
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "MDCLI_TILED_GEMM" in result.stderr


def test_info_prints_the_plan_chosen_at_load_with_its_reasons(embedded):
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    plan = embedded.forward.plan
    assert report["plan"]["description"] == plan.describe()
    assert report["plan"]["own_forward"] is True  # the embedded model is a Llama
    assert report["model"]["name"] == embedded.name
    text = invoke("info").stdout
    assert f"kernels: {plan.describe()}" in text
    assert "forward: mdcli's own" in text


def test_the_run_header_is_one_short_line_and_names_the_plan_only_with_verbose(embedded):
    base = ["ask-many", "-", "-q", "Who?", "-n", "2", "-o", "plain", "--speculate", "off"]
    short = CliRunner().invoke(app, base, input=DOCUMENT)
    verbose = CliRunner().invoke(app, [*base, "--verbose"], input=DOCUMENT)
    assert short.exit_code == verbose.exit_code == 0, short.output + verbose.output
    short_header = next(line for line in short.stderr.splitlines() if line.startswith(embedded.name))
    verbose_header = next(line for line in verbose.stderr.splitlines() if line.startswith(embedded.name))
    assert "kernels" not in short_header and short_header.count(" · ") == 2  # model · device · dtype (why)
    assert verbose_header.startswith(short_header) and f"kernels {embedded.forward.describe()}" in verbose_header
