"""explain: the forest layout computed without a model is the engine's layout, and the pictures
show exactly its mask (positions = depths, a token sees its ancestors and itself)."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from mdcli.cli.app import app
from mdcli.core.decoding import prefill_prompts
from mdcli.backends.forward import forward_for
from mdcli.core.engine import Engine
from mdcli.explain.forest import EMPTY, FILLED, TRIANGLE, edge_cell, edge_grid, plan_layout, token_grid

runner = CliRunner()


def show(token: int) -> str:
    return f"t{token}"


# -- the layout ------------------------------------------------------------------------------------


def test_two_branches_share_their_common_prefix_and_are_masked_from_each_other():
    #   slot:    0  1  2  3  4
    #   token:   1  2  3  4  5     prompts [1 2 3 4] and [1 2 5]
    #   depth:   0  1  2  3  2
    layout = plan_layout([[1, 2, 3, 4], [1, 2, 5]])
    assert layout.token_ids == [1, 2, 3, 4, 5]
    assert layout.depth == [0, 1, 2, 3, 2]
    assert layout.parent == [-1, 0, 1, 2, 1]
    assert layout.prompt_ends == [3, 4]
    assert layout.mask() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert [(e.prompts, e.slots, e.parent, e.ends) for e in layout.edges] == [
        ((0, 1), [0, 1], None, ()),
        ((0,), [2, 3], 0, (0,)),
        ((1,), [4], 0, (1,)),
    ]


def test_positions_are_depths_the_number_of_tokens_each_token_attends_to_before_itself():
    layout = plan_layout([[5, 6, 7, 8, 9], [5, 6, 1], [5, 2, 3], [4]])
    for slot, row in enumerate(layout.mask()):
        assert layout.depth[slot] == sum(row) - 1
        assert [key for key, allowed in enumerate(row) if allowed] == layout.path(slot)


def test_a_prompt_that_is_a_prefix_of_another_ends_inside_its_path():
    layout = plan_layout([[1, 2], [1, 2, 3]])
    assert layout.token_ids == [1, 2, 3]
    assert [(e.prompts, e.slots, e.ends) for e in layout.edges] == [((0, 1), [0, 1], (0,)), ((1,), [2], (1,))]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("max_forward_tokens", [1024, 16], ids=["one forward per level", "long edges in pieces"])
def test_the_model_free_layout_is_the_real_engines_layout(max_forward_tokens):
    prompts = [list(range(3, 40)), list(range(3, 20)) + [90, 91], list(range(3, 20)) + [92], [100, 101, 102]]
    engine = Engine(forward_for(tiny_llama()), max_forward_tokens=max_forward_tokens)
    results = prefill_prompts(engine, prompts)
    layout = plan_layout(prompts, max_forward_tokens=max_forward_tokens)
    assert layout.token_ids == engine.forest.tokens.tolist()
    assert layout.depth == engine.forest.depth.tolist()
    assert layout.parent == engine.forest.parent.tolist()
    assert layout.prompt_ends == [int(r.row.nonzero().max()) for r in results]
    if max_forward_tokens == 16:
        assert not all(edge.contiguous for edge in layout.edges)  # the case worth checking


# -- the pictures ------------------------------------------------------------------------------------


def test_the_token_grid_has_a_filled_cell_exactly_where_attention_is_allowed():
    lines = token_grid(plan_layout([[1, 2, 3, 4], [1, 2, 5]]), show)
    rows = [line for line in lines if re.match(r"\s+\d+\s+\d+\s+'t\d'", line)]
    assert [row.split() for row in rows] == [
        # slot, position, token, then one cell per key slot
        ["0", "0", "'t1'", FILLED, EMPTY, EMPTY, EMPTY, EMPTY],
        ["1", "1", "'t2'", FILLED, FILLED, EMPTY, EMPTY, EMPTY],
        ["2", "2", "'t3'", FILLED, FILLED, FILLED, EMPTY, EMPTY],
        ["3", "3", "'t4'", FILLED, FILLED, FILLED, FILLED, EMPTY],
        ["4", "2", "'t5'", FILLED, FILLED, EMPTY, EMPTY, FILLED],
    ]
    assert lines[1].endswith("key slot  0 1 2 3 4")
    assert lines[2].endswith("key pos  0 1 2 3 2")


def test_the_edge_grid_summarizes_the_token_mask_run_by_run():
    prompts = [list(range(3, 40)), list(range(3, 20)) + [90, 91], list(range(3, 10)) + [92], [100, 101]]
    layout = plan_layout(prompts, max_forward_tokens=16)
    mask = layout.mask()
    for query in layout.edges:
        for key in layout.edges:
            cells = [mask[q][k] for q in query.slots for k in key.slots]
            expected = TRIANGLE if query.id == key.id else FILLED if all(cells) else EMPTY
            assert edge_cell(layout, query.id, key.id) == expected
            assert expected != EMPTY or not any(cells)
    lines = edge_grid(layout, show)
    assert len(lines) == 3 + len(layout.edges)


def test_a_grid_row_shows_slots_positions_and_cells_for_each_run():
    lines = edge_grid(plan_layout([[1, 2, 3, 4], [1, 2, 5]]), show)
    assert [line.split()[:4] + line.split()[-3:] for line in lines[3:]] == [
        ["e0", "0–1", "0–1", "2", TRIANGLE, EMPTY, EMPTY],
        ["e1", "2–3", "2–3", "2", FILLED, TRIANGLE, EMPTY],
        ["e2", "4–4", "2–2", "1", FILLED, EMPTY, TRIANGLE],
    ]


# -- the command ---------------------------------------------------------------------------------------

TINY_RECIPE = """\
version: 1
strategy: tree
chat_template: false
context: {text: "Calc 5 - 3"}
branches:
  - label: colon
    prompt: "$context:"
    children:
      - {label: check, prompt: "Check it."}
  - label: equals
    prompt: "$context ="
"""


def test_explain_draws_the_tree_and_the_token_mask_of_a_tiny_recipe(tmp_path):
    from tests.tiny_models import tiny_tokenizer

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    result = runner.invoke(app, ["explain", str(recipe), "--tokens"])
    assert result.exit_code == 0, result.stderr

    tokenizer = tiny_tokenizer()
    colon = tokenizer("Calc 5 - 3:")["input_ids"]
    equals = tokenizer("Calc 5 - 3 =")["input_ids"]
    layout = plan_layout([colon, equals])
    text = result.stdout
    assert f"{len(colon) + len(equals)} prompt tokens in {len(layout)} cache slots" in text
    assert "↳ colon/check · forks after colon finishes" in text
    grid_rows = [line.split()[-len(layout):] for line in text.splitlines() if line.count(EMPTY) + line.count(FILLED)
                 >= len(layout) and re.match(r"\s*\d", line)]
    assert grid_rows == [[FILLED if allowed else EMPTY for allowed in row] for row in layout.mask()]


def test_explain_a_builtin_recipe_with_input_shows_shared_context_and_follow_ups(tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("Mara kept the lighthouse for thirty years.\n")
    result = runner.invoke(app, ["explain", "follow-ups", "--input", str(story), "--tokens"])
    assert result.exit_code == 0, result.stderr
    assert "shared by people, setting" in result.stdout
    assert "↳ people/goals · forks after people finishes" in result.stdout
    assert "more than the 48 a token grid can show" in result.stdout
    assert "Attention mask by run of shared tokens" in result.stdout


MARGINS_RECIPE = """version: 1
strategy: margins
context: {input: true}
questions:
- Which projects went over budget?
- What did the cafeteria change?
segment_tokens: 48
"""
REPORT = (
    "Quarterly project report.\n\n"
    "Project Falcon built a new loading dock for the warehouse. The budget was 200,000 dollars. It went over "
    "budget by 40,000 dollars because steel prices rose in March.\n\n"
    "Project Heron upgraded the office network. It finished on time and under budget.\n\n"
    "The cafeteria introduced a new menu with more vegetarian dishes. Most employees like the change.\n\n"
)


def test_explain_a_margins_recipe_with_two_questions_shows_one_copy_of_each_segment(tmp_path):
    from mdcli.cli.explain import load_tokenizer
    from mdcli.recipes import load_recipe, margins_job

    recipe, report = tmp_path / "margins.yaml", tmp_path / "report.txt"
    recipe.write_text(MARGINS_RECIPE)
    report.write_text(REPORT)
    result = runner.invoke(app, ["explain", str(recipe), "--input", str(report)])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())  # the tree wraps at the console width
    assert "2 questions x 3 segments; each segment is cached once" in text
    for i in (1, 2, 3):  # after segment i, both questions' margins of it hang off the same tokens
        assert f"shared by q1 segment {i}/3, q2 segment {i}/3" in text

    tokenizer = load_tokenizer(None, False)
    job = margins_job(load_recipe(recipe), input_text=REPORT)
    specs = job.margin_specs(tokenizer, job.segments(tokenizer))
    layout = plan_layout([s.prompt_ids for s in specs])
    for edge in layout.edges:
        if len(edge.prompts) == 1:  # a branch's own tokens: its question's instruction, no document text
            own = tokenizer.decode([layout.token_ids[slot] for slot in edge.slots])
            assert "Project" not in own and "cafeteria introduced" not in own
    for segment in job.segments(tokenizer):  # every segment's text is in the cache exactly once
        cached = tokenizer.decode(layout.token_ids)
        assert cached.count(segment.text.strip()[:40]) == 1


# -- into a pipe -----------------------------------------------------------------------------------


def explain_into(stdout, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mdcli", "explain", "follow-ups", "--input", "examples/story.txt", *args],
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


def test_explain_into_a_pipe_writes_each_line_whole_instead_of_wrapping_at_80_columns():
    import subprocess

    done = explain_into(subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    title = done.stdout.splitlines()[0]
    assert len(title) > 80 and title.endswith("(104 saved by sharing)")


@pytest.mark.parametrize("tokens", [[], ["--tokens"]])
def test_explain_into_a_closed_pipe_exits_0_quietly_like_every_command(tokens):
    import os

    read, write = os.pipe()
    os.close(read)  # what `| head -2` leaves once head has its lines
    try:
        done = explain_into(write, *tokens)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")
