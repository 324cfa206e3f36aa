"""RunOptions: one road for the engine's options, from a flag, a recipe or an API call to core.

Every strategy takes it; one that cannot honour an option refuses it in one line with its reason
(beam search and explore do not speculate), never dropping it.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mdcli import api
from mdcli.cli.app import app
from mdcli.errors import UsageError
from mdcli.events import Finish
from mdcli.speculative.planner import Speculate

runner = CliRunner()


def test_run_options_parse_speculate_and_refuse_bad_values_in_one_line():
    assert api.RunOptions().speculate == Speculate("off")  # the API's default; the command line's is auto
    assert api.RunOptions(speculate="4").speculate == Speculate("fixed", 4)
    with pytest.raises(UsageError, match="max_forward_tokens must be at least 1"):
        api.RunOptions(max_forward_tokens=0)
    with pytest.raises(UsageError, match="unknown|Extra inputs"):
        api.RunOptions(forward_budget=8)


@pytest.mark.parametrize("call", ["beam", "explore"])
def test_beam_search_and_explore_refuse_speculation_with_the_reason(embedded, call):
    run = {
        "beam": lambda **options: api.beam_search(embedded, "Say hi.", max_new_tokens=2, **options),
        "explore": lambda **options: api.explore(embedded, "Say hi.", max_new_tokens=2, **options),
    }[call]
    for options in ({"speculate": "4"}, {"options": api.RunOptions(speculate="auto")}):
        with pytest.raises(UsageError) as refused:
            run(**options)
        assert "does not take speculate" in str(refused.value) and "ranked" in str(refused.value)
        assert "\n" not in str(refused.value)
    assert any(isinstance(event, Finish) for event in run(options=api.RunOptions(speculate="off")))


def test_options_and_their_keywords_give_the_same_tokens_and_not_both(embedded):
    story = "Tom has a red boat. He sails it on Sunday."
    by_keywords = list(api.ask_many(embedded, story, ["What colour?"], max_new_tokens=6, max_forward_tokens=16))
    by_options = list(api.ask_many(embedded, story, ["What colour?"], max_new_tokens=6,
                                   options=api.RunOptions(max_forward_tokens=16)))
    assert [e.token_ids for e in by_keywords if isinstance(e, Finish)] == \
        [e.token_ids for e in by_options if isinstance(e, Finish)]
    with pytest.raises(TypeError, match="given twice"):
        api.ask_many(embedded, story, ["Who?"], options=api.RunOptions(), speculate="off")


def test_a_beam_recipe_run_with_speculate_is_refused_in_one_line_exit_2(tmp_path):
    recipe = tmp_path / "beam.yaml"
    recipe.write_text("version: 1\nstrategy: beam\nprompt: Say hi.\nwidth: 2\n", encoding="utf-8")
    result = runner.invoke(app, ["run", str(recipe), "--speculate", "4"])
    assert result.exit_code == 2
    assert "beam search does not speculate (its candidates are ranked across beams" in result.stderr
