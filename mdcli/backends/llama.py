"""mdcli's own decode forward for the Llama family (Llama, Mistral, Qwen2, Qwen3): the same
arithmetic as transformers' forward, in fewer and larger operations.

transformers' forward (mdcli.backends.reference) stays the reference: it runs everything this
forward does not take (another architecture, eager attention, an unmasked prefill of many tokens),
and the tests compare this one with it. The plan (mdcli.backends.select) decides at load which of
these rules hold on the host:

* q, k and v are one matrix product, gate and up another: the layer's weights are copied once into
  a fused matrix and the model's own `q_proj.weight` ... `up_proj.weight` re-pointed at row slices
  of it (views: the same memory, so the model's forward reads the same numbers);
* the rotary embedding is applied to queries and keys in one pass, with the cos/sin table computed
  once per step by the model's own rotary module (so every rope type transformers knows stays exact);
* the engine makes the mask once per step; where linears run on oneDNN or on an AVX2-only x86-64
  CPU, attention is two batched products per layer ("bmm"), the query heads of a key/value group
  stacked and the mask's rows repeated for them once per step, up to the plan's `bmm_max_queries`;
  elsewhere, and past that, transformers' sdpa entry;
* a forward of M tokens multiplies by: the int8 copies where the model has them
  (mdcli.backends.weights.int8, fused the same way, no float32 copy made); the .gguf's own blocks
  for M <= block_rows where the model's float32 weights are exactly them
  (mdcli.backends.weights.gguf_blocks: the same weights bit for bit, a sixth (Q4_1) to a half (F16)
  of the bytes to read); a transposed copy for a lone token, on OpenBLAS where torch runs one thread
  (mdcli.backends.weights.blas); mdcli's tiled copy for M <= TILED_MAX_ROWS on an AVX2-only x86-64
  CPU with torch on one thread (mdcli.backends.weights.tiled); else a copy packed in oneDNN's layout
  where linears run on oneDNN or on AVX2-only x86-64 (mdcli.backends.weights.packed), or the plain
  weights;
* keys and values are written through the cache's public `update` (mdcli.core.cache's growing buffer);
* on AMD x86-64 cores with AVX-512 or AVX2, a forward of several tokens on the bmm core reads the cached keys and values
  once, as a plain sum, before multiplying by them: they arrive cold after the step's weights, and
  small products read cold memory at a fraction of a sum's rate (mdcli.backends.attention.gemm.read_ahead);
* where the queries see a small part of the cache (a wide forest of unrelated branches), attention
  runs over each chain's gathered visible slots only (mdcli.backends.attention.sparse); where they see
  different prefixes of one long run of slots (margins' chain layout), over each prefix read in
  place plus the few other slots gathered (mdcli.backends.attention.prefix); several documents' trees
  (--each) on mdcli's kernel, over each document's own slots (mdcli.backends.attention.documents);
* the last layer's output projection and MLP, the final norm and `lm_head` run only on the rows
  whose logits are wanted, and a forward that wants none (a document's prefill) stops at the last
  layer's keys and values: nothing reads the other rows (llama.cpp's graph drops them too);
* no module calls, hooks, output records or keyword plumbing between the operations.

The arithmetic is the same operations on the same numbers; products over a fused or packed weight
and the batched attention may sum in another order inside the BLAS, so logits agree with
transformers' forward to float32 rounding (tested to 1e-4 with identical greedy tokens).
`MDCLI_FORWARD=transformers` turns it off. (measured: notebook/cpu-kernels.md, "A faster decode
step"; each rule's own measurement is linked from mdcli.backends.select)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation

from mdcli.backends.attention import fused
from mdcli.backends.attention.gemm import key_spans, onednn_matmul_t, read_ahead, routed_linear, sdpa_attention
from mdcli.backends.attention.documents import DocumentsPlan, documents_plan
from mdcli.backends.attention.prefix import JOINED_MIN_QUERIES, PrefixPlan
from mdcli.backends.attention.sparse import plan_for
from mdcli.backends import native_step
from mdcli.backends.layers import Layer, fuse_layer, weight_of, with_weights
from mdcli.backends.select import Plan
from mdcli.backends.weights import gguf_blocks, gguf_reading
from mdcli.backends.weights import packed as packing
from mdcli.backends.weights.blas import one_blas_thread, openblas_bmm, openblas_linear
from mdcli.backends.weights.gguf_blocks import block_linear
from mdcli.backends.weights.int8 import has_int8_weights, int8_linear
from mdcli.backends.weights.tiled import TILED_MAX_ROWS, tiled_linear


@dataclass(frozen=True)
class WeightFormat:
    """One layout of the model's weights and the product that reads it: forwards of up to
    `max_rows` tokens (None: any) multiply by `layers`' weights and `head` through
    `linear(x, weight, bias)`, whatever the layout."""

    name: str
    max_rows: int | None
    linear: Callable
    layers: list
    head: object

    def serves(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


class FastForward:
    """Callable: (tokens, positions, mask, cache, keep) -> logits of the kept rows, or None.

    What it multiplies by and how it attends comes from the plan (mdcli.backends.select): the
    attention core ("bmm": two batched products per step and layer, the query heads of a key/value
    group stacked; "sdpa": torch's, as oneDNN products where linears run on oneDNN), the weight
    copies (packed, transposed, tiled, the .gguf's blocks) and the rules for OpenBLAS, padded pairs
    and reading ahead. Tests and benchmarks that compare variants hand it another plan
    (`dataclasses.replace(plan, packed=False)`).

    Which weights a forward of M tokens multiplies by: int8 copies where the model has them; the
    .gguf's blocks for M <= block_rows; the transposed copy for a lone token (on OpenBLAS where
    `lone_blas`); the tiled copy for M <= TILED_MAX_ROWS; else the packed copy, or the plain weights.
    Forwards of up to `blas_queries` tokens take OpenBLAS's weighted sum of the values."""

    def __init__(self, model, plan: Plan, *, windowed: bool = False) -> None:
        config = model.config
        self.model = model
        self.inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        first = self.inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.onednn = plan.linears.name == "oneDNN"  # linears and sdpa-core attention on oneDNN's products
        self.attention = plan.attention
        # bmm materializes every score: a long prefill over a tree attends with sdpa
        self.bmm_max_queries = plan.bmm_max_queries
        # dense forwards of 1 to FUSED_MAX_QUERIES queries on the bmm core run on mdcli's attention kernel
        self.fused_attention = plan.fused_attention
        self.by_document = self.fused_attention and not windowed  # a window starts each query elsewhere: no documents
        self.gather_cost = plan.gather_cost
        self.sparse_mode = plan.sparse_attention
        self.read_ahead = plan.read_ahead
        self.int8 = has_int8_weights(model)  # int8 projections (mdcli.backends.weights.int8): no float32 copies
        self.layers = [fuse_layer(layer, i, config) for i, layer in enumerate(self.inner.layers)]
        self.sparse_forwards = 0  # forwards whose attention ran on a plan: gathered slots or prefixes in place
        self.prefix_forwards = 0  # of those, on prefixes in place (mdcli.backends.attention.prefix)
        self.fused_forwards = 0  # forwards whose dense attention ran on mdcli's kernel (mdcli.backends.attention.fused)
        self.document_forwards = 0  # forwards split by document there (mdcli.backends.attention.documents)
        self.head = weight_of(model.lm_head)  # [V, hidden]
        self.tiled = plan.tiled
        if self.tiled:  # what forwards of up to TILED_MAX_ROWS tokens multiply by
            copies, self.small_head = packing.tiled_weights(model, self.layers)
            self.small = with_weights(self.layers, copies)
        self.on_blocks = plan.on_blocks  # the model holds no float32 projections: every forward reads the blocks
        self.embedding = gguf_blocks.embedding_blocks(model) if self.on_blocks else None  # None: float32 rows
        self.blocks_reason = plan.blocks_reason  # why forwards of a few tokens do not read the .gguf's blocks
        self.blocks = self._block_copies(model) if plan.blocks else None
        self.block_rows = plan.block_rows
        self.block_kernel_rows = plan.block_kernel_rows  # wider forwards on the blocks: its GEMM or tiles
        self.block_gemm = plan.block_gemm
        if self.blocks:  # what forwards of up to block_rows tokens multiply by
            copies, self.block_head = self.blocks
            self.block_layers = with_weights(self.layers, copies)
        # a lone token takes the blocks where they are made, so no transposed copy for it
        self.transposed = not self.blocks and plan.transposed
        self.lone, self.lone_head = self.layers, self.head  # what a lone token's step multiplies by
        self.lone_blas = self.transposed and plan.lone_blas
        self.blas_queries = plan.blas_queries if self.lone_blas or ((self.tiled or self.blocks) and plan.lone_blas) else 0
        if self.transposed:  # copied from the plain weights, before packing replaces them below
            copies, self.lone_head = packing.transposed_weights(model, self.layers)
            self.lone = with_weights(self.layers, copies)
        self.packed = plan.packed
        self.pair_padded = self.packed and plan.pair_padding
        if self.packed:
            packed, self.head = packing.packed_weights(model, self.layers)
            for layer, weights in zip(self.layers, packed):
                layer.qkv, layer.o, layer.gate_up, layer.down = weights
        self.formats = self._weight_formats()
        self.native_step, self.native_step_reason = self._native_step(plan)
        self.native_forwards = 0  # forwards whose layers ran in one native call (mdcli.backends.native_step)

    def _weight_formats(self) -> tuple[WeightFormat, ...]:
        """The formats this forward's weights come in, narrowest first: a forward of M tokens takes
        the first that serves M (int8 copies serve every width; else the .gguf's blocks up to
        block_rows, the transposed copy for a lone token, the tiled copy up to TILED_MAX_ROWS, and
        the packed copy or the plain weights for the rest)."""
        if self.int8:
            return (WeightFormat("int8", None, _int8_linear, self.layers, self.head),)
        formats = []
        if self.blocks:
            formats.append(WeightFormat("file blocks", None if self.on_blocks else self.block_rows,
                                        partial(_block_linear, rows_on_kernel=self.block_kernel_rows,
                                                tile_matmul=onednn_matmul_t if self.onednn else None,
                                                own_gemm=self.block_gemm),
                                        self.block_layers, self.block_head))
            if self.on_blocks:  # no float32 weights: the blocks serve every width
                return tuple(formats)
        if self.transposed:
            formats.append(WeightFormat("transposed", 1, _blas_linear if self.lone_blas else _transposed_linear,
                                        self.lone, self.lone_head))
        if self.tiled:
            formats.append(WeightFormat("tiled", TILED_MAX_ROWS, _tiled_linear, self.small, self.small_head))
        if self.packed:
            widest = _pair_padded_linear if self.pair_padded else _packed_linear
        else:
            widest = _routed_linear if self.onednn else _torch_linear
        formats.append(WeightFormat("packed" if self.packed else "plain", None, widest, self.layers, self.head))
        return tuple(formats)

    def _native_step(self, plan: Plan) -> tuple[native_step.NativeStep | None, str]:
        """The one-call step where the plan takes it and every layer is one it serves
        (mdcli.backends.native_step), else None and why not."""
        if not plan.native_step:
            return None, "the plan runs a step's layers in Python"
        if not self.blocks:
            return None, f"a step's products are not on the .gguf's blocks ({self.blocks_reason})"
        layers = self.formats[0].layers
        reason = native_step.unserved(layers)
        if reason is not None:
            return None, reason
        step = native_step.NativeStep(layers, heads=self.heads, kv_heads=self.kv_heads, dim=self.head_dim,
                                      scale=self.scaling)
        return step, ""

    def _block_copies(self, model):
        """The .gguf's blocks for every projection and the head (mdcli.backends.weights.gguf_blocks), where the
        model was loaded from a .gguf whose blocks its float32 weights are and the kernel runs here;
        else None, the reason kept."""
        if not gguf_blocks.source_known(model) or gguf_blocks.max_rows() == 0 or not gguf_blocks.blocks_work():
            return None
        found = gguf_reading.model_blocks(model)
        if isinstance(found, str):
            self.blocks_reason = found
            return None
        return found

    def __call__(self, tokens, positions, mask, cache, keep, *, core: str | None = None) -> torch.Tensor | None:
        """tokens, positions: [M] long; mask: [1, 1, M, N + M] additive, a dict of them by layer
        type, or None (only for M == 1: a single token that sees the whole cache); keep: [C] row
        indices whose logits are wanted, or None for no logits; core: dense attention on this core
        ("bmm" or "sdpa"), no sparse plan, whose choice reads the mask on the host (a captured
        forward: mdcli.backends.graphs); None: the plan's. Returns [C, V] in the model dtype."""
        m = tokens.shape[0]
        weights = next(f for f in self.formats if f.serves(m))
        linear, layers, head = weights.linear, weights.layers, weights.head
        if m <= self.blas_queries:
            with one_blas_thread():  # OpenBLAS's own threads would fight torch's for the cores
                return self._forward(tokens, positions, mask, cache, keep, linear, layers, head,
                                     weighted_sum=openblas_bmm, core=core)
        return self._forward(tokens, positions, mask, cache, keep, linear, layers, head, core=core)

    def _forward(self, tokens, positions, mask, cache, keep, linear, layers, head,
                 weighted_sum=None, core: str | None = None) -> torch.Tensor | None:
        """The forward itself, multiplying by `linear` over `layers`' weights and `head`;
        weighted_sum: the batched product of bmm attention's probabilities and values (None:
        torch.bmm)."""
        m = tokens.shape[0]
        hidden = self._embedded(tokens)[None]  # [1, M, hidden]
        cos, sin = self.inner.rotary_emb(hidden, positions[None])  # [1, M, D] each
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [1, M, 1, D]: broadcast over heads
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        # attention over each query's visible slots only (several documents' on the kernel first), or None: dense;
        # where the kernel serves dense attention, the one-product cascade starts later (fused.JOINED_MIN_QUERIES_WITH_KERNEL)
        joined = fused.JOINED_MIN_QUERIES_WITH_KERNEL if self.fused_attention else JOINED_MIN_QUERIES
        fits = fused.FUSED_MIN_QUERIES <= m <= fused.FUSED_MAX_QUERIES
        kernel = not core and self.by_document and fits and self.attention == "bmm" and m <= (self.bmm_max_queries or m)
        documents = documents_plan(mask, self.heads // self.kv_heads) if kernel and isinstance(mask, torch.Tensor) else None
        plan = None if core else documents or plan_for(mask, self.gather_cost, self.sparse_mode, joined)
        self.document_forwards += isinstance(plan, DocumentsPlan)
        self.sparse_forwards += plan is not None
        self.prefix_forwards += isinstance(plan, PrefixPlan)
        attention = core or (self.attention if self.bmm_max_queries is None or m <= self.bmm_max_queries else "sdpa")
        if plan is None and attention == "bmm" and self.fused_attention and fits:
            attention = "fused"
            self.fused_forwards += 1
        masks = None if plan is not None else self._step_masks(mask, attention)
        if attention == "fused" and self._native_serves(m, keep, layers, masks, cache):
            return self._native_forward(hidden[0], cos.reshape(m, -1), sin.reshape(m, -1), masks, cache, keep,
                                        linear, head)
        spans = self._key_spans(masks, attention)
        reach = self._read_reach(plan, mask, m, attention)  # leading cache slots read ahead in each layer
        last = len(layers) - 1
        for index, layer in enumerate(layers):
            layer_mask = masks.get(layer.layer_type) if isinstance(masks, dict) else masks
            layer_spans = spans.get(layer.layer_type) if isinstance(spans, dict) else spans
            x = _rms_norm(hidden, layer.norm_in, layer.norm_in_eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias).view(1, m, heads + 2 * kv_heads, dim)  # [1, M, H + 2G, D]
            qk = _normed_heads(qkv[:, :, : heads + kv_heads], heads, layer.head_norms)  # [1, M, H + G, D]
            qk = _rotate(qk, cos, sin)
            query = qk[:, :, :heads].transpose(1, 2)  # [1, H, M, D]
            key = qk[:, :, heads:].transpose(1, 2)  # [1, G, M, D]
            value = qkv[:, :, heads + kv_heads:].transpose(1, 2)  # [1, G, M, D]
            keys, values = cache.update(key, value, index)  # [1, G, N + M, D] each
            if index == last and keep is None:  # the cache has every key and value; no logits are read
                return None
            if reach:
                read_ahead(keys[0, :, :reach], values[0, :, :reach])
            if plan is not None:  # [1, M, H * D]
                attended = plan.attend(attention, self.onednn, layer.layer_type, query, keys, values, self.scaling)
            else:
                attended = self._attend(layer, query, keys, values, layer_mask, attention, weighted_sum,
                                        layer_spans)  # [1, M, H * D]
            if index == last and keep.shape[0] < m:  # past the last attention, only the kept rows are read
                attended, hidden, keep = attended[:, keep], hidden[:, keep], slice(None)  # [1, C, ...]
            hidden = hidden + linear(attended, layer.o, layer.o_bias)
            x = _rms_norm(hidden, layer.norm_post, layer.norm_post_eps)
            gate, up = linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)  # [1, M, I] each
            hidden = hidden + linear(_gated(layer.act, gate, up), layer.down, layer.down_bias)
        if keep is None:  # no layers
            return None
        rows = _rms_norm(hidden[0, keep], self.inner.norm.weight, self.inner.norm.variance_epsilon)  # [C, hidden]
        return linear(rows, head, self.model.lm_head.bias)  # [C, V]

    def _native_serves(self, m: int, keep, layers, masks, cache) -> bool:
        """Whether this forward, on the attention kernel, runs its layers in one native call: logits
        wanted, its products on the blocks' narrow kernel, one mask kind, a cache it can write."""
        step = self.native_step
        return step is not None and keep is not None and layers is step.layers and m <= self.block_kernel_rows \
            and not isinstance(masks, dict) and step.serves(cache)

    def _native_forward(self, hidden, cos, sin, mask, cache, keep, linear, head) -> torch.Tensor:
        """The step's layers in one native call (mdcli.backends.native_step): the same products and
        attention as `_forward`'s. hidden: [M, hidden], fresh, updated in place; cos, sin: [M, D];
        mask: the kernel's (fused.step_mask) or None. Returns [C, V]."""
        self.native_step(hidden, cos, sin, mask, cache)
        self.native_forwards += 1  # fused_forwards counted it when its attention was chosen
        rows = _rms_norm(hidden[keep], self.inner.norm.weight, self.inner.norm.variance_epsilon)  # [C, hidden]
        return linear(rows, head, self.model.lm_head.bias)  # [C, V]

    def _embedded(self, tokens) -> torch.Tensor:
        """[M, hidden] float32 embeddings of tokens [M]: rows of the float32 embedding, or of its
        blocks where the model holds none (the same numbers)."""
        if self.embedding is not None:
            return gguf_blocks.embedded_rows(self.embedding, tokens)
        return self.inner.embed_tokens.weight[tokens]

    def _read_reach(self, plan, mask, m: int, attention: str) -> int:
        """How many leading cache slots each layer streams through the CPU's caches before attending
        (mdcli.backends.attention.gemm.read_ahead; 0: none): where the plan reads ahead, for a forward
        of several tokens on the bmm core, the whole cache for dense attention, the longest prefix a
        bucket reads in place for the prefix plan; none for gathered slots (the gather reads them)."""
        if not self.read_ahead or m == 1 or attention != "bmm":  # the fused kernel streams the cache itself
            return 0
        if plan is None:
            return next(iter(mask.values())).shape[-1] if isinstance(mask, dict) else mask.shape[-1]
        if isinstance(plan, PrefixPlan):
            return max(bucket.prefix for bucket in plan.buckets)
        return 0

    def _step_masks(self, mask, attention: str):
        """Per step, not per layer: for "bmm" each mask's rows repeated for the query heads that
        share a key/value head ([H/G * M, N + M], row r * M + m = query m's row); for "fused" the
        same rows transposed and padded as its kernel reads them (fused.step_mask)."""
        per_group = self.heads // self.kv_heads
        if attention == "fused":
            if isinstance(mask, dict):
                return {kind: fused.step_mask(m, per_group) for kind, m in mask.items()}
            return fused.step_mask(mask, per_group)
        if attention != "bmm" or mask is None:
            return mask
        if isinstance(mask, dict):
            return {kind: m[0, 0].repeat(per_group, 1) for kind, m in mask.items()}
        return mask[0, 0].repeat(per_group, 1)

    def _key_spans(self, masks, attention: str):
        """Per step: the key columns each span of queries sees (gemm.key_spans) where the sdpa core
        runs on oneDNN's products, for each mask; None elsewhere."""
        if attention != "sdpa" or not self.onednn or masks is None:
            return None
        if isinstance(masks, dict):
            return {kind: key_spans(m) for kind, m in masks.items()}
        return key_spans(masks)

    def _attend(self, layer: Layer, query, keys, values, mask, attention: str, weighted_sum=None, spans=None):
        """[1, M, H * D] attention output for query [1, H, M, D] over keys/values [1, G, N, D];
        spans: the mask's (gemm.key_spans) for the sdpa core, or None."""
        m = query.shape[2]
        if attention == "fused":
            return fused.fused_attention(query, keys, values, mask, self.scaling, self.kv_heads)
        if attention == "bmm":
            return _grouped_attention(query, keys, values, mask, self.scaling, self.kv_heads, weighted_sum)
        return sdpa_attention(query, keys, values, mask, self.scaling, self.onednn,
                              spans).reshape(1, m, -1)  # [1, M, H * D]


def _grouped_attention(query, keys, values, rows, scale: float, groups: int, weighted_sum=None):
    """softmax(q k^T * scale + mask) v with the H / G query heads of each key/value group stacked
    into one matrix, as transformers pairs them (query head h reads group h // (H / G)).

    query: [1, H, M, D]; keys, values: [1, G, N, D]; rows: [H/G * M, N] additive or None (a lone
    query seeing everything); weighted_sum: the batched product for probabilities x values (None:
    torch.bmm; OpenBLAS's reads the values faster for a few queries: mdcli.backends.weights.blas).
    Returns [1, M, H * D]."""
    _, heads, m, dim = query.shape
    per_group = heads // groups
    stacked = query[0].reshape(groups, per_group * m, dim)  # [G, H/G * M, D]
    keys_t = keys[0].transpose(1, 2)  # [G, D, N]
    if rows is None:
        scores = torch.bmm(stacked, keys_t).mul_(scale)  # [G, H/G * M, N]
    else:
        scores = torch.baddbmm(rows, stacked, keys_t, alpha=scale)
    out = (weighted_sum or torch.bmm)(torch.softmax(scores, dim=-1), values[0])  # [G, H/G * M, D]
    return out.view(groups, per_group, m, dim).permute(2, 0, 1, 3).reshape(1, m, heads * dim)


_SILU = (torch.nn.SiLU, SiLUActivation)  # modules whose forward is F.silu


def _gated(act, gate, up) -> torch.Tensor:
    """act(gate) * up; for SiLU in gate's own memory (gate is a fresh product's view, read by no
    one else): the same numbers without two [M, I] temporaries (notebook/memory.md)."""
    if type(act) in _SILU:
        return F.silu(gate, inplace=True).mul_(up)
    return act(gate) * up


# Each format's product looks its kernel up when called, so a profiler can time the kernels by name.
def _int8_linear(x, weight, bias=None):
    return int8_linear(x, weight, bias)


def _block_linear(x, weight, bias=None, *, rows_on_kernel=None, tile_matmul=None, own_gemm=False):
    return block_linear(x, weight, bias, rows_on_kernel=rows_on_kernel, tile_matmul=tile_matmul, own_gemm=own_gemm)


def _routed_linear(x, weight, bias=None):
    return routed_linear(x, weight, bias)


def _torch_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def _tiled_linear(x, weight, bias=None):
    return tiled_linear(x, weight, bias)


def _packed_linear(x, weight, bias=None):
    return packing.packed_linear(x, weight, bias)


def _pair_padded_linear(x, weight, bias=None):
    return packing.pair_padded_linear(x, weight, bias)


def _transposed_linear(x, weight_t, bias=None):
    return packing.transposed_linear(x, weight_t, bias)


def _blas_linear(x, weight_t, bias=None):
    return openblas_linear(x, weight_t, bias)


def _rms_norm(x, weight, eps: float):
    """LlamaRMSNorm's operations, in its order (x: [..., hidden]); float32's by torch's rms_norm."""
    if x.dtype == weight.dtype == torch.float32:  # the same operations in one call: 0.7x the time
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _normed_heads(qk, heads: int, norms: tuple | None):
    """Qwen3's q_norm and k_norm: RMSNorm over each head's D, before the rotary (qk: [1, M, H + G, D],
    queries first); unchanged for models without them."""
    if norms is None:
        return qk
    q_weight, q_eps, k_weight, k_eps = norms
    queries, keys = _rms_norm(qk[:, :, :heads], q_weight, q_eps), _rms_norm(qk[:, :, heads:], k_weight, k_eps)
    return torch.cat((queries, keys), dim=2)


def _rotate(x, cos, sin):
    """Rotary embedding of x: [1, M, heads, D] (queries and keys together), as transformers'
    `apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
