"""The forward the engine is handed: one call shape over mdcli's own forward and transformers'.

Rule: a forward with a mask (a forest step, a tree prefill) and a lone token without a sliding
window run on mdcli's own forward where the plan has one (the Llama family), those of up to 64
tokens on static buffers replayed as CUDA graphs where the plan says so (mdcli.backends.graphs);
a causal continuation
(a document's prefill, which the model masks itself) and every forward of another model run on
transformers' forward, the reference. A model that holds no float32 projections (its .gguf's
blocks serve every forward: mdcli.models.on_blocks) runs every forward on mdcli's own, a causal
continuation with the causal mask `causal_mask` makes. The plan (mdcli.backends.select) decided
everything else at load.
"""

from __future__ import annotations

import torch

from mdcli.backends.attention.cuda import cuda_attention
from mdcli.backends.graphs import StaticStep
from mdcli.backends.llama import FastForward
from mdcli.backends.reference import ReferenceForward
from mdcli.backends.select import Plan, select


class ModelForward:
    """Callable: (tokens, positions, mask, cache, keep) -> [C, V] logits of the kept rows, or None.

    tokens, positions: [M] long; mask: [1, 1, M, N + M] additive in `dtype`, a dict of them by
    layer type, or None (a causal continuation seeing the whole cache); cache: the engine's KV
    cache; keep: [C] row indices whose logits are wanted, or None."""

    def __init__(self, model, plan: Plan, *, sliding_window: int | None = None, own: bool = True) -> None:
        self.model = model
        self.plan = plan
        self.device = torch.device(plan.device)
        self.dtype = compute_dtype(model)
        self.windowed = sliding_window is not None
        self.reference = ReferenceForward(model, onednn=plan.linears.name == "oneDNN")
        self.own = FastForward(model, plan, windowed=self.windowed) if own and plan.own_forward else None
        self.static = StaticStep(capture=plan.cuda_graphs, core=plan.static_core) \
            if self.own is not None and plan.static_step else None

    def __call__(self, tokens, positions, mask, cache, keep) -> torch.Tensor | None:
        if mask is None and len(tokens) > 1 and self.plan.on_blocks:  # no float32 weights for transformers' forward
            return self._causal_pieces(tokens, positions, cache, keep)
        own = self.own is not None and (mask is not None or (len(tokens) == 1 and not self.windowed))
        with torch.inference_mode(), cuda_attention(self.device, self.plan.cudnn_attention):
            if own and self.static is not None and self.static.serves(tokens, mask, cache):
                return self.static(self.own, tokens, positions, mask, cache, keep)
            return (self.own if own else self.reference)(tokens, positions, mask, cache, keep)

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured over this forward's life (mdcli.backends.graphs); 0 without them."""
        return 0 if self.static is None else self.static.captures

    def _causal_pieces(self, tokens, positions, cache, keep) -> torch.Tensor | None:
        """A causal continuation on the own forward in pieces of piece_size tokens (at most
        CAUSAL_PIECE), each with its causal mask: the same products as one forward (each token sees
        the cache and the tokens before it either way), with at most half a 1,024-token forward's
        activations resident (measured: notebook/memory.md). keep: [C] row indices of the whole
        continuation."""
        vocab = self.model.lm_head.out_features  # a model on its blocks is a Llama-family one: it has a head
        rows = None if keep is None else torch.empty(len(keep), vocab, dtype=self.dtype)
        size = piece_size(len(tokens))
        for start in range(0, len(tokens), size):
            stop = min(start + size, len(tokens))
            wanted = None if keep is None else ((keep >= start) & (keep < stop)).nonzero()[:, 0]  # [c] into keep
            mask = causal_mask(stop - start, cache.get_seq_length(), self.dtype)
            with torch.inference_mode():
                logits = self.own(tokens[start:stop], positions[start:stop], mask, cache,
                                  keep[wanted] - start if wanted is not None and len(wanted) else None)
            if logits is not None:
                rows[wanted] = logits
        return rows

    def describe(self) -> str:
        return self.plan.describe()

    def weight_bytes(self) -> dict[str, int]:
        """Bytes each weight format holds: the model's own parameters (float32 where it has them;
        none for the projections a model on its .gguf's blocks leaves on the meta device), then
        each copy the own forward multiplies by (a format that reads the model's own weights adds
        nothing)."""
        own = {id(p): p for p in self.model.parameters() if not p.is_meta}
        held = {"the model's own parameters": sum(_bytes_of(p) for p in own.values())}
        own_storages = {p.untyped_storage().data_ptr() for p in own.values()}
        for weights in self.own.formats if self.own is not None else ():
            tensors = {id(t): t for layer in weights.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)}
            tensors[id(weights.head)] = weights.head
            extra = [t for t in tensors.values() if not _shares(t, own_storages)]
            if extra:
                held[weights.name] = sum(_bytes_of(t) for t in extra)
        return held


def forward_for(model, settings=None, *, sliding_window: int | None = None, own: bool = True) -> ModelForward:
    """The forward for a transformers model under `settings` (default: the environment's), its plan
    chosen here: for tests and benchmarks that hold a bare model. Loaded models carry theirs."""
    return ModelForward(model, select(model, settings), sliding_window=sliding_window, own=own)


# A causal continuation on a model without float32 weights runs on the own forward in pieces of at
# most this many tokens (mdcli.backends.forward.ModelForward._causal_pieces, piece_size): its
# attention reads each span of queries' keys only (mdcli.backends.attention.gemm.pieced_attention),
# so a piece's activations are its products' rows, half a 1,024-token forward's; equal pieces of
# up to 512 took 0.96-1.00x the time of pieces of 256 on the 1B and embedded files' prefills
# (notebook/memory.md, "Causal pieces of 512").
CAUSAL_PIECE = 512


def piece_size(tokens: int) -> int:
    """Tokens a piece of a causal continuation of `tokens` takes: the fewest pieces of at most
    CAUSAL_PIECE, of equal size, rather than full pieces and a short last one, whose products
    rebuild every weight for few rows."""
    pieces = -(-tokens // CAUSAL_PIECE)
    return -(-tokens // max(pieces, 1))


def _shares(weight, storages: set[int]) -> bool:
    """Whether `weight` is (a view of) one of the model's own parameters' storages."""
    return isinstance(weight, torch.Tensor) and not weight.is_meta and not weight.is_mkldnn \
        and weight.untyped_storage().data_ptr() in storages


def _bytes_of(weight) -> int:
    """Bytes a weight holds, whatever its format: a tensor's elements (a meta tensor none), or a
    format object's `nbytes` (blocks, int8), or the sum over its tensor fields (tiles)."""
    if isinstance(weight, torch.Tensor):
        return 0 if weight.is_meta else weight.numel() * weight.element_size()
    if isinstance(getattr(weight, "nbytes", None), int):
        return weight.nbytes
    return sum(_bytes_of(value) for value in vars(weight).values() if isinstance(value, torch.Tensor)) \
        if hasattr(weight, "__dict__") else 0


def causal_mask(m: int, cached: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, M, N + M] additive: new token i sees the N cached slots and new tokens 0..i."""
    allowed = torch.ones(m, cached + m, dtype=torch.bool).tril(diagonal=cached)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def compute_dtype(model) -> torch.dtype:
    """The dtype attention scores are computed in: the mask must match it."""
    for param in model.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return torch.float32
