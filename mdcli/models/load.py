"""Load a model for MultiDecode: where it comes from, device, dtype (and why), quantization.

Every refusal happens before the weights are read: options are checked first, then the config
alone (`check_exact_support`), so a model MultiDecode cannot run exactly fails in a second, not
after a multi-gigabyte download. The kernel plan (mdcli.backends.select) is chosen here, once,
and the loaded model carries the forward built from it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub.utils as hub_utils
import torch
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import logging as hf_logging

from mdcli import settings
from mdcli.backends.forward import ModelForward
from mdcli.backends.select import select
from mdcli.backends.weights.gguf_blocks import remember_source
from mdcli.backends.weights.int8 import (
    CHOICES,
    described,
    quantize_model,
    setting_refusal,
)
from mdcli.errors import ModelLoadError, UnsupportedModelError, UsageError, first_line
from mdcli.models.architectures import (
    check_attn_implementation,
    check_exact_support,
    context_length,
    model_type,
    sliding_window_layout,
)
from mdcli.models import hub, on_blocks
from mdcli.models.prompt_identity import check_prompt_cache, prompt_store
from mdcli.prompt_cache.store import PromptStore
from mdcli.models.embedded import (
    EMBEDDED_NAME,
    embedded_gguf_path,
    embedded_model_dir,
    gguf_progress_bar_follows_transformers,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str], None]

DEVICE_ENV = settings.variable("device")  # what --device auto means, when set

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_SOURCE_FIX = "pass a local model folder or .gguf file, or a Hugging Face id"


@dataclass
class LoadedModel:
    """A model ready for the engine, with the facts the renderers report about it."""

    model: PreTrainedModel  # eval mode, requires_grad off
    forward: ModelForward  # what the engine calls: the plan chosen at load (mdcli.backends.select)
    tokenizer: PreTrainedTokenizerBase
    name: str  # "SmolLM2-135M-Instruct (embedded)" or the id/path given
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # "fp32: CPU", "bf16: CUDA supports bf16", "requested", ...
    attn: str  # "sdpa" | "eager"
    eos_token_ids: frozenset[int]  # tokenizer eos + generation_config eos
    context_length: int | None
    sliding_window: int | None
    mixed_layer_types: bool  # True: the engine passes {"full_attention": m, "sliding_attention": m_w}
    has_chat_template: bool
    cpu_weights: str = "float32"  # "int8": projections and head quantized (mdcli.backends.weights.int8)
    prompt_store: PromptStore | None = None  # the prompt cache (mdcli.models.prompt_identity); None: off


@dataclass(frozen=True)
class _Source:
    """What `from_pretrained` reads: a folder or hub id, plus a GGUF file name inside the folder."""

    location: str
    gguf_file: str | None
    name: str
    is_hub_id: bool
    blocks_from: Path | None = None  # the .gguf whose blocks the float32 weights are (mdcli.backends.weights.gguf_blocks)
    local_only: bool = False  # a hub id read from the local cache alone (mdcli.models.hub)


class LoadOptions(BaseModel):
    """What `load_model` is asked to load, and how: one object for the command line and the API."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str | None = None  # None: the embedded SmolLM2; else a folder, a .gguf file or a hub id
    device: str = "auto"
    dtype: str = "auto"
    attn: str = "sdpa"
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    trust_remote_code: bool = False
    device_map: str | None = None
    quiet: bool = False  # silence transformers' own bars and warnings
    progress: Progress | None = None  # one-line progress messages
    cpu_weights: str = "float32"
    prompt_cache: str = "off"  # auto | off | a folder: prefixes kept on disk (the command line's default: auto)
    keep_float32: bool = False  # a .gguf keeps its float32 weights beside its blocks (mdcli.models.on_blocks)
    cuda_graphs: str | None = None  # auto | off | static (mdcli.backends.graphs); None: MDCLI_CUDA_GRAPHS


def load_model(model: str | LoadOptions | None = None, **options) -> LoadedModel:
    """Load a model: `load_model()`, `load_model("path", device="cpu")` or
    `load_model(LoadOptions(...))` (the fields and their defaults: LoadOptions)."""
    chosen = model if isinstance(model, LoadOptions) else LoadOptions(model=model, **options)
    return _load_model(**dict(chosen))


def _load_model(
    model: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attn: str = "sdpa",
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    trust_remote_code: bool = False,
    device_map: str | None = None,
    quiet: bool = False,
    progress: Progress | None = None,
    cpu_weights: str = "float32",
    prompt_cache: str = "off",
    keep_float32: bool = False,
    cuda_graphs: str | None = None,
) -> LoadedModel:
    """Load `model` (None: the embedded SmolLM2; else a folder, a .gguf file or a hub id).
    cpu_weights "int8": quantize the projections and the head for CPU decoding (mdcli.backends.weights.int8).
    prompt_cache: auto | off | a folder (mdcli.models.prompt_identity)."""
    check_attn_implementation(attn)
    check_prompt_cache(prompt_cache)
    chosen = settings.current() if cuda_graphs is None else settings.current().changed(cuda_graphs=cuda_graphs)
    torch_device = resolve_device(device)
    bits = _quantization_bits(load_in_4bit, load_in_8bit, torch_device)
    torch_dtype, dtype_reason = resolve_dtype(dtype, torch_device, bits)
    _check_cpu_weights(cpu_weights, torch_device, torch_dtype, bits)
    with quiet_loading(quiet):
        source = _resolve_source(model, progress)
        config = _refuse_from_config(source, attn, bits, trust_remote_code)
        if progress is not None:
            progress(f"loading {source.name}...")
        placement = _placement(bits, torch_dtype, device_map, torch_device)
        own_bytes = source.blocks_from or (None if source.is_hub_id else Path(source.location))  # mdcli.models.on_blocks
        try:
            hf_model, float32_reason = on_blocks.load_if_covered(own_bytes, config, attn, torch_device, torch_dtype,
                                                                 cpu_weights, placed=bool(placement), keep_float32=keep_float32)
        except _weight_errors() as exc:
            raise _load_error(source, exc) from exc
        if hf_model is None:
            hf_model = _load_weights(source, torch_device, dtype=torch_dtype, attn_implementation=attn,
                                     trust_remote_code=trust_remote_code, **placement)
            if source.blocks_from is not None:
                remember_source(hf_model, source.blocks_from)
        tokenizer = _load_tokenizer(source, trust_remote_code)
    if cpu_weights == "int8":
        dtype_reason += f"; {described(quantize_model(hf_model))}"
    window, mixed = sliding_window_layout(hf_model.config)
    plan = select(hf_model, chosen, float32_reason=float32_reason)  # every kernel choice for this model, made once, here
    device = hf_model.device if placement else torch_device
    store = prompt_store(prompt_cache, location=source.location, gguf_file=source.gguf_file, is_hub_id=source.is_hub_id,
                         hf_model=hf_model, plan=plan, tokenizer=tokenizer, name=source.name, dtype=torch_dtype,
                         device=device, attn=attn, cpu_weights=cpu_weights)
    return LoadedModel(
        model=hf_model,
        forward=ModelForward(hf_model, plan, sliding_window=window),
        tokenizer=tokenizer,
        name=source.name,
        device=device,
        dtype=torch_dtype,
        dtype_reason=dtype_reason,
        attn=attn,
        eos_token_ids=eos_token_ids(tokenizer, getattr(hf_model, "generation_config", None)),
        context_length=context_length(hf_model.config),
        sliding_window=window,
        mixed_layer_types=mixed,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        cpu_weights=cpu_weights,
        prompt_store=store,
    )


def load_tokenizer(
    model: str | None = None, *, trust_remote_code: bool = False, quiet: bool = False
) -> PreTrainedTokenizerBase:
    """Just the tokenizer of `model` (None: the embedded SmolLM2), found the way `load_model` finds
    it and refused with the same messages, without reading any weights (`mdcli explain`)."""
    with quiet_loading(quiet):
        return _load_tokenizer(_resolve_source(model, None), trust_remote_code)


def resolve_device(device: str) -> torch.device:
    """The device to run on: "auto" is $MDCLI_DEVICE when set, else CUDA when present, else CPU; an
    absent GPU is an error."""
    name = device.strip().lower()
    if name != "auto":
        return _named_device(name, f"unknown device '{device}'", "use --device auto, cpu, cuda or cuda:N")
    # $MDCLI_DEVICE lets a GPU machine's user (and the test suite, whose exactness checks are
    # float32 on CPU) keep every run on one device without naming it each time
    chosen = settings.current().device.strip().lower()
    if chosen and chosen != "auto":
        return _named_device(chosen, f"unknown device '{chosen}' in ${DEVICE_ENV}",
                             f"set {DEVICE_ENV} to auto, cpu, cuda or cuda:N")
    return _cuda_device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _named_device(name: str, unknown: str, fix: str) -> torch.device:
    """cpu, cuda, cuda:N or mps as a torch.device; `unknown` and `fix` word the error for any other
    name after where it came from (--device or $MDCLI_DEVICE)."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        return _cuda_device(name)
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError("MPS (Apple GPU) is not available", fix="use --device cpu")
        return torch.device("mps")
    raise UsageError(unknown, fix=fix)


def resolve_dtype(dtype: str, device: torch.device, bits: int | None = None) -> tuple[torch.dtype, str]:
    """The dtype to load in and a short reason to show the user."""
    name = dtype.strip().lower()
    if name != "auto" and name not in _DTYPE_ALIASES:
        raise UsageError(f"unknown dtype '{dtype}'", fix="use --dtype auto, float32, bfloat16 or float16")
    requested = _DTYPE_ALIASES.get(name)
    if bits:
        compute = requested or ("bfloat16" if torch.cuda.is_bf16_supported() else "float16")
        return getattr(torch, compute), f"{bits}-bit bitsandbytes (compute {_SHORT_DTYPE[compute]})"
    if requested:
        _check_requested_dtype(requested, device)
        return getattr(torch, requested), "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bf16: CUDA supports bf16"
        return torch.float16, "fp16: CUDA without bf16"
    return torch.float32, f"fp32: {device.type.upper()}"


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: object | None) -> frozenset[int]:
    """Every id that ends a branch: chat models often list extra ones in generation_config."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if value is None:
            continue
        ids.update(int(v) for v in ([value] if isinstance(value, int) else value))
    return frozenset(ids)


@contextlib.contextmanager
def quiet_loading(quiet: bool) -> Iterator[None]:
    """Silence transformers' and huggingface_hub's progress bars, logs and warnings, then restore."""
    if not quiet:
        yield
        return
    verbosity = hf_logging.get_verbosity()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hub_bars_were_off = hub_utils.are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar_was_on:
            hf_logging.enable_progress_bar()
        if not hub_bars_were_off:
            hub_utils.enable_progress_bars()


def _quantization_bits(load_in_4bit: bool, load_in_8bit: bool, device: torch.device) -> int | None:
    """4, 8 or None; bitsandbytes needs CUDA (chosen as the device, not merely present) and the
    optional extra."""
    if load_in_4bit and load_in_8bit:
        raise UsageError("--load-in-4bit and --load-in-8bit exclude each other", fix="pass only one of them")
    if not (load_in_4bit or load_in_8bit):
        return None
    bits = 4 if load_in_4bit else 8

    if not torch.cuda.is_available():
        raise UsageError(
            "4-bit/8-bit loading needs a CUDA GPU",
            fix=f"drop --load-in-{bits}bit or use --device cuda on a GPU machine",
        )
    if device.type != "cuda":
        raise UsageError(
            f"4-bit/8-bit loading runs on CUDA, not on the chosen device '{device}'",
            fix=f"use --device cuda (check MDCLI_DEVICE) or drop --load-in-{bits}bit",
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError(f"{bits}-bit loading needs bitsandbytes", fix="pip install 'mdcli[cuda]'")
    return bits


def _check_cpu_weights(cpu_weights: str, device: torch.device, dtype: torch.dtype, bits: int | None) -> None:
    if cpu_weights not in CHOICES:
        raise UsageError(f"unknown --cpu-weights '{cpu_weights}'", fix=f"choose {' or '.join(CHOICES)}")
    refused = setting_refusal(device, dtype, bits) if cpu_weights == "int8" else None
    if refused:
        raise UsageError(refused[0], fix=refused[1])


def _cuda_device(name: str) -> torch.device:
    if not torch.cuda.is_available():
        raise UsageError("CUDA is not available", fix="use --device cpu")
    index_text = name.partition(":")[2]
    if not index_text:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if not index_text.isdigit() or int(index_text) >= count:
        raise UsageError(f"no CUDA device '{name}' ({count} present)", fix=f"use --device cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", int(index_text))


def _check_requested_dtype(dtype: str, device: torch.device) -> None:
    if dtype == "float16" and device.type == "cpu":
        raise UsageError("float16 on CPU is slow and inexact", fix="use --dtype float32 or bfloat16")
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("this GPU does not support bfloat16", fix="use --dtype float16 or float32")


def _resolve_source(model: str | None, progress: Progress | None) -> _Source:
    if model is None:
        return _Source(str(embedded_model_dir(progress)), None, EMBEDDED_NAME, is_hub_id=False,
                       blocks_from=embedded_gguf_path())
    if not model.strip():
        raise UsageError("the model name is empty", fix=_SOURCE_FIX)
    path = Path(model).expanduser()
    if path.is_dir():
        return _Source(str(path), None, model, is_hub_id=False)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _Source(str(path.parent), path.name, model, is_hub_id=False, blocks_from=path)
    if path.is_file():
        raise UsageError(f"'{model}' is a file but not a .gguf", fix=_SOURCE_FIX)
    if _looks_like_path(model):
        raise UsageError(f"model path '{model}' does not exist", fix="check the path, or pass a Hugging Face id")
    return _Source(model, None, model, is_hub_id=True, local_only=hub.local_only(model))


def _looks_like_path(model: str) -> bool:
    """Hub ids are "name" or "owner/name"; anything else with a separator is a path.

    A single "/" cannot decide it on POSIX (it is also the id separator), so an id-shaped
    string that is not an existing folder goes to the hub.
    """
    if model.lower().endswith(".gguf") or model.startswith((".", "~", "/")):
        return True
    if os.altsep and os.altsep != "/" and os.altsep in model:
        return True
    if os.sep != "/" and os.sep in model:
        return True
    return model.count("/") > 1


def _load_config(source: _Source, trust_remote_code: bool) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(
            source.location, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code,
            local_files_only=source.local_only,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(source, exc) from exc


def _refuse_from_config(source: _Source, attn: str, bits: int | None, trust_remote_code: bool) -> PretrainedConfig:
    """Every check that needs the config but not the weights, so refusals cost seconds."""
    if bits and source.gguf_file:
        raise UsageError(
            f"a .gguf file cannot be loaded in {bits}-bit",
            fix=f"drop --load-in-{bits}bit or pass a safetensors model folder",
        )
    config = _load_config(source, trust_remote_code)
    check_exact_support(config, attn)
    _check_model_class(config, attn, trust_remote_code)
    return config


def _check_model_class(config: PretrainedConfig, attn: str, trust_remote_code: bool) -> None:
    """Refuse, from the config alone, models with no causal-LM class or no sdpa (Gemma2, GPT-J)."""
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        raise UnsupportedModelError(
            f"{model_type(config)} has no causal language-model class in transformers",
            fix="choose a decoder-only text-generation model",
        ) from None
    if attn == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        raise UnsupportedModelError(
            f"{model_type(config)} has no sdpa attention in transformers", fix="use --attn eager"
        )


def _placement(bits: int | None, dtype: torch.dtype, device_map: str | None, device: torch.device) -> dict:
    """from_pretrained options that place the weights; {} means load on CPU, then `.to(device)`.

    bitsandbytes weights cannot be moved after loading, so they always go through a device_map.
    """
    if bits:
        return {"quantization_config": _bitsandbytes_config(bits, dtype), "device_map": device_map or {"": str(device)}}
    return {"device_map": device_map} if device_map else {}


def _load_weights(source: _Source, device: torch.device, **kwargs: object) -> PreTrainedModel:
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    kwargs["local_files_only"] = source.local_only
    try:
        with gguf_progress_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except _weight_errors() as exc:
        raise _load_error(source, exc) from exc
    if "device_map" not in kwargs:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _weight_errors() -> tuple[type[BaseException], ...]:
    """What broken or missing weight files raise (safetensors' error is no OSError)."""
    return (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


def _bitsandbytes_config(bits: int, compute_dtype: torch.dtype) -> object:
    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _load_tokenizer(source: _Source, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(
            source.location, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code,
            local_files_only=source.local_only,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(source, exc) from exc


def _load_error(source: _Source, exc: BaseException) -> Exception:
    """One actionable line for a failed load: offline hub, custom code, or broken files."""
    detail = first_line(exc)
    if "trust_remote_code" in str(exc):
        return UsageError(
            f"{source.name} needs its own Python code to load", fix="pass --trust-remote-code if you trust its author"
        )
    if not source.is_hub_id:
        return ModelLoadError(f"could not load '{source.name}': {detail}", fix=_SOURCE_FIX)
    return hub.load_error(source.name, detail, local_only=source.local_only)
