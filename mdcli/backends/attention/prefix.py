"""Attention over a prefix of the cache read in place, plus each bucket's few other slots gathered.

Where a forest hangs its branches off different depths of one long chain (margins' chain layout:
the margin of segment i reads segments 1..i, and `run.prefill_steps` lays such a document down as
one contiguous run of slots), every query sees slots [0, p) for its own p, then a few slots of
its own (its prompt's tail, the tokens it wrote). The dense attention scores every query against
every slot and masks afterwards; the gathered plan (mdcli.backends.attention.sparse) would copy each
query's thousands of prefix slots in every layer. Here the queries are cut into *buckets* by p:
a bucket's scores over [0, p) are one product with a view of the cache (nothing copied), its
scores over "the rest" (the union of its queries' other visible slots, gathered: few) one more,
and one softmax spans both; the values likewise.

Exact as the dense path: a key left out has weight exp(dtype-min - max) = 0 there, so only the
order of float sums changes. The prefix is visible to every query of the bucket under every mask
the forward has (a sliding window included: p is taken on all of them at once), so its part needs
no mask; the rest's masks are gathered from the engine's, one per layer type.
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


@dataclass
class Bucket:
    rows: torch.Tensor  # [Q] long: the forward's query rows whose visible prefix is [0, prefix)
    prefix: int  # p
    rest: torch.Tensor  # [R] long: every other slot any of the rows sees (ascending)
    masks: object  # [Q, R] additive over the rest, or a dict of them by layer type
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

    def attend(self, core: str, onednn: bool, layer_type: str, query, keys, values, scale: float):
        """[1, M, H * D]: this layer's attention on the "bmm" core or sdpa (as oneDNN products where
        `onednn` and they apply: mdcli.backends.attention.gemm)."""
        kind = layer_type if isinstance(self.buckets[0].masks, dict) else None
        if core == "bmm":
            return grouped_attention(self, query, keys, values, kind, scale)
        return sdpa_attention(self, onednn, query, keys, values, kind, scale)

    def work(self, gather_cost: float) -> float:
        """The plan's work in query-slot products (see READ_ROWS); gather_cost: a gathered slot's."""
        return sum((len(b.rows) + READ_ROWS) * (b.prefix + len(b.rest)) + gather_cost * len(b.rest) + BUCKET_COST
                   for b in self.buckets)


def visible_prefix(allowed: torch.Tensor) -> torch.Tensor:
    """[M] long: for each row of allowed [M, N] bool, how many leading slots it sees without a gap."""
    return allowed.to(torch.int32).cumprod(1).sum(1)


def bucket_prefixes(common: torch.Tensor, max_buckets: int = MAX_BUCKETS):
    """(prefix lengths [B], bucket of each row [M]) or None past `max_buckets` distinct prefixes;
    common: [M, N] bool, the slots a row sees under every mask."""
    prefixes, bucket_of_row = torch.unique(visible_prefix(common), return_inverse=True)
    if prefixes.shape[0] > max_buckets:
        return None
    return prefixes, bucket_of_row


def dense_work(queries: int, slots: int) -> float:
    """The dense attention's work on the same scale as `PrefixPlan.work`."""
    return (queries + READ_ROWS) * slots


def work_floor(prefixes, bucket_of_row) -> float:
    """A lower bound of the plan's work before the rests are found: each bucket over its prefix."""
    queries = torch.bincount(bucket_of_row, minlength=prefixes.shape[0])  # [B]
    return float(((queries + READ_ROWS) * prefixes).sum()) + BUCKET_COST * prefixes.shape[0]


def plan_prefixes(mask, common: torch.Tensor, widest: torch.Tensor, prefixes, bucket_of_row) -> PrefixPlan:
    """The plan for the engine's additive mask ([1, 1, M, N] or a dict by layer type); common and
    widest: [M, N] bool, the slots a row sees under every mask and under any mask."""
    order = torch.argsort(bucket_of_row, stable=True)  # [M]: rows bucket by bucket, in row order within
    sizes = torch.bincount(bucket_of_row, minlength=prefixes.shape[0]).tolist()
    buckets, start = [], 0
    for p, size in zip(prefixes.tolist(), sizes):
        rows = order[start:start + size]
        start += size
        rest = widest[rows, p:].any(0).nonzero().flatten() + p  # [R]
        pick = (lambda additive, rows=rows, rest=rest: additive[0, 0][rows[:, None], rest[None, :]])
        masks = {kind: pick(x) for kind, x in mask.items()} if isinstance(mask, dict) else pick(mask)
        buckets.append(Bucket(rows=rows, prefix=p, rest=rest, masks=masks))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.shape[0], device=order.device)
    return PrefixPlan(buckets=buckets, back=back)


def grouped_attention(plan: PrefixPlan, query, keys, values, kind, scale: float):
    """The bmm core, bucket by bucket: query [1, H, M, D], keys/values [1, G, N, D]; kind: the
    layer type of the engine's dict mask, or None. Returns [1, M, H * D]."""
    _, heads, m, dim = query.shape
    groups = keys.shape[1]
    per_group = heads // groups
    outs = []
    for bucket in plan.buckets:
        q, p = bucket.rows.shape[0], bucket.prefix
        stacked = query[0].index_select(1, bucket.rows).view(groups, per_group * q, dim)  # [G, H/G * Q, D]
        rows = bucket.stacked.get(kind)
        if rows is None:  # once per forward and mask kind, not per layer
            rows = bucket.stacked[kind] = bucket.mask(kind).repeat(per_group, 1)  # [H/G * Q, R]
        rest_keys = keys[0].index_select(1, bucket.rest)  # [G, R, D]
        rest_values = values[0].index_select(1, bucket.rest)
        scores = torch.cat([
            torch.bmm(stacked, keys[0, :, :p].transpose(1, 2)).mul_(scale),  # [G, H/G * Q, p]: a view, no copy
            torch.baddbmm(rows, stacked, rest_keys.transpose(1, 2), alpha=scale),  # [G, H/G * Q, R]
        ], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs[..., :p], values[0, :, :p])  # [G, H/G * Q, D]
        out = torch.baddbmm(out, probs[..., p:], rest_values)
        outs.append(out.view(groups, per_group, q, dim))
    out = torch.cat(outs, dim=2).index_select(2, plan.back)  # [G, H/G, M, D] in row order
    return out.permute(2, 0, 1, 3).reshape(1, m, heads * dim)


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
