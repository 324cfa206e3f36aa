"""A decode step's layers in one native call.

Rule: where a step's products run on the .gguf's blocks (mdcli.backends.weights.gguf_blocks, the
block kernel's rows) and its attention, dense, on mdcli's kernel (mdcli.backends.attention.fused),
the forward runs every layer in `step` (mdcli/backends/native/step.c): the norms, the rotary
embedding, the cache writes, SiLU and the residual adds in C, around the same product and attention
kernels, which it is handed as function pointers. The Python forward runs some twenty small
operations a layer between its kernels, each a few microseconds whatever its rows: about 5 of the
embedded model's 20 ms one-branch step on a Zen 4 core (notebook/gguf-blocks.md, "A step's layers
in one call").

The same products and attention on the same numbers; the norms' sums of squares in another order
and SiLU's exp by a polynomial, so a step agrees with the Python forward to float32 rounding
(tests/test_native_step.py). Layers it does not serve (Qwen3's per-head norms, an activation other
than SiLU, a sliding window, a weight not in blocks) keep the Python forward: `unserved`.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from pathlib import Path

import torch
from transformers.activations import SiLUActivation

from mdcli.backends.attention import fused
from mdcli.backends.layers import Layer
from mdcli.backends.native import build as native
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights.gguf_blocks import BlockWeight, JoinedBlocks

SOURCE = Path(__file__).parent / "native" / "step.c"
MAX_PARTS = 4  # step.c's MAX_PARTS: the parts of one fused projection
# The kernels' vector width; each multiply and add rounded as torch's separate operations round (step.c's header).
FLAGS = (*native.X86_FLAGS.get(native.build_kind(native.x86_capability()), native.PLAIN_FLAGS),
         "-fno-math-errno", "-ffp-contract=off")

_pointer, _size = ctypes.c_void_p, ctypes.c_int64


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _size), ("fn", _pointer * MAX_PARTS), ("blocks", _pointer * MAX_PARTS),
                ("rows", _size * MAX_PARTS), ("bias", _pointer)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm_in", _pointer), ("norm_post", _pointer), ("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float),
                ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _size), ("heads", _size), ("kv_heads", _size), ("dim", _size), ("inter", _size),
                ("scale", ctypes.c_float), ("attention", _pointer)]


def unserved(layers: list[Layer]) -> str | None:
    """Why `layers` cannot run in one call (None: they can)."""
    if library() is None or gguf_blocks.library() is None or fused.library() is None:
        return "the native step does not build here"
    for index, layer in enumerate(layers):
        if layer.head_norms is not None:
            return f"layer {index} normalizes each head (Qwen3's q_norm and k_norm)"
        if type(layer.act) not in (torch.nn.SiLU, SiLUActivation):
            return f"layer {index}'s activation is {type(layer.act).__name__}, not SiLU"
        if layer.layer_type != "full_attention":
            return f"layer {index} is a {layer.layer_type} layer"
        for name in ("qkv", "o", "gate_up", "down"):
            parts = _parts(getattr(layer, name))
            if parts is None or len(parts) > MAX_PARTS:
                return f"layer {index}'s {name} is not in the .gguf's blocks"
        tensors = [layer.norm_in, layer.norm_post, layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias]
        if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in tensors):
            return f"layer {index}'s norms or biases are not contiguous float32"
    return None


class NativeStep:
    """Callable as (hidden, cos, sin, mask, cache) -> None: M tokens through every layer, `hidden`
    ([M, hidden] float32, contiguous) updated in place, their keys and values written into the
    cache's next M slots."""

    def __init__(self, layers: list[Layer], *, heads: int, kv_heads: int, dim: int, scale: float) -> None:
        self.hidden, self.inter = layers[0].norm_in.shape[0], layers[0].down.shape[1]
        self.layers = layers  # the tensors the structures point into, kept alive
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.lib = library()
        self.shape = _Shape(self.hidden, heads, kv_heads, dim, self.inter, scale,
                            ctypes.cast(fused.library().attention, _pointer))
        self.structures = (_Layer * len(layers))(*(_layer(layer) for layer in layers))
        self.work = torch.empty(0, dtype=torch.float32)  # grown to the widest step yet
        self.scratch = torch.empty(gguf_blocks.library().scratch_floats(max(self.hidden, heads * dim, self.inter)),
                                   dtype=torch.float32)
        self.lock = threading.Lock()  # one work buffer: one step at a time

    def serves(self, cache) -> bool:
        """Whether `cache` is one whose layers keep float32 buffers [1, G, capacity, D] this writes into."""
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.layers) or cache.get_seq_length() == 0:
            return False
        if not all(hasattr(layer, "reserve") for layer in layers):
            return False
        keys, values = layers[0].buffers
        return keys.dtype == torch.float32 and keys.shape[0] == 1 and keys.stride(-1) == 1 \
            and keys.stride(-2) == self.dim and values.stride() == keys.stride()

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: fused.StepMask | None,
                 cache) -> None:
        """hidden: [M, hidden]; cos, sin: [M, D] contiguous; mask: the step's (fused.step_mask) over
        the cache's slots and these M, or None for a lone token seeing every slot."""
        m = hidden.shape[0]
        slot, layers = cache.get_seq_length(), cache.layers
        for layer in layers:
            layer.reserve(slot + m)
        buffers = [layer.buffers for layer in layers]  # [1, G, capacity, D] each
        count = len(buffers)
        keys = (_pointer * count)(*(k.data_ptr() for k, _ in buffers))
        values = (_pointer * count)(*(v.data_ptr() for _, v in buffers))
        strides = (_size * count)(*(k.stride(1) for k, _ in buffers))
        attention_scratch = fused.scores_scratch(slot + m, self.heads // self.kv_heads, m, self.dim)
        native.use_threads(torch.get_num_threads())
        with self.lock:
            work = self._work(m)
            self.lib.step(ctypes.byref(self.shape), self.structures, count, m, hidden.data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), keys, values, strides, slot, None if mask is None else mask.transposed.data_ptr(),
                          work.data_ptr(), self.scratch.data_ptr(), attention_scratch.data_ptr())
        for layer in layers:
            layer.set_length(slot + m)

    def _work(self, m: int) -> torch.Tensor:
        floats = self.lib.step_work_floats(m, self.hidden, self.heads, self.kv_heads, self.dim, self.inter)
        if self.work.numel() < floats:
            self.work = torch.empty(floats, dtype=torch.float32)
        return self.work


def _parts(weight) -> tuple[BlockWeight, ...] | None:
    if isinstance(weight, BlockWeight):
        return (weight,)
    if isinstance(weight, JoinedBlocks):
        return weight.parts
    return None


def _projection(weight, bias: torch.Tensor | None) -> _Projection:
    parts = _parts(weight)
    products = gguf_blocks.library().products
    projection = _Projection(len(parts))
    for index, part in enumerate(parts):
        projection.fn[index] = ctypes.cast(products[part.kind], _pointer)
        projection.blocks[index] = part.data.data_ptr()
        projection.rows[index] = part.data.shape[0]
    projection.bias = None if bias is None else bias.data_ptr()
    return projection


def _layer(layer: Layer) -> _Layer:
    return _Layer(layer.norm_in.data_ptr(), layer.norm_post.data_ptr(), layer.norm_in_eps, layer.norm_post_eps,
                  _projection(layer.qkv, layer.qkv_bias), _projection(layer.o, layer.o_bias),
                  _projection(layer.gate_up, layer.gate_up_bias), _projection(layer.down, layer.down_bias))


def builds() -> bool:
    """Whether the one-call step builds here."""
    return library() is not None


@cache
def library() -> ctypes.CDLL | None:
    """step.c built for this machine (the kernels' vector width, built on first use); None where it cannot be."""
    lib = native.load(SOURCE, FLAGS)
    if lib is None:
        return None
    lib.step_work_floats.argtypes, lib.step_work_floats.restype = [_size] * 6, _size
    lib.step.argtypes = [_pointer, _pointer, _size, _size, _pointer, _pointer, _pointer, _pointer, _pointer, _pointer,
                         _size, _pointer, _pointer, _pointer, _pointer]
    lib.step.restype = None
    return lib
