"""Products on oneDNN, and attention as two of them per key/value head.

Rules (the selector decides where they apply, docs/cpu-backends.md):

* a float32 CPU product `x @ w.T` runs on oneDNN's kernel (`onednn_matmul_t`) where linears are
  routed there: x86-64 with AVX-512;
* masked attention of a few queries (2 to MAX_GEMM_ATTENTION_QUERIES) runs as two products per
  key/value head, the query heads of a group stacked into one matrix (`gemm_attention`);
* in mdcli's own forward, masked attention of any number of queries runs a span of QUERY_PIECE
  queries at a time, over the keys the span's rows can see (`key_spans`, `pieced_attention`);
* every other call keeps torch's own kernels (`sdpa_attention`: sdpa with grouped-query heads read
  natively, never copied per query head).

(measured: notebook/cpu-kernels.md, "Kernels: which matrix multiply mdcli's forwards use")
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

# Above this many queries `gemm_attention`, which holds a group's every score, leaves a masked forward to sdpa's
# tiled kernel (less memory); `pieced_attention` holds one span's and takes any number.
MAX_GEMM_ATTENTION_QUERIES = 256
# Query rows `pieced_attention` takes at a time (notebook/attention.md, "Causal pieces read the keys they see").
QUERY_PIECE = 128


@cache
def onednn_linear_works() -> bool:
    """Checked once: the op exists in this torch build and computes what `F.linear` computes."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=generator) for shape in ((2, 3, 64), (48, 64), (48,)))
    try:
        got = op(x, w, b, "none", [], "")
        transposed = op(x, w.t().contiguous().t(), None, "none", [], "")  # a weight given as a strided view
    except (RuntimeError, NotImplementedError):
        return False
    return all(
        bool(torch.allclose(a, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)) for a, bias in ((got, b), (transposed, None))
    )


def onednn_matmul_t(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) on oneDNN. x: [..., K], w: [N, K] (any strides) -> [..., N]."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` on oneDNN for plain float32 CPU tensors without autograd, else torch's own."""
    if (
        plain_float32_cpu(x)
        and plain_float32_cpu(weight)
        and (bias is None or plain_float32_cpu(bias))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return onednn_matmul_t(x, weight, bias)
    return F.linear(x, weight, bias)


def plain_float32_cpu(tensor) -> bool:
    """A dense float32 CPU tensor, not a quantized or distributed subclass."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
    )


def gemm_attention_applies(query, key, value, mask, max_queries: int | None = MAX_GEMM_ATTENTION_QUERIES) -> bool:
    """Masked multi-query float32 CPU attention of one sequence, grouped heads paired as transformers
    pairs them, without autograd, of up to `max_queries` queries (None: any number): what
    `gemm_attention` computes."""
    if mask is None or not all(plain_float32_cpu(t) for t in (query, key, value, mask)) or torch.is_grad_enabled():
        return False
    batch, heads, queries, _ = query.shape
    return (
        batch == 1
        and key.shape[0] == value.shape[0] == 1
        and 2 <= queries <= (max_queries or queries)
        and heads % key.shape[1] == 0
        and key.shape[1] == value.shape[1]
        and mask.shape == (1, 1, queries, key.shape[2])
    )


def gemm_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, one key/value head at a time.

    query: [1, H, M, D]; key: [1, G, N, D]; value: [1, G, N, Dv]; mask: [1, 1, M, N] additive.
    Query head h reads key/value head h // (H / G), as transformers' `repeat_kv` pairs them, so the
    H / G query heads of a group are stacked into one [H/G * M, D] matrix against that group's keys.
    Returns [1, H, M, Dv], sdpa's layout.
    """
    _, heads, queries, dim = query.shape
    groups, dim_v = key.shape[1], value.shape[-1]
    per_group = heads // groups
    scale = dim**-0.5 if scaling is None else scaling
    stacked = query[0].reshape(groups, per_group * queries, dim)  # [G, H/G * M, D]
    rows = mask[0, 0].repeat(per_group, 1) if per_group > 1 else mask[0, 0]  # [H/G * M, N]
    out = query.new_empty(groups, per_group * queries, dim_v)  # [G, H/G * M, Dv]
    for g in range(groups):
        scores = onednn_matmul_t(stacked[g], key[0, g])  # [H/G * M, N]
        scores.mul_(scale).add_(rows)
        probabilities = torch.softmax(scores, dim=-1)
        out[g] = onednn_matmul_t(probabilities, value[0, g].t())  # [H/G * M, Dv]
    return out.reshape(1, heads, queries, dim_v)  # [1, H, M, Dv]


def sdpa_attention(query, keys, values, mask, scaling: float, onednn: bool,
                   spans: tuple[KeySpan, ...] | None = None) -> torch.Tensor:
    """Attention for mdcli's own forward where it does not stack heads itself: `gemm_attention`
    where `onednn` and it applies, span by span (`pieced_attention`, any number of queries: a span's
    scores are all it holds) where the mask's `spans` are given, else torch's sdpa with grouped-query
    heads read natively.

    query: [B, H, M, D]; keys, values: [B, G, N, D]; mask: [B, 1, M, N] additive or None (a lone
    query seeing everything). Returns [B, M, H, D], transformers' attention layout."""
    if onednn and gemm_attention_applies(query, keys, values, mask, None if spans else MAX_GEMM_ATTENTION_QUERIES):
        out = (pieced_attention(query, keys, values, mask, scaling, spans) if spans
               else gemm_attention(query, keys, values, mask, scaling))
    else:
        grouped = {"enable_gqa": True} if keys.shape[1] != query.shape[1] else {}
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=0.0, scale=scaling,
                                             is_causal=False, **grouped)
    return out.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class KeySpan:
    """Query rows [start, stop) of a mask and the key columns they read: the mask is 0 on all of
    them before `zero` and hides every column from `reach` on."""

    start: int
    stop: int
    zero: int
    reach: int


def key_spans(mask: torch.Tensor, piece: int | None = None) -> tuple[KeySpan, ...]:
    """The spans of mask [1, 1, M, N] (additive; a column hidden where the mask holds its dtype's
    lowest value or -inf), `piece` (default QUERY_PIECE) query rows each: found once per forward, read by every layer."""
    rows = mask[0, 0]  # [M, N]
    m, n = rows.shape
    piece = piece or QUERY_PIECE
    lowest = torch.finfo(rows.dtype).min
    spans = []
    for start in range(0, m, piece):
        stop = min(start + piece, m)
        seen = (rows[start:stop].amax(0) > lowest).nonzero()  # [S, 1] columns any row sees
        if not len(seen):  # nothing visible: the whole row, as unpieced attention reads it
            spans.append(KeySpan(start, stop, 0, n))
            continue
        reach = int(seen[-1]) + 1
        added = (rows[start:stop, :reach] != 0).any(0).nonzero()  # [A, 1] columns the mask changes
        spans.append(KeySpan(start, stop, int(added[0]) if len(added) else reach, reach))
    return tuple(spans)


def pieced_attention(query, key, value, mask, scaling: float | None, spans: tuple[KeySpan, ...]) -> torch.Tensor:
    """`gemm_attention` a span of query rows at a time, over the keys the span's rows can see:
    the columns a mask hides from every row of a span weigh exactly 0 after the softmax, so leaving
    them out changes only the order of the sums. A causal prefill's first piece of 284 queries
    scores 71% of its keys' columns, in spans of 128 (notebook/attention.md, "Causal pieces read the
    keys they see"). The scale multiplies the queries, not the scores (exactly the same numbers where it is a
    power of two: a head size of 64 or 256).

    query: [1, H, M, D]; key: [1, G, N, D]; value: [1, G, N, Dv]; mask: [1, 1, M, N] additive.
    Returns [1, H, M, Dv], sdpa's layout."""
    _, heads, queries, dim = query.shape
    groups, dim_v = key.shape[1], value.shape[-1]
    per_group = heads // groups
    scale = dim**-0.5 if scaling is None else scaling
    by_group = query[0].view(groups, per_group, queries, dim)  # [G, H/G, M, D]
    rows = mask[0, 0]  # [M, N]
    out = query.new_empty(groups, per_group, queries, dim_v)  # [G, H/G, M, Dv]
    for g in range(groups):
        for span in spans:
            m = span.stop - span.start
            stacked = torch.mul(by_group[g, :, span.start:span.stop], scale).reshape(per_group * m, dim)  # [H/G * m, D]
            scores = onednn_matmul_t(stacked, key[0, g, : span.reach])  # [H/G * m, reach]
            if span.zero < span.reach:
                scores.view(per_group, m, span.reach)[:, :, span.zero:].add_(rows[span.start:span.stop,
                                                                                  span.zero:span.reach])
            probabilities = torch.softmax(scores, dim=-1)
            out[g, :, span.start:span.stop] = onednn_matmul_t(probabilities, value[0, g, : span.reach].t()).view(
                per_group, m, dim_v)
    return out.view(1, heads, queries, dim_v)  # [1, H, M, Dv]


def read_ahead(*views: torch.Tensor) -> None:
    """Read every view once, in order, so that the products that follow find it in the CPU's caches.

    Between two uses of a layer's cached keys and values a step streams the whole model's weights,
    so they arrive from memory, where a few queries' batched products read at a fraction of the
    rate a plain sum does (measured: notebook/attention.md, "Reading the cache ahead")."""
    for view in views:
        view.sum()  # the result is not wanted: the reading is the point
