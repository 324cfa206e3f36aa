"""Which attention kernels mdcli's CUDA forwards may use: every sdpa backend but cuDNN's.

Rule: CUDA forwards run sdpa without cuDNN's attention, so it takes flash attention (a lone token,
no mask) or the memory-efficient kernel (a tree mask), neither of which builds anything per shape.
float32 never reaches cuDNN's kernel, and CPU forwards are untouched. `MDCLI_CUDNN_ATTENTION=1`
allows it again, to compare.

Why: torch's sdpa prefers cuDNN's attention for bf16 and fp16 on recent GPUs. cuDNN builds an
execution plan for every new shape of queries, keys and mask and caches it by that shape; a decode
step attends over one more cached token than the step before, so every step is a new shape and pays
a plan build on the host, every time (measured: notebook/gpu.md, "On a GPU (NVIDIA H100)").
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    import torch



def cuda_attention(device: torch.device, allow_cudnn: bool = False) -> AbstractContextManager:
    """The context mdcli's forwards on `device` run in: sdpa without cuDNN on CUDA (unless
    `allow_cudnn`: the plan's MDCLI_CUDNN_ATTENTION), else nothing."""
    if device.type != "cuda" or allow_cudnn:
        return nullcontext()

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
