"""What the benchmarks share: the context the alternatives to mdcli run in, the line that names
each side's kernels, and random-weight models of real shapes."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

from mdcli.backends.forward import ModelForward
from mdcli.backends.host import cpu_line
from mdcli.backends.select import select
from mdcli.bench import RANDOM_SHAPES
from mdcli.errors import UsageError
from mdcli.models.embedded import embedded_model_dir
from mdcli.models.load import LoadedModel, resolve_device, resolve_dtype


def set_bench_threads(threads: int | None, device: str) -> int:
    """Set and return torch's threads for a benchmark: `threads`, else 1 where `device` resolves to
    the CPU (comparable on shared machines), else torch's own. Call it before the model loads: the
    kernel plan is chosen for the threads torch has then (mdcli.backends.select)."""
    used = threads or (1 if resolve_device(device).type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(used)
    return used


def baseline_kernels(lm: LoadedModel, choice: str):
    """The context the alternatives to mdcli run in (see BASELINE_KERNELS_HELP)."""
    return lm.forward.reference.kernels() if choice == "mdcli" else nullcontext()


def kernels_line(lm: LoadedModel, choice: str) -> str:
    """One line for reports: which linear kernels each side used."""
    mine = lm.forward.describe()
    theirs = lm.forward.plan.linears.name if choice == "mdcli" else "torch"
    return f"CPU: {cpu_line()}; kernels: mdcli {mine}, alternatives {theirs} (--baseline-kernels {choice})"


def random_model(shape: str, *, device: str = "auto", dtype: str = "auto", attn: str = "sdpa") -> LoadedModel:
    """A random-weight Llama (or Qwen3) of a named shape with the embedded tokenizer: GPU speed can
    be measured where no weights can be downloaded (the tokens are meaningless, the work is real)."""
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
        model=model, forward=ModelForward(model, select(model)), tokenizer=tokenizer, name=f"random {shape}", device=torch_device, dtype=torch_dtype,
        dtype_reason=reason, attn=attn, eos_token_ids=frozenset({tokenizer.eos_token_id}),
        context_length=16384, sliding_window=None, mixed_layer_types=False,
        has_chat_template=bool(tokenizer.chat_template),
    )
