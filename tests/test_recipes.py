"""Recipes: the schema's one-line errors, compiling to branch specs, built-in recipes that run
exactly, and `ask-many --save-recipe` round-tripping through `mdcli run`.

No mocks: bad recipes are real files checked through the real CLI; runs use the embedded model
(the session fixture `embedded`), and every branch of a multi-level tree is compared with
`model.generate` on that branch's full path alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mdcli.api import run_specs
from mdcli.cli.app import app
from mdcli.errors import RecipeError
from mdcli.events import Done, Finish, Fork, Start
from mdcli.strategies.prompts import continuation_token_ids, prompt_token_ids
from mdcli.recipes import (
    AskManyRecipe,
    RecipeBase,
    Sampling,
    TreeRecipe,
    builtin_names,
    check_run_inputs,
    compile_recipe,
    dump_recipe,
    load_recipe,
    load_recipe_text,
    recipe_events,
    resolved_seed,
    strategy_names,
    with_sampling,
)
from tests.reference import generate_alone

STORY = (
    "Mara kept the lighthouse on Gull Island for thirty years. One winter night a fishing boat lost its "
    "engine in a storm, and the lamp's old motor failed at the same moment. Mara turned the great lens by "
    "hand until dawn, and the crew rowed safely into the harbor.\n"
)

runner = CliRunner()


def cli(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def story_file(tmp_path) -> Path:
    return write(tmp_path, "story.txt", STORY)



def run_recipe(lm, recipe, **compile_options):
    specs = compile_recipe(recipe, lm.tokenizer, **compile_options)
    return list(run_specs(lm, specs, strategy=recipe.strategy, seed=resolved_seed(recipe)))


# -- built-in recipes ---------------------------------------------------------------------------


def test_the_builtin_recipes_are_installed_as_package_data():
    from importlib.resources import files

    names = {entry.name for entry in files("mdcli.recipes.builtin").iterdir()}
    assert {"interview.yaml", "follow-ups.yaml", "summarize.yaml"} <= names
    assert {"interview", "follow-ups", "summarize"} <= set(builtin_names())


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_recipe_validates_and_has_a_description(name):
    result = cli("recipes", "validate", name)
    assert result.exit_code == 0, result.stderr
    assert load_recipe(name).description


def test_recipes_list_shows_each_name_with_its_description():
    result = cli("recipes", "list")
    assert result.exit_code == 0
    for name in builtin_names():
        line = next(line for line in result.stdout.splitlines() if line.startswith(name + " "))
        assert load_recipe(name).description.split()[0] in line


def test_recipes_show_prints_the_yaml_that_loads_to_the_same_recipe():
    result = cli("recipes", "show", "follow-ups")
    assert result.exit_code == 0
    assert load_recipe_text(result.stdout).model_dump() == load_recipe("follow-ups").model_dump()


@pytest.fixture(scope="module")
def builtin_run(embedded):
    """builtin_run(name) -> the events of that built-in recipe on STORY, greedy, at most
    NEW_TOKENS per branch; each recipe runs once per module (the tests below share the runs)."""
    runs: dict[str, list] = {}

    def run(name: str) -> list:
        if name not in runs:
            recipe = with_sampling(load_recipe(name), Sampling(max_new_tokens=NEW_TOKENS))
            runs[name] = list(recipe_events(recipe, embedded, input_text=STORY))
        return runs[name]

    return run


NEW_TOKENS = 10


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_recipe_runs_on_the_embedded_model(builtin_run, name):
    events = builtin_run(name)
    finishes = [e for e in events if isinstance(e, Finish)]
    if load_recipe(name).strategy not in ("ask-many", "tree"):  # beam, margins, think: their own events
        assert isinstance(events[0], Start) and isinstance(events[-1], Done) and finishes
        return
    announced = events[0].branches + [e.branch for e in events if isinstance(e, Fork)]
    assert len(finishes) == len(announced) == _count_branches(load_recipe(name))
    assert all(0 < len(f.token_ids) <= NEW_TOKENS for f in finishes)


def _count_branches(recipe) -> int:
    if isinstance(recipe, AskManyRecipe) and recipe.questions is not None:
        return len(recipe.questions)

    def count(branches):
        return sum(1 + count(b.children) for b in branches)

    return count(recipe.branches)


def test_each_branch_of_a_multi_level_tree_equals_generate_on_its_full_path_alone(embedded, builtin_run):
    events = builtin_run("follow-ups")
    start = events[0]
    assert isinstance(start, Start)
    infos = {b.id: b for b in start.branches}
    infos.update({e.branch.id: e.branch for e in events if isinstance(e, Fork)})
    assert sorted(info.label for info in infos.values()) == [
        "people", "people/goals", "people/relations", "setting", "setting/importance", "setting/mood",
    ]
    finishes = {e.branch: e for e in events if isinstance(e, Finish)}
    assert sorted(finishes) == sorted(infos)
    for branch_id, info in infos.items():
        generated = finishes[branch_id].token_ids
        assert generated == generate_alone(embedded.model, info.prompt_token_ids, len(generated)), info.label


def test_a_fork_carries_its_full_path_parent_prompt_answer_then_its_own_turn(embedded, builtin_run):
    events = builtin_run("follow-ups")
    infos = {b.id: b for b in events[0].branches}
    finishes = {e.branch: e for e in events if isinstance(e, Finish)}
    forks = [e.branch for e in events if isinstance(e, Fork)]
    assert len(forks) == 4
    recipe = load_recipe("follow-ups")
    questions = {child.label: child.prompt for branch in recipe.branches for child in branch.children}
    for child in forks:
        parent = infos[child.parent]
        turn = continuation_token_ids(embedded.tokenizer, questions[child.label.split("/")[1]])
        assert child.prompt_token_ids == parent.prompt_token_ids + finishes[parent.id].token_ids + turn
        assert child.label.startswith(parent.label + "/")


# -- compiling ----------------------------------------------------------------------------------

TREE = """\
version: 1
strategy: tree
context: {input: true}
system: Be brief.
vars: {who: a child, style: null}
sampling: {temperature: 0.7, top_k: 40, seed: 3, max_new_tokens: 50, stop: ["END"]}
branches:
  - label: short
    prompt: "$context\\n\\nExplain it to $who in a $style way. It costs $$5."
    sampling: {max_new_tokens: 10, top_k: 5}
    children:
      - label: why
        prompt: Why, $who?
        sampling: {temperature: 0.0}
  - label: long
    prompt: "$context\\n\\nExplain it at length."
"""


def test_compile_fills_variables_and_tokenizes_roots_whole_and_children_as_continuations(embedded):
    tokenizer = embedded.tokenizer
    recipe = load_recipe_text(TREE, var_names=["style"])
    short, long = compile_recipe(recipe, tokenizer, input_text=STORY, vars={"style": "funny"})
    expected = prompt_token_ids(tokenizer, f"{STORY}\n\nExplain it to a child in a funny way. It costs $5.",
                                system="Be brief.")
    assert short.prompt_ids == expected
    assert short.children[0].prompt_ids == continuation_token_ids(tokenizer, "Why, a child?")
    assert long.prompt_ids == prompt_token_ids(tokenizer, f"{STORY}\n\nExplain it at length.", system="Be brief.")
    assert [short.label, short.children[0].label, long.label] == ["short", "why", "long"]


def test_sampling_layers_recipe_then_branch_then_inherited_by_children_and_flags_win_everywhere(embedded):
    recipe = load_recipe_text(TREE, var_names=["style"])
    short, long = compile_recipe(recipe, embedded.tokenizer, input_text=STORY, vars={"style": "x"})
    assert (long.sampling.temperature, long.sampling.top_k, long.max_new_tokens, long.stop) == (0.7, 40, 50, ("END",))
    assert (short.sampling.temperature, short.sampling.top_k, short.max_new_tokens) == (0.7, 5, 10)
    why = short.children[0]
    assert (why.sampling.temperature, why.sampling.top_k, why.max_new_tokens) == (0.0, 5, 10)
    assert resolved_seed(recipe) == 3 and why.sampling.seed == 3

    flagged = with_sampling(recipe, Sampling(max_new_tokens=4, temperature=0.2))
    short, long = compile_recipe(flagged, embedded.tokenizer, input_text=STORY, vars={"style": "x"})
    for spec in (short, short.children[0], long):
        assert (spec.max_new_tokens, spec.sampling.temperature) == (4, 0.2)
    assert short.sampling.top_k == 5  # a flag that was not given leaves the recipe alone


@pytest.mark.parametrize(
    ("options", "path", "fix"),
    [
        ({"input_text": STORY}, "branches[0].prompt: uses $style, which has no value", "--var style=VALUE"),
        ({"vars": {"style": "x"}}, "context.input", "--input"),
        ({"input_text": STORY, "vars": {"style": "x", "typo": "y"}}, "--var typo: no prompt uses $typo", "who"),
    ],
    ids=["required variable not given", "no input", "unused --var"],
)
def test_compile_refuses_what_would_leave_a_hole_or_drop_something(embedded, options, path, fix):
    recipe = load_recipe_text(TREE, source="t.yaml", var_names=["style", "typo"])
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, embedded.tokenizer, **options)
    assert str(caught.value.problem).startswith(f"t.yaml: {path}")
    assert fix in caught.value.fix


def test_a_context_file_is_read_relative_to_the_recipe_not_the_working_directory(embedded, tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    write(folder, "doc.txt", STORY)
    path = write(folder, "r.yaml", "version: 1\nstrategy: tree\ncontext: {file: doc.txt}\n"
                 "branches: [{label: a, prompt: \"$context Who?\"}]\n")
    monkeypatch.chdir(tmp_path)
    (spec,) = compile_recipe(load_recipe(path), embedded.tokenizer)
    assert spec.prompt_ids == prompt_token_ids(embedded.tokenizer, f"{STORY} Who?")


def test_ask_many_questions_are_a_shorthand_for_one_branch_per_question(embedded):
    recipe = load_recipe("interview")
    specs = compile_recipe(recipe, embedded.tokenizer, input_text=STORY)
    assert [spec.label for spec in specs] == recipe.questions
    for spec, question in zip(specs, recipe.questions):
        text = recipe.template.replace("$context", STORY).replace("$question", question)
        assert spec.prompt_ids == prompt_token_ids(embedded.tokenizer, text)


def test_every_example_in_the_recipe_reference_is_a_valid_recipe(tmp_path):
    import re

    reference = (Path(__file__).parent.parent / "docs" / "recipes.md").read_text(encoding="utf-8")
    examples = re.findall(r"```yaml\n(.*?)```", reference, re.DOTALL)
    write(tmp_path, "report.txt", STORY)  # the file an example reads
    assert len(examples) >= 4
    strategies = {load_recipe_text(example, base_dir=tmp_path).strategy for example in examples}
    assert strategies == set(strategy_names())  # every registered strategy has an example


def test_dumped_recipes_load_back_to_the_same_recipe():
    for name in builtin_names():
        recipe = load_recipe(name)
        assert load_recipe_text(dump_recipe(recipe)).model_dump() == recipe.model_dump()


# -- bad recipes: one line naming the file, the field and the fix -----------------------------

BAD_RECIPES = [
    ("invalid-yaml", "version: 1\nstrategy: tree\nbranches: [\n", "line 4, column 1", "invalid YAML",
     "indentation"),
    ("unknown-key", "version: 1\nstrategy: tree\nbranches:\n  - label: a\n    prompt: hi\n    temprature: 1\n",
     "branches[0].temprature", "unknown key", "allowed here: label, prompt, sampling, constraint, children"),
    ("wrong-type", "version: 1\nstrategy: tree\nsampling: {max_new_tokens: lots}\nbranches: [{label: a, prompt: hi}]\n",
     "sampling.max_new_tokens", "expected a whole number, got the text 'lots'", "write a whole number"),
    ("wrong-type-list", "version: 1\nstrategy: tree\nbranches: {label: a, prompt: hi}\n",
     "branches", "expected a list", "`- item`"),
    ("missing-variable",
     ("version: 1\nstrategy: tree\nbranches:\n  - label: a\n    prompt: hi\n    children:\n"
      "      - {label: b, prompt: tell me about $topic}\n"),
     "branches[0].children[0].prompt", "uses $topic, which is not defined", "--var topic=VALUE"),
    ("empty-branch-list", "version: 1\nstrategy: tree\nbranches: []\n", "branches", "the branch list is empty",
     "add at least one branch"),
    ("empty-children", "version: 1\nstrategy: tree\nbranches: [{label: a, prompt: hi, children: []}]\n",
     "branches[0].children", "empty", "add at least one branch"),
    ("yaml-alias-cycle",
     "version: 1\nstrategy: tree\nbranches:\n  - &loop\n    label: a\n    prompt: hi\n    children: [*loop]\n",
     "branches[0].children[0]", "contains itself", "cannot contain itself"),
    ("duplicate-label",
     "version: 1\nstrategy: tree\nbranches:\n  - {label: a, prompt: hi}\n  - {label: a, prompt: ho}\n",
     "branches[1].label", "'a' repeats branches[0].label", "rename one"),
    ("duplicate-child-label",
     ("version: 1\nstrategy: tree\nbranches:\n  - label: a\n    prompt: hi\n    children:\n"
      "      - {label: b, prompt: x}\n      - {label: b, prompt: y}\n"),
     "branches[0].children[1].label", "repeats", "rename one"),
    ("label-with-slash", "version: 1\nstrategy: tree\nbranches: [{label: a/b, prompt: hi}]\n",
     "branches[0].label", "contains '/'", "parent/child"),
    ("unknown-strategy", "version: 1\nstrategy: bogus\nbranches: [{label: a, prompt: hi}]\n", "strategy",
     "unknown strategy 'bogus'", "use one of: ask-many, tree"),
    ("missing-strategy", "version: 1\nbranches: [{label: a, prompt: hi}]\n", "strategy", "missing",
     "ask-many, tree"),
    ("parameter-for-the-wrong-strategy",
     "version: 1\nstrategy: tree\nquestions: [who]\nbranches: [{label: a, prompt: hi}]\n",
     "questions", "'questions' is a setting of strategy ask-many / beam / margins, not tree", "remove it"),
    ("beam-width-zero", "version: 1\nstrategy: beam\nprompt: hi\nwidth: 0\n", "width", "0 is out of range",
     "at least 1"),
    ("beam-early-stopping", "version: 1\nstrategy: beam\nprompt: hi\nearly_stopping: soon\n", "early_stopping",
     "'soon' is not allowed", "true, false or never"),
    ("beam-num-return-over-width", "version: 1\nstrategy: beam\nprompt: hi\nwidth: 2\nnum_return: 3\n",
     "num_return", "more than width 2", "num_return <= width"),
    ("beam-setting-in-think", "version: 1\nstrategy: think\nquestion: hi\nwidth: 2\n", "width",
     "'width' is a setting of strategy beam, not think", "strategy: beam"),
    ("margins-without-context", "version: 1\nstrategy: margins\nquery: who?\n", "context", "margins reads a document",
     "input: true"),
    ("margins-bad-template",
     "version: 1\nstrategy: margins\ncontext: {input: true}\nquery: who?\nanswer_template: \"$query only\"\n",
     "answer_template", "has no $notes", "add $notes"),
    ("margins-query-and-questions",
     "version: 1\nstrategy: margins\ncontext: {input: true}\nquery: who?\nquestions: [why]\n",
     "query", "not both", "questions: [...]"),
    ("margins-no-question", "version: 1\nstrategy: margins\ncontext: {input: true}\n",
     "query", "margins needs a question", "questions: [...]"),
    ("margins-repeated-question",
     "version: 1\nstrategy: margins\ncontext: {input: true}\nquestions: [who, why, who]\n",
     "questions[2]", "repeats questions[0]", "remove it"),
    ("margins-question-with-context",
     "version: 1\nstrategy: margins\ncontext: {input: true}\nquestions: [who, \"$context why\"]\n",
     "questions[1]", "cannot use $context", "write the question itself"),
    ("think-ignores-context", "version: 1\nstrategy: think\ncontext: {input: true}\nquestion: hi\n",
     "question", "does not use $context", "put $context in it"),
    ("children-in-ask-many",
     "version: 1\nstrategy: ask-many\nbranches:\n  - label: a\n    prompt: hi\n    children: [{label: b, prompt: x}]\n",
     "branches[0].children", "cannot have children", "strategy: tree"),
    ("context-file-missing",
     "version: 1\nstrategy: tree\ncontext: {file: no-such.txt}\nbranches: [{label: a, prompt: \"$context hi\"}]\n",
     "context.file", "'no-such.txt' does not exist", "relative to the recipe file"),
    ("root-ignores-context",
     "version: 1\nstrategy: tree\ncontext: {text: a story}\nbranches: [{label: a, prompt: hi}]\n",
     "branches[0].prompt", "does not use $context", "put $context in it"),
    ("python-tag", "version: 1\nstrategy: !!python/object/apply:os.system ['touch {marker}']\n",
     "line 2, column 11", "the tag !!python/object/apply:os.system is not allowed", "never code"),
    ("duplicate-key", "version: 1\nstrategy: tree\nbranches: [{label: a, prompt: hi, prompt: ho}]\n",
     "line 3, column 35", "the key 'prompt' appears twice", "keep one"),
    ("unsupported-version", "version: 2\nstrategy: tree\n", "version", "unsupported version 2", "version: 1"),
    ("lone-dollar", "version: 1\nstrategy: tree\nbranches: [{label: a, prompt: costs $5}]\n",
     "branches[0].prompt", "a $ that starts no variable", "$$"),
    ("out-of-range", "version: 1\nstrategy: tree\nsampling: {top_p: 0}\nbranches: [{label: a, prompt: hi}]\n",
     "sampling.top_p", "out of range", "(0, 1]"),
    ("not-a-mapping", "- just\n- a list\n", "(top level)", "a recipe is a YAML mapping", "version: 1"),
]


@pytest.mark.parametrize(("text", "path", "problem", "fix"), [case[1:] for case in BAD_RECIPES],
                         ids=[case[0] for case in BAD_RECIPES])
def test_a_bad_recipe_fails_validation_with_one_line_naming_file_field_and_fix(tmp_path, text, path, problem, fix):
    marker = tmp_path / "tag-ran"
    recipe = write(tmp_path, "bad.yaml", text.replace("{marker}", str(marker)))
    result = cli("recipes", "validate", str(recipe))
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"mdcli: error: {recipe}: {path}: "), lines[0]
    message, _, given_fix = lines[0].partition("; ")
    assert problem in message
    assert fix in given_fix
    assert not marker.exists()  # the YAML tag was refused, never executed


def test_validate_checks_every_file_and_reports_each_bad_one(tmp_path):
    good = write(tmp_path, "good.yaml", "version: 1\nstrategy: tree\nbranches: [{label: a, prompt: hi}]\n")
    bad1 = write(tmp_path, "bad1.yaml", "version: 1\nstrategy: tree\nbranches: []\n")
    bad2 = write(tmp_path, "bad2.yaml", "version: 1\nstrategy: nope\n")
    result = cli("recipes", "validate", str(bad1), str(good), str(bad2))
    assert result.exit_code == 2
    assert [line.split(": ")[2] for line in result.stderr.splitlines()] == [str(bad1), str(bad2)]
    assert f"ok: {good}" in result.stdout


def test_run_refuses_a_bad_recipe_before_loading_a_model(tmp_path, story_file):
    recipe = write(tmp_path, "r.yaml", "version: 1\nstrategy: tree\nbranches: [{label: a, prompt: $nope}]\n")
    result = cli("run", str(recipe), "--input", str(story_file), "--model", str(tmp_path / "no-such-model"))
    assert result.exit_code == 2
    assert "uses $nope" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "no-such-recipe"], "no such recipe file or built-in recipe; check the path; built-in recipes:"),
        (["run", "summarize", "--var", "audience"], "--var 'audience' is not name=value"),
        (["run", "summarize", "--var", "tone=dry", "--input", "STORY"], "--var tone: no prompt uses $tone"),
        (["run", "summarize", "--top-p", "0", "--input", "STORY"], "--top-p 0.0 is out of range"),
        (["ask-many", "STORY", "--recipe", "follow-ups"], "is a 'tree' recipe; run it with: mdcli run follow-ups"),
        (["explain", "interview"], "context.input: the recipe reads its context from --input"),
    ],
    ids=["unknown recipe", "var without =", "unused var", "flag out of range", "tree recipe in ask-many",
         "no input"],
)
def test_command_line_mistakes_exit_2_with_one_line(story_file, args, message):
    args = [str(story_file) if arg == "STORY" else arg for arg in args]
    result = cli(*args, input="")
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1
    assert message in result.stderr


# -- no input makes the loader fail any other way ------------------------------------------------

VALID = yaml.safe_load(
    """
version: 1
description: d
strategy: tree
context: {input: true}
system: s
chat_template: true
vars: {who: you}
sampling: {temperature: 0.5, top_p: 0.9, top_k: 3, min_p: 0.1, seed: 1, max_new_tokens: 4, stop: [x]}
branches:
  - label: a
    prompt: "$context $who"
    sampling: {max_new_tokens: 2}
    children:
      - {label: b, prompt: "more $who", children: [{label: c, prompt: again}]}
  - {label: d, prompt: "$context ok"}
"""
)
SCHEMA_WORDS = ["version", "strategy", "branches", "label", "prompt", "children", "sampling", "context", "text",
                "file", "input", "vars", "questions", "template", "system", "chat_template", "temperature",
                "top_p", "top_k", "min_p", "seed", "max_new_tokens", "stop", "description"]
scalars = (st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=12)
           | st.sampled_from(["tree", "ask-many", "beam", "$context", "$who", "$", "a/b", "", "1"]))
keys = st.sampled_from(SCHEMA_WORDS) | st.text(max_size=6) | st.integers(0, 3)
documents = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5), max_leaves=30
)


@st.composite
def mutated_recipes(draw):
    """A valid recipe with one random change deep inside: a value replaced, a key dropped or
    added, or a container made to hold its own ancestor (a YAML alias cycle once dumped)."""
    doc = json.loads(json.dumps(VALID))
    ancestors, node = [], doc
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        ancestors.append(node)
        key = draw(st.sampled_from(sorted(node, key=str) if isinstance(node, dict) else range(len(node))))
        node = node[key]
    holder = ancestors[-1] if ancestors else doc
    if not isinstance(holder, (dict, list)) or not holder:
        return doc
    key = draw(st.sampled_from(sorted(holder, key=str) if isinstance(holder, dict) else range(len(holder))))
    action = draw(st.sampled_from(["replace", "drop", "add", "cycle"]))
    if action == "replace":
        holder[key] = draw(documents)
    elif action == "drop":
        del holder[key]
    elif action == "add" and isinstance(holder, dict):
        holder[draw(keys)] = draw(documents)
    elif action == "cycle":
        holder[key] = draw(st.sampled_from([doc, *ancestors]))
    return doc


@pytest.fixture(scope="module")
def tokenizer():
    from tests.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


def assert_loads_or_fails_cleanly(text: str, tokenizer) -> None:
    try:
        recipe = load_recipe_text(text, source="fuzz.yaml", base_dir=Path("/nonexistent-base"))
    except RecipeError as error:
        line = str(error.problem) + "; " + str(error.fix)
        assert line.startswith("fuzz.yaml: ") and "\n" not in line
        return
    assert isinstance(recipe, RecipeBase)
    if not isinstance(recipe, (AskManyRecipe, TreeRecipe)):  # beam, margins, think: no branch specs
        try:
            check_run_inputs(recipe, input_text=STORY if recipe.context and recipe.context.input else None,
                             vars={name: "v" for name, value in recipe.vars.items() if value is None})
        except RecipeError:
            pass
        return
    try:
        specs = compile_recipe(recipe, tokenizer, input_text=STORY if recipe.context and recipe.context.input else None,
                               vars={name: "v" for name, value in recipe.vars.items() if value is None})
    except RecipeError:
        return
    assert specs and all(spec.prompt_ids for spec in specs)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(doc=documents)
def test_any_yaml_document_loads_as_a_valid_recipe_or_raises_recipe_error(tokenizer, doc):
    assert_loads_or_fails_cleanly(yaml.safe_dump(doc), tokenizer)


@FUZZ
@given(doc=mutated_recipes())
def test_any_mutation_of_a_valid_recipe_loads_or_raises_recipe_error(tokenizer, doc):
    assert_loads_or_fails_cleanly(yaml.safe_dump(doc), tokenizer)


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(SCHEMA_WORDS), documents, max_size=6),
       strategy=st.sampled_from(["tree", "ask-many"]))
def test_documents_that_pass_the_version_and_strategy_gate_load_or_raise_recipe_error(tokenizer, fields, strategy):
    assert_loads_or_fails_cleanly(yaml.safe_dump({**fields, "version": 1, "strategy": strategy}), tokenizer)


@FUZZ
@given(text=st.text(max_size=200))
def test_any_text_loads_or_raises_recipe_error(tokenizer, text):
    assert_loads_or_fails_cleanly(text, tokenizer)


# -- ask-many --save-recipe, then run ---------------------------------------------------------------


def token_events(jsonl: str) -> list[dict]:
    """The JSONL events without timing (the only fields that differ between identical runs)."""
    events = [json.loads(line) for line in jsonl.splitlines()]
    for event in events:
        if event["type"] == "done":
            event.pop("stats")
    return events


def test_save_recipe_then_run_gives_identical_jsonl_token_events(tmp_path, story_file):
    saved = tmp_path / "saved.yaml"
    # a fixed number of guesses, not auto: auto picks each forward's width from the steps it times,
    # so two auto runs can sum in other orders and differ in a logprob's last bits
    flags = ["-q", "Who is Mara?", "-q", "What broke, and did it cost $5?", "-n", "8", "--system", "Be brief.",
             "--stop", "\n\n", "--speculate", "2", "--jsonl"]
    plain = cli("ask-many", str(story_file), *flags)
    saving = cli("ask-many", str(story_file), *flags, "--save-recipe", str(saved))
    rerun = cli("run", str(saved), "--input", str(story_file), "--jsonl")
    for result in (plain, saving, rerun):
        assert result.exit_code == 0, result.stderr
    assert token_events(rerun.stdout) == token_events(plain.stdout) == token_events(saving.stdout)
    events = token_events(rerun.stdout)
    assert [b["label"] for b in events[0]["branches"]] == ["Who is Mara?", "What broke, and did it cost $5?"]
    assert sum(e["type"] == "token" for e in events) > 2

    recipe = load_recipe(saved)
    assert recipe.context.input and recipe.system == "Be brief." and recipe.sampling.max_new_tokens == 8
    assert recipe.speculate == 2
    assert json.loads(rerun.stdout.splitlines()[-1])["stats"]["draft_tokens"] > 0  # the saved setting ran
    assert recipe.questions[1] == "What broke, and did it cost $$5?"  # literal text, escaped


def test_ask_many_recipe_supplies_defaults_and_the_flags_you_type_win(tmp_path, story_file):
    base = write(tmp_path, "base.yaml", "version: 1\nstrategy: ask-many\ncontext: {input: true}\n"
                 "sampling: {max_new_tokens: 3, top_k: 7}\n"
                 "questions: [\"Who?\", \"Where?\"]\n")
    saved = tmp_path / "merged.yaml"
    result = cli("ask-many", str(story_file), "--recipe", str(base), "-q", "When?", "-n", "2",
                 "--save-recipe", str(saved), "--jsonl")
    assert result.exit_code == 0, result.stderr
    merged = load_recipe(saved)
    assert merged.questions == ["When?"]
    assert (merged.sampling.max_new_tokens, merged.sampling.top_k, merged.sampling.temperature) == (2, 7, None)
    finishes = [e for e in token_events(result.stdout) if e["type"] == "finish"]
    assert [(f["label"], len(f["token_ids"])) for f in finishes] == [("When?", 2)]


def test_ask_many_with_a_recipe_speculates_as_the_recipe_says_unless_speculate_is_typed(tmp_path, story_file):
    base = write(tmp_path, "off.yaml", "version: 1\nstrategy: ask-many\ncontext: {input: true}\n"
                 "speculate: off\nquestions: [\"Who is Mara?\", \"What broke, and did it cost $$5?\"]\n")

    def stats(*flags: str) -> dict:
        result = cli("ask-many", str(story_file), "--recipe", str(base), "-n", "8", "--jsonl", *flags)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])["stats"]

    assert stats()["draft_tokens"] == 0  # the recipe's `speculate: off`, not the flag's default
    assert stats("--speculate", "3")["draft_tokens"] > 0  # a typed flag wins


# -- beam, margins and think recipes -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["beam", "margins", "think"])
def test_each_new_builtin_runs_through_mdcli_run_as_jsonl(story_file, name):
    result = cli("run", name, "--input", str(story_file), "-n", "8", "--jsonl")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["type"] == "start" and events[0]["strategy"] == name
    assert events[-1]["type"] == "done"
    assert any(e["type"] == "finish" for e in events)


def test_a_beam_recipe_run_equals_beam_search_with_the_same_parameters(embedded, story_file):
    from mdcli.api import beam_search

    result = cli("run", "beam", "--input", str(story_file), "-n", "8", "--jsonl")
    assert result.exit_code == 0, result.stderr
    finishes = [e["token_ids"] for e in token_events(result.stdout) if e["type"] == "finish"]
    recipe = load_recipe("beam")
    prompt = recipe.prompt.replace("$context", STORY)
    expected = [e.token_ids for e in beam_search(
        embedded, prompt, width=recipe.width, num_return=recipe.num_return, length_penalty=recipe.length_penalty,
        early_stopping=recipe.early_stopping, max_new_tokens=8,
    ) if isinstance(e, Finish)]
    assert finishes == expected and len(finishes) == recipe.num_return


def finished_by_branch(events) -> dict[int, tuple[str | None, list[int]]]:
    """Each finished branch's label and tokens, by branch id. The order branches finish in is no
    part of the comparison: a branch whose guesses are accepted (`speculate: auto`, a recipe's
    default) finishes steps before the same branch run without guesses."""
    return {e.branch: (e.label, e.token_ids) for e in events if isinstance(e, Finish)}


def test_a_think_recipe_with_reencode_equals_think_with_the_same_parameters(embedded):
    from mdcli.api import think
    from mdcli.core.sampling import SamplingParams

    recipe = with_sampling(load_recipe("think"), Sampling(max_new_tokens=8))
    recipe = recipe.model_copy(update={"conclusion_tokens": 8})
    got = finished_by_branch(recipe_events(recipe, embedded, input_text=STORY))
    expected = finished_by_branch(think(
        embedded, recipe.question.replace("$context", STORY), paths=4, merge="reencode",
        path_instructions=recipe.path_instructions, sampling=SamplingParams(), max_new_tokens=8, conclusion_tokens=8,
    ))
    assert got == expected and len(got) >= 5  # four paths and the conclusion


def test_beam_questions_use_the_recipe_template_with_context_and_vars(embedded):
    from mdcli.api import beam_search

    recipe = load_recipe_text(
        "version: 1\nstrategy: beam\ncontext: {input: true}\nvars: {tone: plainly}\nsampling: {max_new_tokens: 4}\n"
        "template: \"$context\\n\\nAnswer $tone: $question\"\nquestions: [\"Who is Mara?\"]\nwidth: 2\n"
    )
    got = [e.token_ids for e in recipe_events(recipe, embedded, input_text=STORY) if isinstance(e, Finish)]
    expected = [e.token_ids for e in beam_search(
        embedded, STORY, ["Who is Mara?"], width=2, max_new_tokens=4, template="$document\n\nAnswer plainly: $question",
    ) if isinstance(e, Finish)]
    assert got == expected and got


def test_a_bad_beam_width_makes_run_exit_2_with_one_line_naming_the_field(tmp_path, story_file):
    recipe = write(tmp_path, "b.yaml", "version: 1\nstrategy: beam\ncontext: {input: true}\n"
                   "prompt: \"$context headline\"\nwidth: 0\n")
    result = cli("run", str(recipe), "--input", str(story_file), "-n", "8", "--jsonl")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mdcli: error: {recipe}: width: 0 is out of range"), lines


def test_a_margins_recipe_with_questions_runs_every_question_as_margins_does(tiny_dir):
    from mdcli.api import margins
    from mdcli.models.load import load_model

    tiny = load_model(str(tiny_dir("llama")), quiet=True)
    recipe = load_recipe_text(
        "version: 1\nstrategy: margins\ncontext: {input: true}\nvars: {who: Mara}\nsampling: {max_new_tokens: 3}\n"
        "questions: [\"Who is $who?\", \"Where does $who live?\"]\nsegment_tokens: 24\n"
        "classify_tokens: 2\nanswer_tokens: 3\n"
    )
    got = finished_by_branch(recipe_events(recipe, tiny, input_text=STORY))
    expected = finished_by_branch(margins(
        tiny, STORY, questions=["Who is Mara?", "Where does Mara live?"], segment_tokens=24, max_new_tokens=3,
        classify_tokens=2, answer_tokens=3,
    ))
    answers = [label for _, (label, _) in sorted(got.items())[-2:]]
    assert got == expected and answers == ["Who is Mara?", "Where does Mara live?"]


def test_the_shipped_margins_recipe_asks_several_questions():
    recipe = load_recipe(Path(__file__).parent.parent / "mdcli" / "recipes" / "builtin" / "margins.yaml")
    assert recipe.strategy == "margins" and recipe.query is None and len(recipe.questions) >= 2


# -- one model per strategy: the recipe's schema, the API's job and the command's defaults -------


def _command_defaults(command) -> dict:
    import inspect

    return {name: parameter.default for name, parameter in inspect.signature(command).parameters.items()}


def _strategy_models():
    """(options class, job class, recipe class, command, the command's parameter for each field
    where it is not the field's own name, a minimal recipe)."""
    from mdcli import api
    from mdcli.cli import beam as beam_command
    from mdcli.cli import explore as explore_command
    from mdcli.cli import margins as margins_command
    from mdcli.cli import think as think_command
    from mdcli.recipes import BeamRecipe, MarginsRecipe, ThinkRecipe
    from mdcli.recipes.explore import ExploreRecipe
    from mdcli.strategies.beam import BeamOptions
    from mdcli.strategies.explore import ExploreOptions
    from mdcli.strategies.margins import MarginsOptions
    from mdcli.strategies.think import ThinkOptions

    return [
        (ThinkOptions, api.Think, ThinkRecipe, think_command.think,
         {"path_instructions": "path_instruction", "constraint": "regex"},  # --choices / --regex / --schema
         "version: 1\nstrategy: think\nquestion: Why?\n"),
        (BeamOptions, api.BeamParams, BeamRecipe, beam_command.beam, {}, "version: 1\nstrategy: beam\nprompt: Hi\n"),
        (ExploreOptions, api.Explore, ExploreRecipe, explore_command.explore, {"constraint": "regex"},
         "version: 1\nstrategy: explore\nprompt: Hi\n"),
        (MarginsOptions, api.Margins, MarginsRecipe, margins_command.margins,
         {"layout": "context", "classify": "no_classify", "classify_constraint": "no_classify_constraint"},
         "version: 1\nstrategy: margins\ncontext: {input: true}\nquery: Who?\n"),
    ]


@pytest.mark.parametrize("index", range(4), ids=["think", "beam", "explore", "margins"])
def test_the_recipe_the_api_and_the_command_share_one_model_per_strategy(index):
    from mdcli import api
    from mdcli.recipes import BeamRecipe

    options, job, recipe_class, command, parameters, text = _strategy_models()[index]
    # the same class: the job and the recipe are both made of the strategy's options model
    assert issubclass(job, options) and issubclass(recipe_class, options)
    recipe = load_recipe_text(text)
    assert isinstance(recipe, recipe_class) and isinstance(recipe, options)
    for name, field in options.model_fields.items():
        model_default = field.get_default(call_default_factory=True)
        # the recipe's and the job's field is the options model's own field (default and bounds)
        assert repr(field) == repr(job.model_fields[name]), name
        if (recipe_class, name) != (BeamRecipe, "early_stopping"):  # any value, checked in check() for one clear line
            assert repr(recipe_class.model_fields[name]) == repr(field), name
        assert getattr(recipe, name) == model_default, name
        # the command's default is the model's, or None: not given, so the model's default applies
        command_default = _command_defaults(command)[parameters.get(name, name)]
        if name == "early_stopping":  # the command line spells it as text
            command_default = api.parse_early_stopping(command_default)
        if name in ("classify", "classify_constraint"):  # margins: the flags are --no-classify, --no-classify-constraint
            command_default = not command_default
        assert command_default is None or command_default == model_default, (name, command_default, model_default)
    # the budget per branch (margins: per margin, its job's margin_tokens) is the command's -n
    budget = "margin_tokens" if "margin_tokens" in job.model_fields else "max_new_tokens"
    if budget in job.model_fields:
        assert _command_defaults(command)["max_new_tokens"] == job.model_fields[budget].default


def test_ask_many_command_api_and_recipe_agree_on_the_answer_budget():
    from mdcli import api
    from mdcli.cli import ask_many as ask_many_command
    from mdcli.recipes.schema import DEFAULT_MAX_NEW_TOKENS

    default = api.AskMany.model_fields["max_new_tokens"].default
    assert _command_defaults(ask_many_command.ask_many)["max_new_tokens"] == default == DEFAULT_MAX_NEW_TOKENS
