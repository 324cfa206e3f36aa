"""mdcli's forwards run float32 CPU linears on oneDNN: the same results to float32 rounding, only
inside mdcli's own forwards, and never where it does not apply (autograd, other dtypes, opt-out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from mdcli.kernels import OPT_OUT, cpu_linear_context, linear_kernel_name, onednn_linear, onednn_linear_available
from tests.test_engine_exactness import engine_for, random_prompts, tiny_model

ONEDNN_OP = "mkldnn::_linear_pointwise"

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


def ops_run(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


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
    stock = F.linear
    with pytest.raises(KeyboardInterrupt), onednn_linear():
        assert F.linear is not stock
        raise KeyboardInterrupt
    assert F.linear is stock
    assert ONEDNN_OP not in ops_run(lambda: F.linear(torch.randn(2, 8), torch.randn(4, 8)))


def test_nested_and_overlapping_contexts_restore_torchs_linear_once_all_have_left():
    import threading

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
    assert linear_kernel_name(cpu, torch.float32) == "oneDNN"
    assert linear_kernel_name(cpu, torch.bfloat16) == "torch"
    assert linear_kernel_name(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv(OPT_OUT, "torch")
    assert linear_kernel_name(cpu, torch.float32) == "torch"
    with cpu_linear_context(cpu, torch.float32):
        assert ONEDNN_OP not in ops_run(lambda: F.linear(torch.randn(2, 8), torch.randn(4, 8)))


@pytest.mark.parametrize("setting, expected", [("", True), ("torch", False)])
def test_engine_forwards_use_onednn_unless_opted_out(setting, expected, monkeypatch):
    monkeypatch.setenv(OPT_OUT, setting)
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model)
    prompt = random_prompts(12, [1])[0]
    ran = ops_run(lambda: engine.forward(torch.zeros(1, 0, dtype=torch.bool), [prompt]))
    assert (ONEDNN_OP in ran) is expected
    assert ONEDNN_OP not in ops_run(lambda: model(torch.tensor([prompt])))  # the plain model is untouched
