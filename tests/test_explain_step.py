"""explain --speculate: a verified step is reported as the engine ran it (its mask rows, its
positions, what each branch accepted), and the picture draws exactly that."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from mdcli.api import run_specs
from mdcli.cli.app import app
from mdcli.events import Finish
from mdcli.explain.forest import EMPTY, FILLED
from mdcli.explain.step import ACCEPTED, NEXT, REJECTED, describe_step, first_verified_step
from mdcli.models.load import load_model
from mdcli.speculative.planner import Speculate, VerifiedBranch, VerifiedStep
from tests.test_speculate import STORY, tiny_specs

runner = CliRunner()


def contains_run(sequence: list[int], run: list[int]) -> bool:
    return any(sequence[i : i + len(run)] == run for i in range(len(sequence) - len(run) + 1))


def test_each_watched_step_holds_the_engine_rows_and_the_tokens_the_branch_then_emitted(tiny_dir):
    lm = load_model(str(tiny_dir("llama")), quiet=True)
    steps: list[VerifiedStep] = []
    events = list(run_specs(lm, tiny_specs(lm, children=True), strategy="test", compact_ratio=0.0,
                            speculate=Speculate("fixed", 8, watch=steps.append)))
    finished: dict[str, list[list[int]]] = {}
    for finish in (e for e in events if isinstance(e, Finish)):
        finished.setdefault(finish.label, []).append(finish.token_ids)

    assert steps and any(branch.accepted for step in steps for branch in step.branches)
    for step in steps:
        first = 0
        for branch in step.branches:
            own = range(first, first + len(branch.tokens))
            for i, sees in enumerate(branch.sees):
                assert set(sees) <= set(own)  # nothing of another branch
                assert first in sees and first + i in sees  # its next token and itself
                assert branch.depths[i] == branch.depths[0] + len(sees) - 1  # position = depth
                if i > 0:  # its parent sees exactly the same tokens but itself
                    assert any(set(branch.sees[j]) == set(sees) - {first + i} for j in range(i))
            assert branch.path_slots == branch.depths[0]  # the whole path before the step, nothing else
            if branch.next_token is not None:  # the next token, the accepted guesses, the model's own: in a row
                emitted = [branch.tokens[0]] + [branch.tokens[a] for a in branch.accepted] + [branch.next_token]
                assert any(contains_run(tokens, emitted) for tokens in finished[branch.label])
            first += len(branch.tokens)


def test_the_step_explained_is_the_first_that_accepted_a_guess(tiny_dir):
    lm = load_model(str(tiny_dir("llama")), quiet=True)

    def run(setting):
        return run_specs(lm, tiny_specs(lm, children=False), strategy="test", speculate=setting)

    every: list[VerifiedStep] = []
    list(run(Speculate("fixed", 6, watch=every.append)))
    chosen = first_verified_step(run, 6)
    first_accepting = next(s for s in every if any(b.accepted for b in s.branches))
    assert chosen.step == first_accepting.step
    assert chosen.branches == first_accepting.branches


def lighthouse_step() -> VerifiedStep:
    """The README's example: a branch at position 7 ('is') guesses 'a lighthouse keeper' and 'the
    keeper' (accepting 'a lighthouse'), beside a branch at position 5 with no guesses.
    Tokens: 1 is, 2 a, 3 lighthouse, 4 keeper, 5 the, 6 Where, 7 on."""
    guessing = VerifiedBranch(
        label="who", tokens=[1, 2, 3, 4, 5, 4], depths=[7, 8, 9, 10, 8, 9], drafts_from=1,
        sees=[[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 4], [0, 4, 5]], path_slots=7,
        accepted=[1, 2], next_token=7,
    )
    waiting = VerifiedBranch(label="where", tokens=[6], depths=[5], drafts_from=1, sees=[[6]], path_slots=5,
                             accepted=[], next_token=7)
    return VerifiedStep(step=3, cache_slots=12, branches=[guessing, waiting])


WORDS = {1: " is", 2: " a", 3: " lighthouse", 4: " keeper", 5: " the", 6: "Where", 7: " on"}


def test_the_picture_names_every_guess_what_was_accepted_and_draws_the_mask_rows():
    lines = describe_step(lighthouse_step(), WORDS.get, title="story")
    text = "\n".join(lines)
    assert "story: decode step 3, 2 branches fed 7 tokens in one forward over 12 cached slots" in text
    assert "who: next token ' is' at position 7; guessed ' a lighthouse keeper' · ' the keeper'" in text
    assert "accepted ' a lighthouse' (2 of 5 guessed tokens), then the model's own ' on'" in text
    assert "where: next token 'Where' at position 5; no guesses" in text
    rows = [line for line in lines if line.rstrip().endswith((FILLED, EMPTY)) and re.match(r"\s*\d", line)]
    marks = [next(m for m in (NEXT, ACCEPTED, REJECTED) if f" {m} " in row) for row in rows]
    assert marks == [NEXT, ACCEPTED, ACCEPTED, REJECTED, REJECTED, REJECTED, NEXT]
    cells = [row.split()[-7:] for row in rows]
    F, E = FILLED, EMPTY
    assert cells == [
        [F, E, E, E, E, E, E],
        [F, F, E, E, E, E, E],
        [F, F, F, E, E, E, E],
        [F, F, F, F, E, E, E],
        [F, E, E, E, F, E, E],
        [F, E, E, E, F, F, E],
        [E, E, E, E, E, E, F],
    ]
    assert [row.split()[0] for row in rows] == ["7", "8", "9", "10", "8", "9", "5"]


def test_a_step_too_wide_to_draw_keeps_the_branches_with_guesses_and_says_how_many_are_left_out():
    step = lighthouse_step()
    many = VerifiedStep(step=3, cache_slots=60, branches=[
        *[VerifiedBranch(label=f"w{i}", tokens=[6], depths=[5], drafts_from=1, sees=[[i]], path_slots=5,
                         accepted=[], next_token=7) for i in range(45)],
        VerifiedBranch(**{**step.branches[0].__dict__, "sees": [[45 + s for s in row] for row in
                                                                 step.branches[0].sees]}),
    ])
    text = "\n".join(describe_step(many, WORDS.get, title="wide"))
    assert "who: next token ' is' at position 7; guessed" in text
    assert "(3 more branches not drawn: the grid shows at most 48 tokens, branches with guesses first)" in text
    drawn = [line for line in text.splitlines()
             if re.match(r"\s*\d", line) and (f" {ACCEPTED} " in line or f" {REJECTED} " in line)]
    assert len(drawn) == 5 and all(len(line.split()[-48:]) == 48 for line in drawn)


RECIPE = """\
version: 1
strategy: tree
chat_template: false
context: {input: true}
sampling: {max_new_tokens: 24}
branches:
  - {label: copy, prompt: "$context\\nCopy the text above exactly:"}
  - {label: bell, prompt: "$context\\nWhat did Mara ring?"}
"""


def test_explain_speculate_draws_a_step_whose_rows_see_their_own_guesses_only(tmp_path, tiny_dir):
    recipe, story = tmp_path / "copy.yaml", tmp_path / "story.txt"
    recipe.write_text(RECIPE)
    story.write_text(STORY * 2)
    result = runner.invoke(app, ["explain", str(recipe), "--input", str(story), "--speculate", "6",
                                 "--model", str(tiny_dir("llama"))])
    assert result.exit_code == 0, result.stderr
    assert "copy.yaml with --speculate 6: decode step" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith((FILLED, EMPTY))
            and re.match(r"\s*\d", line)]
    assert rows
    branch_start = 0
    for row in rows:  # a row sees the fed tokens from its branch's next token down to itself
        position = int(row.split()[0])
        if f" {NEXT} " in row:
            branch_start = position
        assert row.count(FILLED) == position - branch_start + 1
    said = sum(int(n) for n in re.findall(r"accepted .* \((\d+) of \d+ guessed tokens\)", result.stdout))
    assert said == sum(f" {ACCEPTED} " in row for row in rows)


def test_explain_speculate_refuses_a_recipe_that_cannot_speculate_before_loading(tmp_path):
    recipe = tmp_path / "beam.yaml"
    recipe.write_text("version: 1\nstrategy: beam\nprompt: Hello\n")
    result = runner.invoke(app, ["explain", str(recipe), "--speculate", "4", "--model", "/nonexistent/model"])
    assert result.exit_code == 2
    assert "beam search does not speculate" in result.stderr


def test_explain_refuses_tokens_with_speculate_rather_than_ignoring_one(tmp_path):
    recipe = tmp_path / "copy.yaml"
    recipe.write_text(RECIPE)
    story = tmp_path / "story.txt"
    story.write_text(STORY)
    result = runner.invoke(app, ["explain", str(recipe), "--input", str(story), "--speculate", "4", "--tokens"])
    assert result.exit_code == 2
    assert "--tokens draws the forest's mask; --speculate draws one step" in result.stderr
