"""Constrained branches (--choices / --regex / --schema): exact under the constraint, checked
before the model loads, and complete or said to be incomplete.

The reference is Hugging Face's `generate` on the branch's prompt alone with a logits processor
that masks with the same llguidance matcher (`ConstrainedAlone`): what "that prompt alone under the
same constraint" gives. A branch whose constraint is complete ends there, without the EOS token
that `generate` (whose mask then allows only EOS) adds as its next token.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mdcli.api import BranchSpec, Constraint, run_specs
from mdcli.constraints import compile_for
from mdcli.core.sampling import SamplingParams
from mdcli.events import Finish, Note, Start
from mdcli.models.load import load_model
from mdcli.strategies.prompts import prompt_token_ids
from mdcli.errors import UsageError
from tests import reference
from tests.tiny_models import TINY_ARCHS

STORY = open("examples/story.txt", encoding="utf-8").read()


def generate_constrained(lm, prompt: list[int], constraint: Constraint | None, new_tokens: int) -> list[int]:
    return reference.generate_constrained(lm.model, lm.tokenizer, prompt, constraint, new_tokens)


def run(lm, specs, **options) -> tuple[dict[int, list[int]], dict[str, Finish], list[Note]]:
    prompts, finishes, notes = {}, {}, []
    for event in run_specs(lm, specs, strategy="ask-many", **options):
        if isinstance(event, Start):
            prompts = {b.id: b.prompt_token_ids for b in event.branches}
        elif isinstance(event, Finish):
            finishes[event.label] = event
        elif isinstance(event, Note):
            notes.append(event)
    return prompts, finishes, notes


def assert_each_equals_its_run_alone(lm, specs, constraints, new_tokens, **options):
    _, finishes, _ = run(lm, specs, **options)
    for spec, constraint in zip(specs, constraints):
        ours = finishes[spec.label].token_ids
        theirs = generate_constrained(lm, spec.prompt_ids, constraint, new_tokens)
        if constraint is not None and finishes[spec.label].finish_reason == "stop" and ours[-1] not in lm.eos_token_ids:
            assert theirs[-1] in lm.eos_token_ids  # complete: generate's only choice next is EOS
            theirs = theirs[:-1]
        assert ours == theirs, spec.label
    return finishes


MIXED = {
    "Is the story sad? Answer yes or no.": Constraint(choices=["yes", "no"]),
    "Who is the main character?": None,
    "In which year might the story be set?": Constraint(regex=r"[12][0-9]{3}"),
    "Describe the main character.": Constraint(schema="name, age int"),
    "What is the boat called?": Constraint(choices=["The Gull", "The Petrel", "Nameless"]),
}


def specs_for(lm, questions: dict[str, Constraint | None], new_tokens: int, sampling=None) -> list[BranchSpec]:
    return [
        BranchSpec(
            label=question,
            prompt_ids=prompt_token_ids(lm.tokenizer, f"{STORY}\n\nAnswer this question about the text above.\nQuestion: {question}"),
            max_new_tokens=new_tokens, constraint=compile_for(constraint, lm.tokenizer),
            sampling=sampling or SamplingParams(),
        )
        for question, constraint in questions.items()
    ]


def test_constrained_and_free_branches_in_one_forest_each_equal_their_run_alone(embedded):
    specs = specs_for(embedded, MIXED, 48)
    finishes = assert_each_equals_its_run_alone(embedded, specs, list(MIXED.values()), 48)
    assert finishes["Is the story sad? Answer yes or no."].parsed in ("yes", "no")
    assert finishes["What is the boat called?"].parsed in ("The Gull", "The Petrel", "Nameless")
    described = finishes["Describe the main character."]
    if described.finish_reason == "stop":
        assert set(described.parsed) == {"name", "age"} and isinstance(described.parsed["age"], int)


def test_speculation_keeps_constrained_branches_exact(embedded):
    specs = specs_for(embedded, MIXED, 48)
    assert_each_equals_its_run_alone(embedded, specs, list(MIXED.values()), 48, speculate="4")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_architectures_stay_exact_under_choices_and_regex(tiny_dir, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True)
    questions = {
        "Pick one.": Constraint(choices=["alpha", "beta", "gamma delta"]),
        "A number?": Constraint(regex=r"[0-9]{2,6}"),
        "Anything.": None,
        "Yes or no?": Constraint(choices=["yes", "no"]),
    }
    specs = specs_for(lm, questions, 12)
    finishes = assert_each_equals_its_run_alone(lm, specs, list(questions.values()), 12)
    assert finishes["Pick one."].parsed in ("alpha", "beta", "gamma delta")


def test_sampled_constrained_branches_always_answer_one_of_the_choices(embedded):
    choices = Constraint(choices=["relevant", "irrelevant", "unsure"])
    questions = {f"Is the story about the sea? ({i})": choices for i in range(6)}
    sampling = SamplingParams(temperature=1.5, seed=7)
    _, first, _ = run(embedded, specs_for(embedded, questions, 8, sampling))
    _, again, _ = run(embedded, specs_for(embedded, questions, 8, sampling))
    assert all(f.parsed in choices.choices and f.text == f.parsed for f in first.values())
    assert [f.token_ids for f in first.values()] == [f.token_ids for f in again.values()]  # seeded per branch


def test_a_constraint_the_budget_cannot_satisfy_ends_at_length_with_a_note(embedded):
    questions = {"Count to fifty.": Constraint(regex=r"[a-z]{40}")}
    _, finishes, notes = run(embedded, specs_for(embedded, questions, 5))
    finish = finishes["Count to fifty."]
    assert finish.finish_reason == "length" and finish.parsed is None
    assert len(notes) == 1 and "budget" in notes[0].message and "not a valid answer" in notes[0].message


@pytest.mark.parametrize(
    "given, words",
    [
        ({"choices": []}, "the choice list is empty"),
        ({"regex": "a(b"}, "the regex is invalid: unclosed group"),
        ({"regex": r"[^\x00-\x{10FFFF}]"}, "matches nothing"),
        ({"regex": "a{0}"}, "matches only the empty answer"),
        ({"schema": '{"type": "objectx"}'}, "the schema is invalid"),
        ({"schema": {"type": "integer", "minimum": 5, "maximum": 2}}, "the schema is invalid"),
        ({"schema": "{not json"}, "not valid JSON"),
        ({"schema": "name age int"}, "cannot read the schema field"),
        ({"choices": ["a"], "regex": "b"}, "exactly one of"),
    ],
)
def test_bad_constraints_are_usage_errors_without_a_model(given, words):
    with pytest.raises(UsageError, match=words):
        Constraint(**given)


def test_concise_schema_is_an_object_with_every_field_required():
    assert Constraint(schema="name, age int, score float: how good, ok bool").json_schema == {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "score": {"type": "number", "description": "how good"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "score", "ok"],
        "additionalProperties": False,
    }


def reads(constraint: Constraint, text: str) -> bool:
    """Whether the constraint's grammar takes this text as a complete answer (byte tokens, no model)."""
    import llguidance

    from mdcli.constraints.spec import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), constraint.grammar(), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


PLAIN_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
                "required": ["answer", "confident"]}


def test_a_schema_object_is_closed_unless_the_schema_says_otherwise():
    closed = Constraint(schema=PLAIN_SCHEMA)
    assert reads(closed, '{"answer": "Mara", "confident": true}')
    assert not reads(closed, '{"answer": "Mara", "confident": true, "source": "the text"}')
    nested = Constraint(schema={"type": "object", "properties": {"who": {"type": "object", "properties": {"name": {"type": "string"}}}}})
    assert not reads(nested, '{"who": {"name": "Mara", "age": 3}}')
    opened = Constraint(schema={**PLAIN_SCHEMA, "additionalProperties": True})
    assert reads(opened, '{"answer": "Mara", "confident": true, "source": "the text"}')
    assert closed.json_schema == PLAIN_SCHEMA  # the schema as given is kept (recipes save it back)


def test_schema_answers_are_one_line_with_one_space_after_each_comma_and_colon():
    schema = Constraint(schema=PLAIN_SCHEMA)
    assert reads(schema, '{"answer": "Mara", "confident": true}')
    assert not reads(schema, '{"answer": "Mara",\n\n"confident": true}')
    assert not reads(schema, '{ "answer": "Mara", "confident": true }')
    flexible = Constraint(schema={**PLAIN_SCHEMA, "x-guidance": {"whitespace_flexible": True}})
    assert reads(flexible, '{\n  "answer": "Mara",\n  "confident": true\n}')  # the schema's own layout wins


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mdcli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "flags",
    [["--regex", "a(b"], ["--schema", '{"type": "objectx"}'], ["--choices", "a", "--regex", "b"], ["--regex", "a{0}"]],
)
def test_the_command_refuses_a_bad_constraint_in_one_line_before_loading(flags):
    # the model path does not exist: an error about it would mean the model was looked for first
    done = cli("ask-many", "examples/story.txt", "-q", "x", "-m", "/nonexistent/model", *flags)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("mdcli: error: ") and "nonexistent" not in done.stderr


def test_schema_answers_print_as_one_json_document_per_line(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                                  "required": ["name"], "additionalProperties": False}))
    done = cli("ask-many", "examples/story.txt", "-q", "Who is the main character?", "-q", "Who else appears?",
               "--schema", str(schema), "-n", "40", "-o", "plain")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(set(json.loads(line)) == {"name"} for line in lines)


def test_a_plain_json_schema_gives_every_question_a_closed_answer_within_48_tokens():
    # issue 53: without closed objects and bounded whitespace the embedded model padded each
    # object with invented properties and blank lines until -n 48 cut it (0 of 3 parsed)
    done = cli("ask-many", "tests/data/rag/lighthouse.txt", "-q", "Who keeps the lighthouse?", "-q", "What is the cat called?",
               "-q", "What brings bread?", "-n", "48", "--schema", json.dumps(PLAIN_SCHEMA), "--json", "--prompt-cache", "off")
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)["answers"]
    assert [a["finish_reason"] for a in answers] == ["stop"] * 3
    assert all(set(a["parsed"]) == {"answer", "confident"} for a in answers)


def test_think_votes_with_paths_decoded_under_the_answer_pattern_each_equal_to_its_run_alone(embedded):
    from mdcli.api import Think, think

    job = Think(question="What is 12 + 30? Think, then end with 'Answer: <number>'.", paths=2, vote=True,
                answer_pattern="Answer: (?P<answer>[0-9]+)", max_new_tokens=96,
                path_instructions=["Add the tens first.", "Count up from 30."])
    prompts, finishes, vote = {}, {}, None
    for event in think(embedded, job):
        if isinstance(event, Start):
            prompts = {b.id: (b.prompt_token_ids, b.constraint) for b in event.branches}
        elif isinstance(event, Finish):
            finishes[event.branch] = event
        elif isinstance(event, Note) and event.kind == "vote":
            vote = event
    pattern = job.path_constraint()
    assert vote is not None and vote.data["constraint"] == pattern.describe()
    for branch, (prompt, described) in prompts.items():
        assert described == pattern.describe()
        ours = finishes[branch].token_ids
        theirs = generate_constrained(embedded, prompt, pattern, 96)
        assert ours == theirs[: len(ours)] and len(theirs) - len(ours) <= 1
        if finishes[branch].finish_reason == "stop":  # complete: the vote has an answer from it
            assert vote.data["answers"][f"path {branch + 1}"] is not None


def test_explore_greedy_single_candidate_under_a_constraint_is_generate_under_it(embedded):
    from mdcli.api import Explore, explore

    constraint = Constraint(regex=r"[A-Z][a-z]+( [a-z]+){2,8}\.")
    job = Explore(prompt="Describe the sea in one sentence.", k=1, sampling=SamplingParams(), max_new_tokens=40,
                  constraint=constraint)
    answer = next(e for e in explore(embedded, job) if isinstance(e, Finish) and e.label == "explore")
    prompt = prompt_token_ids(embedded.tokenizer, job.prompt)
    theirs = generate_constrained(embedded, prompt, constraint, 40)
    assert answer.token_ids == theirs[: len(answer.token_ids)]
    assert answer.parsed == answer.text and answer.text.endswith(".")


def test_margins_classifications_are_always_a_valid_label(embedded):
    from mdcli.api import Margins, margins

    held_out = open("docs/how-it-works.md", encoding="utf-8").read()[:3000]  # a report the prompts never saw
    job = Margins(documents=[held_out], questions=["How is the cache shared?", "What is the price of bread?"],
                  segment_tokens=256, margin_tokens=24)
    notes = [e for e in margins(embedded, job) if isinstance(e, Note) and e.kind == "classification"]
    assert len(notes) >= 4
    assert all(note.data["parsed"] and note.data["constraint"] for note in notes)


def test_a_recipe_with_constraints_runs_them_and_saves_them_back(tmp_path):
    recipe = tmp_path / "shapes.yaml"
    recipe.write_text(
        "version: 1\nstrategy: tree\ncontext: {input: true}\nconstraint: {regex: '[0-9]{4}'}\nbranches:\n"
        "  - label: year\n    prompt: \"$context\\n\\nIn which year might it be set?\"\n    children:\n"
        "      - {label: mood, prompt: 'Is it happy?', constraint: {choices: [happy, sad]}}\n"
        "  - label: person\n    prompt: \"$context\\n\\nWho is it about?\"\n"
        "    constraint: {schema: 'name, age int'}\n    sampling: {max_new_tokens: 64}\n"
    )
    done = cli("run", str(recipe), "--input", "examples/story.txt", "--jsonl")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    finishes = {e["label"]: e for e in events if e["type"] == "finish"}
    assert len(finishes["year"]["text"]) == 4 and finishes["year"]["text"].isdigit()
    assert finishes["year/mood"]["parsed"] in ("happy", "sad")
    person = finishes["person"]
    assert person["parsed"] is None or set(person["parsed"]) == {"name", "age"}
    described = {b["label"]: b["constraint"] for e in events if e["type"] == "start" for b in e["branches"]}
    assert described["year"] == "regex: [0-9]{4}" and described["person"].startswith("schema: ")

    saved = tmp_path / "saved.yaml"
    first = cli("ask-many", "examples/story.txt", "-q", "Is it sad?", "--choices", "yes", "--choices", "no",
                "-n", "4", "--save-recipe", str(saved), "--jsonl")
    again = cli("run", str(saved), "--input", "examples/story.txt", "--jsonl")
    assert "constraint:" in saved.read_text() and first.returncode == again.returncode == 0

    def tokens(out: str):
        return [e["token_ids"] for e in map(json.loads, out.splitlines()) if e["type"] == "finish"]

    assert tokens(first.stdout) == tokens(again.stdout) and [e["parsed"] for e in map(json.loads, first.stdout.splitlines()) if e["type"] == "finish"][0] in ("yes", "no")


def test_run_flags_set_the_constraint_everywhere_and_a_beam_recipe_refuses_them(tmp_path):
    recipe = tmp_path / "two.yaml"
    recipe.write_text(
        "version: 1\nstrategy: tree\nbranches:\n  - {label: a, prompt: 'Is the sky blue?', constraint: {regex: '[0-9]+'}}\n"
        "  - {label: b, prompt: 'Is grass red?'}\n"
    )
    done = cli("run", str(recipe), "--choices", "yes", "--choices", "no", "-n", "6", "--jsonl")
    assert done.returncode == 0, done.stderr
    finishes = [e for e in map(json.loads, done.stdout.splitlines()) if e["type"] == "finish"]
    assert sorted(f["label"] for f in finishes) == ["a", "b"] and all(f["parsed"] in ("yes", "no") for f in finishes)
    refused = cli("run", "beam", "--regex", "a+")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "beam recipe" in refused.stderr


def test_a_bad_constraint_in_a_recipe_or_job_names_where_it_is():
    from mdcli.api import AskMany
    from mdcli.errors import RecipeError
    from mdcli.recipes import load_recipe_text

    text = "version: 1\nstrategy: tree\nbranches:\n  - {label: a, prompt: hi, constraint: {regex: 'a('}}\n"
    with pytest.raises(RecipeError, match=r"shapes.yaml: branches\[0\]\.constraint: the regex is invalid"):
        load_recipe_text(text, source="shapes.yaml")
    with pytest.raises(UsageError, match="^constraint: the choice list is empty"):
        AskMany(document="d", questions=["q"], constraint={"choices": []})


def test_a_sampled_constrained_branch_draws_the_same_tokens_alone_as_in_a_forest(embedded):
    questions = {
        "Name a colour.": Constraint(regex=r"[a-z]{3,12}"),
        "Is the story sad?": Constraint(choices=["yes", "no", "maybe"]),
        "Who is the main character?": None,
    }
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=3)
    specs = specs_for(embedded, questions, 10, sampling)
    for spec, key in zip(specs, range(len(specs))):
        spec.seed_key = key  # the branch's stream, whatever runs beside it
    _, together, _ = run(embedded, specs)
    for spec in specs:
        _, alone, _ = run(embedded, [spec])
        assert alone[spec.label].token_ids == together[spec.label].token_ids, spec.label
