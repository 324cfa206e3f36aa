"""Load a .gguf model whose projections, head and embedding stay in the file's blocks: no float32 copy.

Rule: a float32 CPU load of a .gguf (the embedded model is one) whose every projection, head and
embedding the block kernel reads (mdcli.backends.weights.gguf_kinds: the legacy, K-quant and 16-bit
types of the files users download), on a Llama-family model mdcli's own
forward runs without a sliding window, is built on the meta device and only its norms, biases and
rotary tables are made real. The projections and head are multiplied by the file's blocks at every
width (mdcli.backends.weights.gguf_blocks), the embedding's rows read from its blocks, so the
weights cost what the file costs instead of four bytes a weight (measured: notebook/memory.md). Anything else (another architecture, a
type the kernel does not read (F32 matrices, the IQ types), a window, `LoadOptions(keep_float32=True)`) loads as before, with the reason kept for the plan.

A local folder of bf16 or f16 safetensors is held the same way (`load_half_folder`): its projections,
head and embedding stay in their own 2 bytes, read tensor by tensor (mdcli.backends.weights.
safetensors_file), and are widened in the kernel, which is exact: the float32 model
`from_pretrained(dtype=float32)` makes, in half its bytes.

Exactness: every block matrix is checked bit for bit against the float32 weights transformers'
own GGUF loader would have made of that tensor (gguf-py's dequantization, then the loader's own
tensor processor, which undoes llama.cpp's rotary permutation of q and k), one tensor at a time,
so the model multiplies by exactly the weights `from_pretrained` would give it. A passed check is
recorded (mdcli.models.block_checks) under a key over the file's bytes, the config, the kernel's
build and the loader's versions; a later load with the same key takes the recorded layouts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from mdcli import settings as settings_module
from mdcli.backends.forward_support import unsupported_reason
from mdcli.backends.weights import gguf_blocks, gguf_reading, safetensors_file
from mdcli.backends.weights.gguf_file import read_file
from mdcli.models import block_checks
from mdcli.models.architectures import sliding_window_layout

# The projections whose weights the blocks replace (their float32 weights stay on the meta device).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HALF_DTYPES = ("BF16", "F16")  # safetensors' names of the 16-bit types the kernel widens (and its own)
_KIND_OF = {torch.bfloat16: "BF16", torch.float16: "F16"}


def refusal(config, device: torch.device, dtype: torch.dtype, cpu_weights: str, keep_float32: bool = False) -> str | None:
    """Why this load keeps float32 weights, from the options and config alone (None: it need not)."""
    current = settings_module.current()
    if keep_float32:
        return "asked to keep them (LoadOptions.keep_float32: transformers' generate needs them)"
    if not current.gguf_blocks:
        return f"{settings_module.variable('gguf_blocks')}=0"
    if current.forward == "transformers":
        return f"{settings_module.variable('forward')}=transformers"
    if device.type != "cpu" or dtype != torch.float32 or cpu_weights != "float32":
        return "only float32 CPU models multiply by the blocks"
    if sliding_window_layout(config)[0] is not None:
        return "a sliding window: its lone tokens run on transformers' forward"
    if gguf_blocks.max_rows() == 0 or not gguf_blocks.blocks_work():
        return "the block kernel does not run on this CPU"
    return None


def load_if_covered(path: Path | None, config, attn: str, device: torch.device, dtype: torch.dtype, cpu_weights: str,
                    *, placed: bool = False, keep_float32: bool = False) -> tuple[torch.nn.Module | None, str | None]:
    """(the model on its file's own weights, None) where this module covers the load, else (None, why
    its float32 weights are loaded: None for a model that has no smaller form: no .gguf, no folder
    of 16-bit safetensors). path: the .gguf, or the model's local folder. placed: a device map
    places the weights."""
    if path is None or (path.is_dir() and not half_precision_files(path)):
        return None, None
    if path.is_dir() and (device.type != "cpu" or dtype != torch.float32):  # a 16-bit GPU load: nothing to say
        return None, None
    why = "a device map places the weights" if placed else refusal(config, device, dtype, cpu_weights, keep_float32)
    if why is not None:
        return None, why
    return load_half_folder(path, config, attn) if path.is_dir() else load_on_blocks(path, config, attn)


def half_precision_files(folder: Path) -> list[Path]:
    """The folder's safetensors files where its projections are bf16 or f16 (read from the files'
    headers, no weight read); [] for float32 weights or no safetensors."""
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        try:
            table = safetensors_file.entries(file)
        except (OSError, ValueError, KeyError, TypeError):
            return []
        up = next((entry for name, entry in table.items() if name.endswith("mlp.up_proj.weight")), None)
        if up is not None:
            return files if up.dtype in HALF_DTYPES else []
    return []


def load_half_folder(folder: Path, config, attn: str) -> tuple[torch.nn.Module | None, str | None]:
    """(the model with its projections, head and embedding kept in the folder's own bf16/f16
    numbers, None), or (None, why not). Widening a 16-bit number to float32 is exact, so the
    kernel multiplies by exactly the float32 weights `from_pretrained(dtype=float32)` makes
    (each matrix's first rows are checked against torch's widening all the same)."""
    model, why = _meta_model(config, attn)
    if why is not None:
        return None, why
    wanted = dict(model.named_parameters())
    held: dict[str, gguf_blocks.BlockWeight] = {}
    try:
        for file in half_precision_files(folder):
            for name, tensor in safetensors_file.read_tensors(file, wanted):
                if not _stays_on_blocks(name):
                    _assign(model, name, tensor.to(torch.float32))
                    continue
                weight = _half_weight(name, tensor)
                if isinstance(weight, str):
                    return None, weight
                held[name] = weight
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{folder.name} could not be read: {exc}"
    if "lm_head.weight" not in held and getattr(config, "tie_word_embeddings", False):
        held["lm_head.weight"] = held.get("model.embed_tokens.weight")
    missing = [name for name, p in model.named_parameters() if name not in held and p.is_meta]
    if missing or None in held.values():
        return None, f"the folder holds no {(missing or ['lm_head.weight'])[0]}"
    why = _computed_buffers(model)
    if why is not None:
        return None, why
    layers = []
    for index in range(config.num_hidden_layers):
        def part(name: str) -> gguf_blocks.BlockWeight:
            return held.pop(f"model.layers.{index}.{name}.weight")

        layers.append((gguf_reading.join_parts([part("self_attn.q_proj"), part("self_attn.k_proj"), part("self_attn.v_proj")]),
                       part("self_attn.o_proj"), gguf_reading.join_parts([part("mlp.gate_proj"), part("mlp.up_proj")]),
                       part("mlp.down_proj")))
    return _adopted(model, folder, (layers, held["lm_head.weight"]), held["model.embed_tokens.weight"]), None


def _half_weight(name: str, tensor: torch.Tensor) -> gguf_blocks.BlockWeight | str:
    """A bf16/f16 [out, in] tensor as the block kernel reads it (its bytes, viewed), checked on its
    first rows against torch's widening; or why not."""
    kind = _KIND_OF.get(tensor.dtype)
    if kind is None or tensor.dim() != 2:
        return f"{name} is {tensor.dtype}, not bf16 or f16"
    if tensor.shape[1] % gguf_blocks.BLOCK:
        return f"{name}'s rows of {tensor.shape[1]} are not whole passes of {gguf_blocks.BLOCK}"
    weight = gguf_blocks.BlockWeight(kind, tensor.contiguous().view(torch.uint8), tensor.shape[1])  # [out, in * 2]
    spot = min(gguf_blocks.SPOT_ROWS, tensor.shape[0])
    if not gguf_blocks.matches(gguf_blocks.BlockWeight(kind, weight.data[:spot], tensor.shape[1]), tensor[:spot].float()):
        return f"{name}: the kernel's widening is not torch's"
    return weight


def load_on_blocks(path: Path, config, attn: str) -> tuple[torch.nn.Module | None, str | None]:
    """(the model with its projections and head on the meta device and its blocks adopted, None),
    or (None, why not): then the caller loads the float32 weights as before."""
    model, why = _meta_model(config, attn)
    if why is not None:
        return None, why
    try:
        tensors, architecture = read_file(path)
    except (OSError, ValueError) as exc:
        return None, f"{path.name} could not be read: {exc}"
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = _tensor_names(model, architecture)
    if isinstance(names, str):
        return None, names

    def as_loaded(name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop of the float32 tensor transformers' loader makes of the file's tensor
        `name`: gguf-py's dequantization, then the loader's processor (which may reorder q's and
        k's rows, so those are processed whole, then cut)."""
        entry = tensors[name]
        whole = ".attn_q." in name or ".attn_k." in name
        data = entry.data if whole else entry.data[start:stop]
        values = dequantize(data, GGMLQuantizationType[entry.kind]).reshape(-1, *entry.shape[1:])
        values = processor.process(weights=values, name=name).weights
        entry.release()  # read: its pages need not stay resident in this mapping
        return torch.from_numpy(np.array(values[start:stop] if whole else values, dtype=np.float32))

    def reference(name: str):
        return lambda start, stop: as_loaded(name, start, stop)

    why = _make_real(model, tensors, names, as_loaded)
    if why is not None:
        return None, why
    record = block_checks.record_path(path, config)
    known, layouts = block_checks.read(record), {}
    found = gguf_reading.read_blocks(path, model, reference=reference, known=known, layouts=layouts)
    if isinstance(found, str):
        return None, found
    tied_head = "output.weight" not in tensors  # the head reads the embedding's blocks
    embedding = found[1] if tied_head else gguf_reading.read_embedding(path, reference, known=known, layouts=layouts)
    if isinstance(embedding, str):
        return None, embedding
    if layouts != known:
        block_checks.write(record, layouts)
    return _adopted(model, path, found, embedding), None


def _meta_model(config, attn: str) -> tuple[torch.nn.Module, str | None]:
    """The model built on the meta device (no weight allocated), and why mdcli's own forward cannot
    run it, if it cannot."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    why = unsupported_reason(model)
    return model, None if why is None else f"mdcli's own forward does not run it ({why})"


def _adopted(model, source: Path, found, embedding) -> torch.nn.Module:
    """`model` holding `found` (its layers' and head's blocks) and `embedding` from `source`, ready:
    evaluation mode, no gradients, the heap the load freed given back."""
    gguf_blocks.adopt(model, source, found, embedding)
    _give_back_the_heap()
    model.eval()
    model.requires_grad_(False)
    return model


def _give_back_the_heap() -> None:
    """Return the heap the checks' float32 references were freed into to the system (glibc's
    malloc_trim; nothing elsewhere): 65 MiB of a 1B model's peak (measured: notebook/memory.md)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tensor_names(model, architecture: str) -> dict[str, str] | str:
    """gguf tensor name -> transformers' parameter name, by gguf-py's name table for the file's
    architecture (the table transformers' loader reads, built once here, not once per module)."""
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        return f"gguf-py has no tensor names for architecture {architecture!r}"
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for hf_name, _ in model.named_parameters():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _make_real(model, tensors: dict, names: dict[str, str], as_loaded) -> str | None:
    """Give every parameter but the projections, the head and the embedding its float32 values
    from the file, and rebuild the rotary tables on the CPU; or why not."""
    wanted = {name for name, _ in model.named_parameters() if not _stays_on_blocks(name)}
    for gguf_name, hf_name in names.items():
        if hf_name in wanted and gguf_name in tensors:
            if tensors[gguf_name].data is None:
                return f"{gguf_name} is {tensors[gguf_name].kind}, a type mdcli does not read"
            _assign(model, hf_name, as_loaded(gguf_name))
            wanted.discard(hf_name)
    if wanted:
        return f"the .gguf holds no {sorted(wanted)[0]}"
    return _computed_buffers(model)


def _computed_buffers(model) -> str | None:
    """Rebuild the rotary tables on the CPU (computed, not read from any file); or why a buffer is
    still without values."""
    with torch.device("cpu"):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    meta_buffers = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    return f"buffer {meta_buffers[0]} has no values outside the weights" if meta_buffers else None


def _stays_on_blocks(name: str) -> bool:
    """Parameters the blocks replace: the projections', the head's and the embedding's weights."""
    parts = name.split(".")
    return (parts[-1] == "weight" and len(parts) > 1 and parts[-2] in PROJECTIONS) or name in {
        "lm_head.weight", "model.embed_tokens.weight"}


def _assign(model, name: str, value: torch.Tensor) -> None:
    owner, _, attribute = name.rpartition(".")
    module = model.get_submodule(owner)
    setattr(module, attribute, torch.nn.Parameter(value.to(torch.float32), requires_grad=False))
