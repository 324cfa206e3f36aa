"""Below float32 (bf16, 4-bit, 8-bit), a forest agrees with `generate` up to ties.

In float32 the forest reproduces each branch run alone to rounding (test_engine_exactness). In
bf16 the same sums are rounded to 8 mantissa bits, and batching 8 tokens instead of 1 changes the
kernels' summation order, so two near-equal logits can swap. The promise there: each branch is
token for token its `generate` run alone until the first token where they differ, and at that token
the reference's own logits show a near-tie (the forest's token within a few bf16 steps of the
reference's choice). A real disagreement, a wrong mask or position, shows up as a large gap.

The CPU bf16 tests run everywhere; the CUDA ones (`pytest -m gpu`) need a GPU, and the quantized
ones bitsandbytes too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mdcli.models.load import load_model
from tests.reference import branches_off_their_runs_alone

HAS_CUDA = torch.cuda.is_available()
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None

DOCUMENT = (
    "Mara kept the lighthouse on the coast of Brittany for thirty years. Each evening she climbed the "
    "hundred steps, trimmed the wick and watched the fishing boats come home. In winter the storms came "
    "from the west. The harbour master, an old friend named Yves, brought her bread every Sunday.\n"
)
QUESTIONS = [
    "Who kept the lighthouse?",
    "Where is the lighthouse?",
    "Who brought bread?",
    "When did the storms come?",
    "How many steps did she climb?",
    "What did she watch each evening?",
]
NEW_TOKENS = 24


def disagreements(lm, max_gap: float) -> list[str]:
    """Run the forest, then each branch alone; describe every branch whose first difference is no tie."""
    return branches_off_their_runs_alone(lm, DOCUMENT, QUESTIONS, NEW_TOKENS, lambda logits: max_gap)


# A few bf16 steps at the size of the model's largest logits (about 32; bf16 keeps 8 significant bits)
MAX_TIE_GAP = 4 * 2.0**-7 * 32.0


@pytest.fixture(scope="module")
def cpu_bf16():
    return load_model(device="cpu", dtype="bfloat16", quiet=True)


def test_bf16_forest_agrees_with_generate_up_to_ties_on_cpu(cpu_bf16):
    assert disagreements(cpu_bf16, MAX_TIE_GAP) == []


def test_the_tie_check_catches_a_forest_whose_branches_see_each_other(cpu_bf16, monkeypatch):
    """The check can fail: with the ancestor mask broken (every token sees every token), branches
    read each other's questions and their answers differ from `generate` by more than ties."""
    from mdcli.core.engine import Engine

    see_everything = lambda self, allowed: torch.zeros((1, 1, *allowed.shape), dtype=self.dtype)  # noqa: E731
    monkeypatch.setattr(Engine, "_additive", see_everything)
    assert disagreements(cpu_bf16, MAX_TIE_GAP) != []


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bf16_forest_agrees_with_generate_up_to_ties_on_cuda():
    lm = load_model(device="cuda", quiet=True)
    assert lm.dtype in (torch.bfloat16, torch.float16)
    assert disagreements(lm, MAX_TIE_GAP) == []


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_float32_forest_equals_generate_on_cuda():
    lm = load_model(device="cuda", dtype="float32", quiet=True)
    assert disagreements(lm, max_gap=1e-3) == []  # float32 rounding only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (pip install 'mdcli[cuda]')")
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_forest_agrees_with_generate_up_to_ties(bits):
    lm = load_model(load_in_4bit=bits == 4, load_in_8bit=bits == 8, device="cuda", quiet=True)
    assert disagreements(lm, MAX_TIE_GAP) == []
