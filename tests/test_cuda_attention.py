"""mdcli's CUDA forwards leave out cuDNN's attention (a plan build per new shape, every decode
step); CPU forwards are untouched. sdpa's backend switches are process flags that can be set and
read without a GPU, so these run everywhere; the GPU tests run the forest inside the context.
MDCLI_CUDNN_ATTENTION allows cuDNN again: the plan carries it (mdcli.backends.select), the
forward hands it to `cuda_attention`."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention.cuda import cuda_attention
from mdcli.backends.forward import ModelForward
from mdcli.backends.select import select
from tests.test_engine_exactness import settings_with, tiny_model


def test_cuda_forwards_run_without_cudnn_attention_and_restore_it_after():
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with cuda_attention(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cpu_forwards_keep_every_backend():
    with cuda_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_plan_leaves_cudnn_out_by_default():
    assert select(tiny_model("llama", "sdpa"), settings_with()).cudnn_attention is False
    assert settings_with().cudnn_attention is False


@pytest.mark.parametrize("value", ["1", " 1 ", "on", "ON", True])
def test_mdcli_cudnn_attention_1_allows_cudnn_again(value):
    plan = select(tiny_model("llama", "sdpa"), settings_with(cudnn_attention=value))
    assert plan.cudnn_attention is True
    with cuda_attention(torch.device("cuda"), plan.cudnn_attention):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_forward_runs_in_the_context_its_plan_allows(monkeypatch):
    """ModelForward enters cuda_attention with its device and the plan's cudnn_attention."""
    from mdcli.backends import forward as forward_module

    model = tiny_model("llama", "sdpa")
    entered = []

    def recorded(device, allow_cudnn=False):
        entered.append((device.type, allow_cudnn))
        return cuda_attention(device, allow_cudnn)

    monkeypatch.setattr(forward_module, "cuda_attention", recorded)
    for allow in (False, True):
        model_forward = ModelForward(model, select(model, settings_with(cudnn_attention=allow)))
        tokens = torch.tensor([3, 4, 5])
        model_forward(tokens, torch.arange(3), None, _cache(), torch.tensor([2]))
    assert entered == [("cpu", False), ("cpu", True)]


def _cache():
    from mdcli.core import cache as kv

    return kv.new_cache()
