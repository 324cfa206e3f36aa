"""Cascade attention: a prefix of the cache read in place by all its queries at once, then each
bucket's other slots, the two parts merged by their log-sum-exp.

Where branches share a document laid down first (ask-many: every question reads the whole
document, then its own question and answer) or hang off different depths of one long chain
(margins' chain layout: the margin of segment i reads segments 1..i; `run.prefill_steps` lays such
a document down as one contiguous run of slots), every query sees slots [0, p) for its own p, then
a few slots of its own. The queries are cut into *buckets* by p (a bucket joined to the one below
it where a few slots more are not worth a product of their own: `joined_buckets`). In each layer,
per key/value group, a bucket's queries of every query head of the group are stacked into one
[H/G * Q, D] matrix and scored against [0, p) in ONE product with a view of the cache, unmasked
(nothing copied); its "rest" (the union of its queries' other visible slots: one view where they
run on, else gathered) in one more, masked; each part's softmax keeps its rows' log-sum-exp, and
the parts are merged (`merge`, as FlashInfer's cascade attention and Hydragen do). Where the rest
runs on from the prefix (one bucket of every query over a shared document), prefix and rest are one
product and one softmax, the mask zero over the prefix (`joined`). On CPU in float32 each part
runs on torch's fused flash kernel, which returns the log-sum-exp with the output (`partial`).

Exact as the dense path: a key left out has weight exp(dtype-min - max) = 0 there, so only the
order of float sums changes (tests/test_cascade_attention.py compares both on random tensors,
tests/test_prefix_attention.py through the engine). The prefix is visible to every query of the bucket under every mask the
forward has (a sliding window included: p is taken on all of them at once, so a window that cuts
into the document shortens the prefix for every layer type), so its part needs no mask; the rest's
masks are gathered from the engine's, one per layer type, -inf held at the dtype's lowest (a row
that sees nothing gives no NaN).

The rule (`PrefixPlan.work` against `dense_work`, in query-slot products; JOINED_MIN_QUERIES) and
what it was fitted to:
notebook/attention.md, "Cascade attention over a shared document (Zen 3, 2026-11-27)" and
"Prefixes read in place, the document laid down first".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mdcli.backends.attention import gemm

MAX_BUCKETS = 32  # more distinct prefixes than this: per-bucket operations would cost more than they save
# The rule's costs, in query-slot products (one query scored against one slot and its value
# summed: what dense attention does M x N of), fitted to `python -m mdcli.bench.attention`: reading
# a slot for a product costs about READ_ROWS query rows whatever the number of queries (so a bucket
# of one query over a long prefix is dear: dense reads the cache once for all queries, the buckets
# once each), and a bucket's own dozen operations about BUCKET_COST products. The plan is taken when
# its work is at most PREFIX_FRACTION of the dense work: the same products on the same kernel, so
# little margin is needed (measured: notebook/attention.md, "Prefixes read in place, the document
# laid down first").
READ_ROWS = 2.0
BUCKET_COST = 200.0
PREFIX_FRACTION = 0.8
# One bucket of every query whose rest runs on from its prefix (ask-many's step) does the dense
# products, less the mask over the prefix and a fresh score tensor per layer: the same work by the
# count above, but it pays only from the number of queries where whole steps' attention beat dense by
# the median and by the fastest run (notebook/attention.md, "Cascade attention over a shared document").
JOINED_MIN_QUERIES = 24


@dataclass
class Bucket:
    rows: torch.Tensor  # [Q] long: the forward's query rows whose visible prefix is [0, prefix)
    prefix: int  # p
    rest: torch.Tensor  # [R] long: every other slot any of the rows sees (ascending)
    masks: object  # [Q, R] additive over the rest, or a dict of them by layer type
    span: tuple[int, int] | None = None  # the rest is the run of slots [start, stop), read as a view
    stacked: dict = field(default_factory=dict)  # per mask: [H/G * Q, R], the bmm core's rows
    joined: dict = field(default_factory=dict)  # per mask: [1, 1, Q, p + R], sdpa's mask

    def mask(self, kind: str | None) -> torch.Tensor:
        """[Q, R] additive over the rest for a layer type (None: the forward's only mask)."""
        return self.masks if kind is None else self.masks[kind]


@dataclass
class PrefixPlan:
    """Made once per forward, read by every layer."""

    buckets: list[Bucket]
    back: torch.Tensor  # [M] long: where row m's output lies among the buckets' rows, in bucket order
    whole: bool = False  # one bucket of every row in order: no rows picked, none put back
    scratch: dict = field(default_factory=dict)  # score buffers by shape, reused by every layer

    def attend(self, core: str, onednn: bool, layer_type: str, query, keys, values, scale: float):
        """[1, M, H * D]: this layer's attention on the "bmm" core or sdpa (as oneDNN products where
        `onednn` and they apply: mdcli.backends.attention.gemm)."""
        kind = layer_type if isinstance(self.buckets[0].masks, dict) else None
        if core == "bmm":
            return grouped_attention(self, query, keys, values, kind, scale)
        return sdpa_attention(self, onednn, query, keys, values, kind, scale)

    def one_product(self, min_queries: int) -> bool:
        """One bucket of at least `min_queries` queries whose rest runs on from its prefix: prefix and
        rest are one product (`joined`)."""
        bucket = self.buckets[0]
        return (self.whole and bucket.rows.shape[0] >= min_queries and bucket.span is not None
                and bucket.span[0] == bucket.prefix)

    def work(self, gather_cost: float) -> float:
        """The plan's work in query-slot products (see READ_ROWS); gather_cost: a gathered slot's."""
        return sum(bucket_work(len(b.rows), b.prefix, len(b.rest), b.span is None, gather_cost)
                   for b in self.buckets)


def bucket_work(queries: int, prefix: int, rest: int, gathered: bool, gather_cost: float) -> float:
    """One bucket's work: its queries over its prefix and rest, the rest's gather, its operations."""
    return (queries + READ_ROWS) * (prefix + rest) + gather_cost * rest * gathered + BUCKET_COST


def visible_prefix(allowed: torch.Tensor) -> torch.Tensor:
    """[M] long: for each row of allowed [M, N] bool, how many leading slots it sees without a gap."""
    return allowed.to(torch.int32).cumprod(1).sum(1)


def bucket_prefixes(common: torch.Tensor, max_buckets: int = MAX_BUCKETS, gather_cost: float = 12.0):
    """(prefix lengths [B], bucket of each row [M]) or None past `max_buckets` distinct prefixes;
    common: [M, N] bool, the slots a row sees under every mask; gather_cost: a gathered slot's."""
    prefixes, bucket_of_row = torch.unique(visible_prefix(common), return_inverse=True)
    if prefixes.shape[0] > max_buckets:
        return None
    return joined_buckets(prefixes, bucket_of_row, gather_cost)


def joined_buckets(prefixes: torch.Tensor, bucket_of_row: torch.Tensor, gather_cost: float = 12.0):
    """(prefixes, bucket of each row) with each bucket joined to the one below it where that is
    less work (`work_floor`'s counting): the Q rows of a bucket over [0, p) and those of the next,
    over [0, p'), read [0, p) once together and [p, p') as rest (gathered, at worst), when
    (Q + gather_cost) (p' - p) <= READ_ROWS p + BUCKET_COST, the second bucket's own reading of
    [0, p). So the branch whose question follows the document directly (it sees a few slots more
    without a gap) is no bucket of its own: every query reads the document in one product; margins'
    depths, hundreds of slots apart, stay apart."""
    sizes = torch.bincount(bucket_of_row, minlength=prefixes.shape[0]).tolist()
    joined_to, kept = [], []  # joined_to[b]: the bucket b now belongs to (an index into kept)
    for p, size in zip(prefixes.tolist(), sizes):
        if kept and (kept[-1][1] + gather_cost) * (p - kept[-1][0]) <= READ_ROWS * kept[-1][0] + BUCKET_COST:
            kept[-1][1] += size
        else:
            kept.append([p, size])
        joined_to.append(len(kept) - 1)
    new_prefixes = torch.tensor([p for p, _ in kept], dtype=prefixes.dtype, device=prefixes.device)
    return new_prefixes, torch.tensor(joined_to, device=prefixes.device)[bucket_of_row]


def dense_work(queries: int, slots: int) -> float:
    """The dense attention's work on the same scale as `PrefixPlan.work`."""
    return (queries + READ_ROWS) * slots


def work_floor(prefixes, bucket_of_row) -> float:
    """A lower bound of the plan's work before the rests are found: each bucket over its prefix."""
    queries = torch.bincount(bucket_of_row, minlength=prefixes.shape[0])  # [B]
    return float(((queries + READ_ROWS) * prefixes).sum()) + BUCKET_COST * prefixes.shape[0]


def plan_prefixes(mask, common: torch.Tensor, widest: torch.Tensor, prefixes, bucket_of_row,
                  gather_cost: float = 12.0) -> PrefixPlan:
    """The plan for the engine's additive mask ([1, 1, M, N] or a dict by layer type); common and
    widest: [M, N] bool, the slots a row sees under every mask and under any mask. A bucket's rest
    is read as one view of its span (first to last slot, the slots between masked) where that is
    less work than gathering it (`bucket_work`)."""
    order = torch.argsort(bucket_of_row, stable=True)  # [M]: rows bucket by bucket, in row order within
    sizes = torch.bincount(bucket_of_row, minlength=prefixes.shape[0]).tolist()
    buckets, start = [], 0
    for p, size in zip(prefixes.tolist(), sizes):
        rows = order[start:start + size]
        start += size
        rest = widest[rows, p:].any(0).nonzero().flatten() + p  # [R]
        span = _span(rest, size, gather_cost)
        if span is not None:
            rest = torch.arange(*span, device=rest.device)
        pick = (lambda additive, rows=rows, rest=rest:  # -inf held at the dtype's lowest: no inf - inf
                additive[0, 0][rows[:, None], rest[None, :]].clamp_(min=torch.finfo(additive.dtype).min))
        masks = {kind: pick(x) for kind, x in mask.items()} if isinstance(mask, dict) else pick(mask)
        buckets.append(Bucket(rows=rows, prefix=p, rest=rest, masks=masks, span=span))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.shape[0], device=order.device)
    return PrefixPlan(buckets=buckets, back=back, whole=len(buckets) == 1)


def _span(rest: torch.Tensor, queries: int, gather_cost: float) -> tuple[int, int] | None:
    """(start, stop) of the rest's slots where reading that run as a view is less work than
    gathering the slots themselves, else None."""
    if rest.shape[0] == 0:
        return None
    start, stop = int(rest[0]), int(rest[-1]) + 1
    as_view = bucket_work(queries, 0, stop - start, False, gather_cost)
    return (start, stop) if as_view <= bucket_work(queries, 0, rest.shape[0], True, gather_cost) else None


def grouped_attention(plan: PrefixPlan, query, keys, values, kind, scale: float):
    """The bmm core, bucket by bucket, as cascade attention (the module's docstring): query
    [1, H, M, D], keys/values [1, G, N, D]; kind: the layer type of the engine's dict mask, or
    None. Returns [1, M, H * D]. The scale is folded into the queries once per layer."""
    _, heads, m, dim = query.shape
    groups = keys.shape[1]
    per_group = heads // groups
    scaled = query[0] * scale  # [H, M, D]
    outs = []
    for bucket in plan.buckets:
        q = bucket.rows.shape[0]
        picked = scaled if plan.whole else scaled.index_select(1, bucket.rows)
        stacked = picked.reshape(groups, per_group * q, dim)  # [G, H/G * Q, D]
        outs.append(_bucket_attention(bucket, stacked, keys[0], values[0], kind, per_group, plan.scratch)
                    .view(groups, per_group, q, dim))
    out = outs[0] if plan.whole else torch.cat(outs, dim=2).index_select(2, plan.back)  # [G, H/G, M, D]
    return out.permute(2, 0, 1, 3).reshape(1, m, heads * dim)


def _bucket_attention(bucket: Bucket, stacked, keys, values, kind, per_group: int, scratch: dict):
    """[G, H/G * Q, D]: one bucket's attention; stacked: its scaled queries; keys, values [G, N, D]."""
    p, span = bucket.prefix, bucket.span
    if not p and not bucket.rest.shape[0]:  # rows that see nothing: nothing to attend
        return stacked.new_zeros(stacked.shape)
    rows = None
    if bucket.rest.shape[0]:
        rows = bucket.stacked.get(kind)
        if rows is None:  # once per forward and mask kind, not per layer
            rows = bucket.stacked[kind] = bucket.mask(kind).repeat(per_group, 1)  # [H/G * Q, R]
    if span is not None and span[0] == p:  # the rest runs on from the prefix: one part
        return joined(stacked, keys[:, :span[1]], values[:, :span[1]], rows, p, scratch)
    parts = []
    if p:  # over [0, p): a view of the cache, no copy, no mask
        parts.append(partial(stacked, keys[:, :p], values[:, :p], None, scratch))
    if rows is not None:
        if span is not None:  # the rest's slots are one run: a view
            rest_keys, rest_values = keys[:, span[0]:span[1]], values[:, span[0]:span[1]]
        else:  # [G, R, D]: gathered once per layer
            rest_keys, rest_values = keys.index_select(1, bucket.rest), values.index_select(1, bucket.rest)
        parts.append(partial(stacked, rest_keys, rest_values, rows, scratch))
    return parts[0][0] if len(parts) == 1 else merge(*parts)


def joined(stacked, keys, values, rows, masked_from: int, scratch: dict | None = None):
    """[G, S, D]: softmax(stacked keys^T + mask) values where the mask `rows` covers only the keys
    from `masked_from` on (the rest running on from the prefix): one part, no merge. On CPU in
    float32 the fused flash kernel (`partial`), its mask zeros over the prefix (made once per
    forward and mask kind: scratch)."""
    if _fused(stacked):
        whole = None if scratch is None else scratch.get(id(rows))
        if whole is None:
            whole = torch.cat([rows.new_zeros(rows.shape[0], masked_from), rows], dim=1)  # [S, K]
            if scratch is not None:
                scratch[id(rows)] = whole
        return partial(stacked, keys, values, whole)[0]
    scores = _scores(stacked, keys, scratch)
    scores[..., masked_from:].add_(rows)
    return torch.bmm(torch.softmax(scores, dim=-1, out=scores), values)


def _scores(stacked, keys, scratch: dict | None):
    """[G, S, K] stacked keys^T, into a buffer kept for the forward's layers where scratch is given."""
    shape = (keys.shape[0], stacked.shape[1], keys.shape[1])
    scores = None if scratch is None else scratch.get(shape)
    if scores is None:
        scores = torch.empty(shape, dtype=stacked.dtype, device=stacked.device)
        if scratch is not None:
            scratch[shape] = scores
    return torch.bmm(stacked, keys.transpose(1, 2), out=scores)


def partial(stacked, keys, values, rows, scratch: dict | None = None):
    """One part of a cascade: softmax(stacked keys^T + rows) values and each row's log-sum-exp of
    its scores, for stacked [G, S, D] (scaled), keys, values [G, K, D] (views of the cache welcome),
    rows [S, K] additive (dtype-min where masked) or None. Returns ([G, S, D], [G, S, 1]).

    On CPU in float32, torch's fused flash kernel, which returns the log-sum-exp itself
    (`_scaled_dot_product_flash_attention_for_cpu`: the products block by block, the exponentials
    in between, no score tensor): the parts' own small operations cost more than the kernel saves
    otherwise (notebook/attention.md, "Cascade attention over a shared document"). Elsewhere two
    batched products and a softmax; scratch: their score buffers, kept for the forward's layers."""
    if _fused(stacked):
        mask = None if rows is None else rows[None, None]
        out, lse = FLASH(stacked[None], keys[None], values[None], 0.0, False, attn_mask=mask, scale=1.0)
        return out[0], lse[0, :, :, None]
    scores = _scores(stacked, keys, scratch)
    if rows is not None:
        scores.add_(rows)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.bmm(torch.softmax(scores, dim=-1, out=scores), values), lse


FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused(stacked) -> bool:
    """Whether torch's fused CPU flash kernel takes these queries: float32 on the CPU."""
    return FLASH is not None and stacked.device.type == "cpu" and stacked.dtype == torch.float32


def merge(first, second):
    """Two parts' (output, log-sum-exp) over disjoint slots -> the output over both: the log-sum-exp
    merge of cascade attention (FlashInfer, Hydragen), l = logaddexp(l1, l2), out = o1 exp(l1 - l)
    + o2 exp(l2 - l). A part whose row saw only masked slots has l near the dtype's lowest (the
    masks are clamped there, never -inf), so it weighs nothing. Overwrites the first output."""
    (out, lse), (out2, lse2) = first, second
    both = torch.logaddexp(lse, lse2)
    return out.mul_(lse.sub_(both).exp_()).addcmul_(out2, lse2.sub_(both).exp_())


def sdpa_attention(plan: PrefixPlan, onednn: bool, query, keys, values, kind, scale: float):
    """sdpa (mdcli.backends.attention.gemm.sdpa_attention), bucket by bucket, on the prefix and the
    rest joined (sdpa takes one key tensor): [1, M, H * D]."""
    _, heads, m, dim = query.shape
    outs = []
    for bucket in plan.buckets:
        q, p = bucket.rows.shape[0], bucket.prefix
        joined = bucket.joined.get(kind)
        if joined is None:  # [1, 1, Q, p + R]: the prefix unmasked, then the rest's mask
            small = bucket.mask(kind)
            joined = torch.cat([small.new_zeros(q, p), small], dim=1)[None, None]
            bucket.joined[kind] = joined
        keys_b = torch.cat([keys[:, :, :p], keys.index_select(2, bucket.rest)], dim=2)  # [1, G, p + R, D]
        values_b = torch.cat([values[:, :, :p], values.index_select(2, bucket.rest)], dim=2)
        out = gemm.sdpa_attention(query.index_select(2, bucket.rows), keys_b, values_b, joined, scale,
                                  onednn)  # [1, Q, H, D]
        outs.append(out.reshape(q, heads * dim))
    return torch.cat(outs).index_select(0, plan.back)[None]  # [1, M, H * D]
