"""The Python API as a program meets it: every public name importable from the package, inputs
checked where they are given with one-line errors, and the examples of docs/python-api.md running
as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding

import mdcli
from mdcli import api
from mdcli.errors import UsageError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def test_every_name_of_the_api_imports_from_the_package_itself():
    # issue 53: `from mdcli import read_inputs` failed
    assert set(mdcli.__all__) - {"__version__"} == set(api.__all__)
    from mdcli import AskMany, Skipped, read_inputs  # noqa: F401

    assert mdcli.read_inputs is api.read_inputs


@pytest.mark.parametrize(
    ("prompt_ids", "words"),
    [
        ("hello", r"prompt_ids is text \('hello'\), not token ids"),
        (BatchEncoding({"input_ids": [1, 2], "attention_mask": [1, 1]}), "prompt_ids is a BatchEncoding"),
        ([[1, 2], [3, 4]], "a batch of 2 prompts, not one"),
        (torch.tensor([[1, 2]]), "has 2 dimensions, not 1"),
        ([1, "2"], r"prompt_ids\[1\] is '2', not a token id"),
        (None, "prompt_ids is of type NoneType"),
    ],
)
def test_a_branch_spec_refuses_what_is_not_one_prompts_token_ids_in_one_line(prompt_ids, words):
    # issue 53: these were accepted and crashed deep inside run_specs
    with pytest.raises(UsageError, match=words) as refused:
        api.BranchSpec(label="q", prompt_ids=prompt_ids)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("BranchSpec 'q': ")


def test_a_branch_spec_takes_a_tuple_or_a_1d_tensor_as_its_list_of_ids():
    assert api.BranchSpec(label="q", prompt_ids=(1, 2)).prompt_ids == [1, 2]
    assert api.BranchSpec(label="q", prompt_ids=torch.tensor([3, 4])).prompt_ids == [3, 4]
    ids = [5, 6]
    assert api.BranchSpec(label="q", prompt_ids=ids).prompt_ids is ids  # a list of ints is kept, not copied


def test_the_run_specs_example_of_the_docs_runs_as_written(capsys):
    # issue 53: the example used `ids` without defining it
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    (example,) = [block for block in blocks if "run_specs(" in block]
    exec(compile(example, str(DOCS), "exec"), {})
    assert capsys.readouterr().out.strip() in ("yes/no -> yes", "yes/no -> no")


def test_run_specs_refuses_a_forest_too_large_for_memory_when_called(embedded):
    # issue 53: a memory estimate before any forest, whatever the command (ask-many and recipes run here)
    specs = [api.BranchSpec(label=str(i), prompt_ids=[1, 2, 3], max_new_tokens=256) for i in range(100_000)]
    with pytest.raises(UsageError, match=r"a forest of 100,000 branches needs about [\d,.]+ GiB .* is free on cpu"):
        api.run_specs(embedded, specs, strategy="test")  # raised by the call, not by the first next()
    events = list(api.run_specs(embedded, specs[:2], strategy="test"))
    assert events[0].type == "start" and events[-1].type == "done"
