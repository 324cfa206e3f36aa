"""`--cpu-weights int8`: the projections quantized once, every product on torch's int8 kernel with bf16
activations, and the forest still each branch's own run of that same int8 model, up to near-ties.

The int8 model is a different model from the float32 one (that is the quantization's price); what
the forest promises is about the model it runs: each branch is token for token `generate` alone over
the same int8 weights until a token where the reference's own logits are a near-tie, as for bf16
(README, "Exactness"). The products themselves are row-independent: a token's product is the same
bits whatever else is in the forward.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from mdcli.cli.app import app
from mdcli.backends.weights.int8 import (
    KERNEL_MAX_ROWS,
    fused_int8,
    has_int8_weights,
    int8_linear,
    model_refusal,
    quantize,
    quantize_model,
    setting_refusal,
)
from mdcli.models.load import load_model
from tests.reference import branches_off_their_runs_alone
from tests.tiny_models import TINY_ARCHS

DOCUMENT = (
    "Mara kept the lighthouse on the coast of Brittany for thirty years. Each evening she climbed the "
    "hundred steps, trimmed the wick and watched the fishing boats come home. In winter the storms came "
    "from the west. The harbour master, an old friend named Yves, brought her bread every Sunday.\n"
)
QUESTIONS = ["Who kept the lighthouse?", "Where is the lighthouse?", "Who brought bread?",
             "When did the storms come?", "How many steps did she climb?"]
NEW_TOKENS = 24
BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: neighbours differ by up to 2^-7 of their size


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def _exact_product(x: torch.Tensor, weight) -> torch.Tensor:
    """The kernel's arithmetic written out: bf16 activations times int8 values, summed in float32, scaled."""
    return (x.to(torch.bfloat16).float() @ weight.values.float().T) * weight.scales.float()


@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("inner", [64, 100])  # 100: not a multiple of the kernel's block, so never the kernel
def test_an_int8_product_is_the_quantized_weight_times_bf16_activations_rounded_to_bf16(rows, inner):
    weight = quantize(_weight(48, inner))
    x = torch.randn(rows, inner, generator=torch.Generator().manual_seed(1))
    ours = int8_linear(x, weight)
    exact = _exact_product(x, weight)
    assert ours.dtype == torch.float32 and ours.shape == (rows, 48)
    assert torch.allclose(ours, exact, rtol=BF16_STEP, atol=1e-6)


def test_quantized_values_times_scales_give_back_the_weight_to_half_a_step():
    w = _weight(32, 64)
    q = quantize(w)
    assert q.values.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    assert int(q.values.abs().max()) <= 127
    step = q.scales.float()[:, None]
    assert torch.all((q.values.float() * step - w).abs() <= step / 2 + 1e-7)


def test_a_token_gets_the_same_int8_product_whatever_else_is_in_the_forward():
    # bit-identical on the hosts measured (AVX-512, and ATEN_CPU_CAPABILITY=avx2); across hosts and
    # kernels a float is held to its rounding, here one bf16 step of the result
    weight = quantize(_weight(96, 64))
    x = torch.randn(KERNEL_MAX_ROWS, 64, generator=torch.Generator().manual_seed(2))
    together = int8_linear(x, weight)
    for i in range(KERNEL_MAX_ROWS):
        assert torch.allclose(int8_linear(x[i:i + 1], weight), together[i:i + 1], rtol=BF16_STEP, atol=0)


def test_quantizing_a_model_fuses_q_k_v_and_gate_up_and_mdclis_forward_reads_them_without_a_copy(tiny_dir):
    lm = load_model(str(tiny_dir("llama")), quiet=True, cpu_weights="int8")
    assert has_int8_weights(lm.model) and lm.cpu_weights == "int8" and "int8 weights" in lm.dtype_reason
    attention = lm.model.model.layers[0].self_attn
    fused = fused_int8([attention.q_proj, attention.k_proj, attention.v_proj])
    assert fused.values.data_ptr() == attention.q_proj.values.data_ptr()  # the slices' own buffer
    assert fused.values.shape[0] == sum(m.out_features for m in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert not any(isinstance(m, torch.nn.Linear) for m in lm.model.model.layers.modules())


def _disagreements(lm) -> list[str]:
    """Branches whose first difference from the same int8 model alone is no near-tie: more than 4
    bf16 steps at the size of the reference's largest logit."""
    return branches_off_their_runs_alone(lm, DOCUMENT, QUESTIONS, NEW_TOKENS,
                                         lambda logits: 4 * BF16_STEP * float(logits.abs().max()))


@pytest.fixture(scope="module")
def embedded_int8():
    return load_model(quiet=True, cpu_weights="int8")


def test_the_int8_forest_is_each_branch_of_the_int8_model_alone_up_to_near_ties(embedded_int8):
    assert embedded_int8.forward.own is not None  # mdcli's own forward takes int8 weights
    assert _disagreements(embedded_int8) == []


def test_the_int8_tie_check_catches_a_forest_whose_branches_see_each_other(embedded_int8, monkeypatch):
    from mdcli.core.engine import Engine

    see_everything = lambda self, allowed: torch.zeros((1, 1, *allowed.shape), dtype=self.dtype)  # noqa: E731
    monkeypatch.setattr(Engine, "_additive", see_everything)
    assert _disagreements(embedded_int8) != []


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "gpt2"])
def test_tiny_models_of_every_layer_kind_run_int8_as_their_branches_alone_up_to_near_ties(tiny_dir, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True, cpu_weights="int8")
    assert has_int8_weights(lm.model)
    assert _disagreements(lm) == []


def test_gpt2s_conv1d_projections_are_refused_with_the_fix(tiny_dir):
    from mdcli.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError) as refused:
        load_model(str(tiny_dir("gpt2")), quiet=True, cpu_weights="int8")
    assert "gpt2" in str(refused.value) and "drop --cpu-weights int8" in refused.value.fix


def test_int8_weights_are_refused_on_cuda_below_float32_and_beside_bitsandbytes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert setting_refusal(cpu, torch.float32, None) is None
    assert "CPU runs" in setting_refusal(cuda, torch.float32, None)[0]
    assert "bfloat16" in setting_refusal(cpu, torch.bfloat16, None)[0]
    assert "both quantize" in setting_refusal(cpu, torch.float32, 8)[0]


def test_a_model_refused_for_int8_is_left_as_it_was():
    from transformers import GPT2Config, GPT2LMHeadModel

    from mdcli.errors import UnsupportedModelError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert model_refusal(model) is not None
    with pytest.raises(UnsupportedModelError):
        quantize_model(model)
    assert type(model.lm_head) is torch.nn.Linear  # nothing quantized


def test_cli_refuses_an_unknown_weight_kind_and_int8_beside_bf16_in_one_line_each():
    runner = CliRunner()
    unknown = runner.invoke(app, ["ask-many", "-", "-q", "Who?", "--cpu-weights", "int4"], input="Text.\n")
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == "mdcli: error: unknown --cpu-weights 'int4'; choose float32 or int8"
    bf16 = runner.invoke(app, ["ask-many", "-", "-q", "Who?", "--cpu-weights", "int8", "--dtype", "bfloat16",
                               "--device", "cpu"], input="Text.\n")
    assert bf16.exit_code == 2
    assert bf16.stderr.strip() == ("mdcli: error: --cpu-weights int8 keeps float32 activations, not bfloat16; "
                                   "drop --dtype or give --dtype float32")


def test_ask_many_runs_on_int8_weights_from_the_command_line_and_says_so(tiny_dir):
    result = CliRunner().invoke(app, ["ask-many", "-", "-q", "Who kept the lighthouse?", "-q", "Where?",
                                      "--model", str(tiny_dir("llama")), "--cpu-weights", "int8", "-n", "6",
                                      "--device", "cpu", "-o", "plain", "--verbose"], input=DOCUMENT)
    assert result.exit_code == 0, result.output
    assert result.stdout.count("## ") == 2
    assert "int8 weights" in result.stderr and "kernels torch int8" in result.stderr  # the header says what ran


def test_an_int8_step_reads_under_a_third_of_the_float32_steps_weight_bytes(embedded_float32, embedded_int8):
    from mdcli.bench.ask import weight_bytes

    assert weight_bytes(embedded_int8.model) < weight_bytes(embedded_float32.model) / 3
