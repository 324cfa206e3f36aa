"""Which attention kernels mdcli's CUDA forwards may use: every sdpa backend but cuDNN's.

torch's sdpa prefers cuDNN's attention for bf16 and fp16 on recent GPUs (an H100 here). cuDNN
builds an execution plan for every new shape of queries, keys and mask and caches it by that shape;
a decode step attends over one more cached token than the step before, so every step is a new shape
and pays a plan build on the host, every time. A second run over the same lengths finds the plans
cached and runs at full speed, which is how the cost showed: on an H100 the first of two identical
bf16 runs stepped 2-3.5x slower than the second (BENCHMARKS.md, "On a GPU"). Without cuDNN, sdpa
takes flash attention (a lone token, no mask) or the memory-efficient kernel (a tree mask), neither
of which builds anything per shape. float32 never reaches cuDNN's kernel, and CPU forwards are
untouched. `MDCLI_CUDNN_ATTENTION=1` allows it again, to compare.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



def cuda_attention(device: torch.device, allow_cudnn: bool = False) -> AbstractContextManager:
    """The context mdcli's forwards on `device` run in: sdpa without cuDNN on CUDA (unless
    `allow_cudnn`: the plan's MDCLI_CUDNN_ATTENTION), else nothing."""
    if device.type != "cuda" or allow_cudnn:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
