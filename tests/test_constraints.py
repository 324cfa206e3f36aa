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
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from mdcli.api import BranchSpec, Constraint, run_specs
from mdcli.constraints import compile_for
from mdcli.core.sampling import SamplingParams
from mdcli.events import Finish, Note, Start
from mdcli.models.load import load_model
from mdcli.strategies.prompts import prompt_token_ids
from mdcli.errors import UsageError

STORY = open("examples/story.txt", encoding="utf-8").read()


class ConstrainedAlone(LogitsProcessor):
    """generate's logits processor: the tokens generated so far advance one llguidance matcher,
    and every disallowed token's score is -inf."""

    def __init__(self, constraint: Constraint, tokenizer, prompt_length: int) -> None:
        self.state = compile_for(constraint, tokenizer).start()
        self.prompt_length = prompt_length
        self.seen = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_length :].tolist()
        for token in generated[self.seen :]:
            self.state.advance(token)
        self.seen = len(generated)
        allowed = torch.empty(scores.shape[-1], dtype=torch.bool)
        self.state.allowed(allowed)
        return scores.masked_fill(~allowed[None], float("-inf"))


def generate_constrained(lm, prompt: list[int], constraint: Constraint | None, new_tokens: int) -> list[int]:
    processors = LogitsProcessorList([ConstrainedAlone(constraint, lm.tokenizer, len(prompt))] if constraint else [])
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=new_tokens, logits_processor=processors,
        )
    return out[0, len(prompt) :].tolist()


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


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3", "gemma3"])
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
