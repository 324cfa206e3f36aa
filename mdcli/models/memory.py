"""How much memory a cache needs and how much is free: used to refuse hopeless runs up front."""

from __future__ import annotations

from mdcli.models.architectures import text_config


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer: layers x 2 x kv_heads x head_dim x bytes."""
    config = text_config(config)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def available_memory_bytes(device) -> int | None:
    """Memory free where the cache lives: CUDA's free bytes; on Linux MemAvailable (free plus
    reclaimable page cache), else free pages from sysconf; None when unknown."""
    import os

    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
