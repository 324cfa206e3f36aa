"""mdcli's float32 CPU forwards run linears and masked attention on oneDNN: the same results to
float32 rounding, only inside mdcli's own forwards, and never where they do not apply (autograd,
other dtypes, one query, attention extras, the opt-out)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mdcli.bench.kernels import random_forest_mask
from mdcli.backends import kernels
from mdcli.errors import UsageError
from mdcli.backends.kernels import OPT_OUT, cpu_kernels, kernel_choice, kernel_name, onednn_attention, onednn_linear, onednn_works
from tests.test_engine_exactness import engine_for, random_prompts, tiny_model

ONEDNN_OP = "mkldnn::_linear_pointwise"
FLASH_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"

pytestmark = pytest.mark.skipif(not onednn_works(), reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def routing_forced_on(monkeypatch):
    """The routing's mechanics are tested on every host; whether it is chosen by default depends on
    the CPU (AVX-512) and is tested on its own below."""
    monkeypatch.setenv(OPT_OUT, "onednn")


def ops_run(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


# -- linears --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (1, 5, 576), (2, 3, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_computes_torchs_linear_to_float32_rounding(shape, bias):
    generator = torch.Generator().manual_seed(len(shape) + shape[0])
    x = torch.randn(*shape, generator=generator)
    w = torch.randn(1536, 576, generator=generator)
    b = torch.randn(1536, generator=generator) if bias else None
    want = F.linear(x, w, b)
    with onednn_linear():
        got = F.linear(x, w, b)
        assert ONEDNN_OP in ops_run(lambda: F.linear(x, w, b))
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_the_routing_ends_with_its_context_even_after_an_error():
    stock_linear, stock_sdpa = F.linear, ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.raises(KeyboardInterrupt), cpu_kernels(torch.device("cpu"), torch.float32):
        assert F.linear is not stock_linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is not stock_sdpa
        raise KeyboardInterrupt
    assert F.linear is stock_linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is stock_sdpa
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert ONEDNN_OP not in ops_run(lambda: F.linear(torch.randn(2, 8), torch.randn(4, 8)))


def test_nested_and_overlapping_contexts_restore_torchs_linear_once_all_have_left():
    stock = F.linear
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with onednn_linear():
            inside.set()
            leave.wait(5)

    worker = threading.Thread(target=other_thread)
    with onednn_linear():
        worker.start()
        inside.wait(5)
        with onednn_linear():
            assert F.linear is not stock
    assert F.linear is not stock  # the other thread is still inside
    leave.set()
    worker.join(5)
    assert F.linear is stock


def test_autograd_and_other_dtypes_keep_torchs_own_linear():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8)
    with onednn_linear():
        assert ONEDNN_OP not in ops_run(lambda: F.linear(x, w).sum().backward())
        assert ONEDNN_OP not in ops_run(lambda: F.linear(x.detach().double(), w.double()))
    assert x.grad is not None and x.grad.shape == x.shape


def test_the_opt_out_and_non_float32_models_get_no_routing(monkeypatch):
    cpu = torch.device("cpu")
    assert kernel_name(cpu, torch.float32) == "oneDNN"
    assert kernel_name(cpu, torch.bfloat16) == "torch"
    assert kernel_name(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv(OPT_OUT, "torch")
    assert kernel_name(cpu, torch.float32) == "torch"
    with cpu_kernels(cpu, torch.float32):
        assert F.linear is torch.nn.functional.linear
        assert ONEDNN_OP not in ops_run(lambda: F.linear(torch.randn(2, 8), torch.randn(4, 8)))


@pytest.mark.parametrize("capability, machine, setting, expected", [
    ("AVX512", "x86_64", "", "oneDNN"),  # measured faster there: the default
    ("AVX512", "x86_64", "auto", "oneDNN"),
    ("AVX2", "x86_64", "", "torch"),  # measured slower on an AVX2-only Zen 3: torch's own kernels
    ("AVX2", "x86_64", "onednn", "oneDNN"),  # forced
    ("AVX512", "x86_64", "torch", "torch"),  # opted out
    ("AVX512", "arm64", "", "torch"),  # never measured off x86-64
    ("DEFAULT", "x86_64", "", "torch"),
])
def test_routing_is_chosen_by_what_pays_on_this_cpu(capability, machine, setting, expected, monkeypatch):
    import platform

    monkeypatch.setattr(kernels, "cpu_capability", lambda: capability)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv(OPT_OUT, setting)
    choice = kernel_choice(torch.device("cpu"), torch.float32)
    assert choice.name == expected
    assert choice.reason  # the header and bench say why


def test_the_reason_names_the_cpu_feature_or_the_setting(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_capability", lambda: "AVX2")
    monkeypatch.setenv(OPT_OUT, "auto")
    assert str(kernel_choice(torch.device("cpu"), torch.float32)).startswith("torch (AVX2 without AVX-512")
    monkeypatch.setenv(OPT_OUT, "torch")
    assert f"{OPT_OUT}=torch" in str(kernel_choice(torch.device("cpu"), torch.float32))


def test_an_unknown_kernel_setting_is_a_usage_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv(OPT_OUT, "fastest")
    with pytest.raises(UsageError, match="auto, torch or onednn"):
        kernel_choice(torch.device("cpu"), torch.float32)


# -- attention ------------------------------------------------------------------------------------


def forest_mask(queries: int, keys: int, seed: int) -> torch.Tensor:
    return random_forest_mask(queries, keys, torch.Generator().manual_seed(seed))


class Attention(torch.nn.Module):
    """What transformers passes as `module`: only num_key_value_groups is read."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("heads, kv_heads, queries, keys, scaling", [
    (9, 3, 8, 300, None), (4, 4, 5, 64, 0.3), (8, 1, 2, 100, None), (6, 2, 17, 257, 0.125),
])
def test_masked_attention_on_onednn_equals_sdpa_to_float32_rounding(heads, kv_heads, queries, keys, scaling):
    generator = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(1, heads, queries, 32, generator=generator)
    k, v = (torch.randn(1, kv_heads, keys, 32, generator=generator) for _ in range(2))
    mask = forest_mask(queries, keys, seed=keys)
    module = Attention(heads // kv_heads)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with torch.inference_mode():
        want, _ = sdpa(module, q, k, v, mask, scaling=scaling)
        with onednn_attention():
            routed = ALL_ATTENTION_FUNCTIONS["sdpa"]
            got, _ = routed(module, q, k, v, mask, scaling=scaling)
            ran = ops_run(lambda: routed(module, q, k, v, mask, scaling=scaling))
    assert ONEDNN_OP in ran and FLASH_OP not in ran
    assert got.shape == want.shape == (1, queries, heads, 32)
    assert float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("case", ["one query", "no mask", "softcap", "sinks", "autograd", "bf16"])
def test_attention_it_does_not_cover_goes_to_the_stock_function(case):
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask, extras = forest_mask(3, 10, seed=0), {}
    if case == "one query":
        q, mask = q[:, :, :1], mask[:, :, :1]
    elif case == "no mask":
        mask = None
    elif case == "softcap":
        extras["softcap"] = 30.0
    elif case == "sinks":  # a tensor per head, as gpt-oss passes them
        extras["s_aux"] = torch.zeros(4)
    elif case == "bf16":
        q, k, v, mask = (t.bfloat16() for t in (q, k, v, mask))
    module = Attention(2)
    grad = torch.enable_grad() if case == "autograd" else torch.inference_mode()
    with grad, onednn_attention():
        routed = ALL_ATTENTION_FUNCTIONS["sdpa"]
        if case == "softcap":  # the stock function refuses it, and so the routed one does too
            with pytest.raises(ValueError, match="softcap"):
                routed(module, q, k, v, mask, **extras)
            return
        ran = ops_run(lambda: routed(module, q, k, v, mask, **extras))
    assert ONEDNN_OP not in ran


# -- the engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, expected", [("onednn", True), ("torch", False)])
def test_engine_forwards_use_onednn_when_chosen(setting, expected, monkeypatch):
    monkeypatch.setenv(OPT_OUT, setting)
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model)
    prompts = random_prompts(12, [2, 3])
    root = torch.zeros(1, 0, dtype=torch.bool)
    ran = ops_run(lambda: engine.forward(root.expand(2, 0), [prompts[0], prompts[1]]))  # two roots: masked
    assert (ONEDNN_OP in ran) is expected
    assert (FLASH_OP not in ran) is expected  # the masked attention ran on oneDNN too
    assert ONEDNN_OP not in ops_run(lambda: model(torch.tensor([prompts[0]])))  # the plain model is untouched
