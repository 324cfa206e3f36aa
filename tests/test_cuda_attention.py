"""mdcli's CUDA forwards leave out cuDNN's attention (a plan build per new shape, every decode
step); CPU forwards are untouched. sdpa's backend switches are process flags that can be set and
read without a GPU, so these run everywhere; the GPU tests run the forest inside the context."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention.cuda import cuda_attention


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


@pytest.mark.parametrize("value", ["1", " 1 "])
def test_mdcli_cudnn_attention_1_allows_cudnn_again(monkeypatch, value):
    monkeypatch.setenv("MDCLI_CUDNN_ATTENTION", value)
    with cuda_attention(torch.device("cuda")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
