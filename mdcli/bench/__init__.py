"""Benchmarks that compare approaches side by side in one process, on the same prompts and model.

Speed claims in this project come from here (recorded in BENCHMARKS.md), never from timing
assertions in unit tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdcli.errors import UsageError

# The rest of mdcli is imported inside the functions here: commands/bench.py imports this package
# for its option constants on every `mdcli --help`, which should not pay for the kernels, the
# host probe or the loader.

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

RANDOM_SHAPES = {
    # name: (family, hidden, layers, heads, kv_heads, intermediate, vocab, head_dim or None: hidden / heads)
    "tiny": ("llama", 64, 2, 4, 2, 128, 49152, None),
    "llama-135m": ("llama", 576, 30, 9, 3, 1536, 49152, None),
    "llama-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, None),
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 128256, None),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 3072, 151936, 128),  # q_norm / k_norm over each head
}


BASELINE_KERNELS = ("stock", "mdcli")
BASELINE_KERNELS_HELP = (
    "stock: the alternatives run on torch's own kernels, as users run them; mdcli: they get mdcli's CPU "
    "kernels too (mdcli.backends.reference), so the ratio shows the algorithm's gain alone"
)


def baseline_kernels(lm: LoadedModel, choice: str):
    """The context the alternatives to mdcli run in (see BASELINE_KERNELS_HELP)."""
    from contextlib import nullcontext  # lazy: see the module's imports

    return lm.forward.reference.kernels() if choice == "mdcli" else nullcontext()


def kernels_line(lm: LoadedModel, choice: str) -> str:
    """One line for reports: which linear kernels each side used."""
    from mdcli.backends.host import cpu_line  # lazy: see the module's imports

    mine = lm.forward.describe()
    theirs = lm.forward.plan.linears.name if choice == "mdcli" else "torch"
    return f"CPU: {cpu_line()}; kernels: mdcli {mine}, alternatives {theirs} (--baseline-kernels {choice})"


def random_model(shape: str, *, device: str = "auto", dtype: str = "auto", attn: str = "sdpa") -> LoadedModel:
    """A random-weight Llama (or Qwen3) of a named shape with the embedded tokenizer: GPU speed can
    be measured where no weights can be downloaded (the tokens are meaningless, the work is real)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        Qwen3Config,
    )

    # lazy: see the module's imports
    from mdcli.models.embedded import embedded_model_dir
    from mdcli.models.load import LoadedModel, resolve_device, resolve_dtype

    if shape not in RANDOM_SHAPES:
        raise UsageError(f"unknown random model shape '{shape}'", fix=f"choose one of {', '.join(RANDOM_SHAPES)}")
    family, hidden, layers, heads, kv_heads, intermediate, vocab, head_dim = RANDOM_SHAPES[shape]
    torch_device = resolve_device(device)
    torch_dtype, reason = resolve_dtype(dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = config_class(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=16384,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        **({"head_dim": head_dim} if head_dim else {}),
    )
    torch.manual_seed(0)
    with torch.device(torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn).eval()
    model.requires_grad_(False)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=f"random {shape}", device=torch_device, dtype=torch_dtype,
        dtype_reason=reason, attn=attn, eos_token_ids=frozenset({tokenizer.eos_token_id}),
        context_length=16384, sliding_window=None, mixed_layer_types=False,
        has_chat_template=bool(tokenizer.chat_template),
    )
