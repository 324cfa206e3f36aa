"""Tiny random models saved to folders, so tests run the real loading path offline.

Not a test module: other tests import it (`from tests.tiny_models import make_tiny_model`). Every tiny
model reuses the embedded SmolLM2 tokenizer (real BPE, ChatML template, vocab 49152), so prompts
tokenize exactly as with the default model. Sizes: hidden 64, 2-4 layers, fp32, tied embeddings;
the 49152 x 64 embedding dominates (about 13 MB per model).

`TOKENIZER_SOURCE` is resolved lazily (module `__getattr__`): the first use converts the embedded
model into the mdcli cache if that has not happened yet (about 25 s once per cache folder).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

TINY_ARCHS = ["llama", "gpt2", "qwen2", "qwen3", "mistral", "gemma3"]
REFUSED_KINDS = ["bloom", "mamba"]
TINY_SLIDING_WINDOW = 8  # small, so a few dozen tokens already exercise the window
TINY_MAX_POSITIONS = 2048

_HIDDEN = 64
_INTERMEDIATE = 128
_HEADS = 4
_KV_HEADS = 2


def __getattr__(name: str) -> Any:
    if name == "TOKENIZER_SOURCE":
        from mdcli.models.embedded import embedded_model_dir

        return embedded_model_dir()
    raise AttributeError(name)


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded SmolLM2 tokenizer, loaded once per test session."""
    from transformers import AutoTokenizer

    from mdcli.models.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def make_tiny_model(arch: str, folder: Path, *, seed: int = 0) -> Path:
    """Build a random `arch` model (see TINY_ARCHS), save it and the tokenizer into `folder`."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    return _save_random_model(_tiny_config(arch), Path(folder), seed)


def make_refused_model(kind: str, folder: Path, *, with_weights: bool = True, seed: int = 0) -> Path:
    """A tiny model MultiDecode must refuse: "bloom" (ALiBi) or "mamba" (recurrent).

    With `with_weights=False` only config and tokenizer are written, so a loader that got as far
    as reading weights fails differently than one that refused from the config.
    """
    if kind not in REFUSED_KINDS:
        raise ValueError(f"unknown refused kind {kind!r}; choose from {REFUSED_KINDS}")
    config = _refused_config(kind)
    folder = Path(folder)
    if with_weights:
        return _save_random_model(config, folder, seed)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _save_random_model(config: PretrainedConfig, folder: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from mdcli.models.load import quiet_loading

    torch.manual_seed(seed)
    with quiet_loading(True):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _token_ids() -> dict[str, int | None]:
    tok = tiny_tokenizer()
    return {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _tiny_config(arch: str) -> PretrainedConfig:
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    ids = _token_ids()
    common = dict(
        hidden_size=_HIDDEN,
        intermediate_size=_INTERMEDIATE,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        **ids,
    )
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=2, **common)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=2, **common)
    if arch == "qwen3":  # q_norm and k_norm over each head
        return Qwen3Config(num_hidden_layers=2, head_dim=_HIDDEN // _HEADS, **common)
    if arch == "mistral":
        return MistralConfig(num_hidden_layers=2, sliding_window=TINY_SLIDING_WINDOW, **common)
    if arch == "gemma3":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        return Gemma3TextConfig(
            num_hidden_layers=4,
            head_dim=_HIDDEN // _HEADS,
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=layer_types,
            **common,
        )
    return GPT2Config(  # learned absolute positions, multi-head (no GQA in GPT-2)
        n_embd=_HIDDEN,
        n_inner=_INTERMEDIATE,
        n_layer=2,
        n_head=_HEADS,
        n_positions=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        **ids,
    )


def _refused_config(kind: str) -> PretrainedConfig:
    from transformers import BloomConfig, MambaConfig

    ids = _token_ids()
    if kind == "bloom":
        return BloomConfig(hidden_size=_HIDDEN, n_layer=2, n_head=_HEADS, **ids)
    return MambaConfig(hidden_size=_HIDDEN, num_hidden_layers=2, state_size=8, **ids)
