"""Attention over each query's visible slots only, for forwards where queries see little of the cache.

The engine's mask is [M, N] over every cache slot (N counts this forward's own M tokens), and the
dense attention computes every query against every slot, masking afterwards. In a wide forest of
unrelated branches (64 classification prompts of ~170 tokens over an 11,000-slot cache) a query
sees ~1-2% of the slots, so ~98% of that work is multiplied by zero. Here the queries are cut into
*groups* (runs of consecutive rows that are one chain: each row sees the row before it, as the
engine lays chains out), each group's keys are the union of the slots its rows see, and attention
runs as one batched product over [groups, padded keys] with the small mask gathered from the
engine's. The plan (which rows, which slots, the small masks) is made once per forward and reused
by every layer; each layer gathers its keys and values with one `index_select` each.

Exact: a masked key's weight is exp(dtype-min - max) = 0 in the dense softmax, so leaving it out
changes nothing but the order of float sums (logits agree to float32 rounding, tokens identical).
Padding keys carry the same dtype-min; padding query rows repeat a real row and are dropped.

`plan_for` is the rule: this gathered plan where its padded
work (groups x queries x keys, plus the gather) is at most SPARSE_FRACTION of the dense M x N, the
prefix plan of mdcli.backends.attention.prefix where its work is at most PREFIX_FRACTION of the dense work
or where it is one product over a shared document for JOINED_MIN_QUERIES queries or more, the cheaper
when both qualify, else dense. `MDCLI_SPARSE_ATTENTION=0` turns both off, `=always`
takes the gathered plan for every forward of 2+ queries, `=prefix` the prefix plan. (measured:
notebook/attention.md, "Attention over each chain's visible slots only" and "Prefixes read in
place, the document laid down first")
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mdcli.backends.attention import gemm
from mdcli.backends.attention.prefix import (
    JOINED_MIN_QUERIES,
    PREFIX_FRACTION,
    PrefixPlan,
    bucket_prefixes,
    dense_work,
    plan_prefixes,
    work_floor,
)

SPARSE_FRACTION = 0.5  # sparse when its padded work is at most this share of the dense work
MIN_QUERIES = 2  # a lone query: the dense product over the cache is one row, nothing to save
# A gathered key/value slot costs about as much as this many query rows (`python -m
# mdcli.bench.attention`): 12 on AVX2-only x86-64, 4 on AVX-512 with oneDNN linears (measured:
# notebook/attention.md, "Attention over each chain's visible slots only"; AVX-512: "Prefixes read in
# place, the document laid down first").
GATHER_COST = 12.0
GATHER_COST_AVX512 = 4.0


def gathered_work(groups: int, group_queries: int, group_keys: int, gather_cost: float = GATHER_COST) -> float:
    """The gathered plan's padded work in query-slot products, its gathers counted alike."""
    return groups * group_keys * (group_queries + gather_cost)


def sparse_wanted(queries: int, slots: int, groups: int, group_queries: int, group_keys: int,
                  gather_cost: float = GATHER_COST) -> bool:
    """Whether the gathered attention pays for `queries` rows over `slots` keys, cut into `groups`
    groups of at most `group_queries` rows seeing at most `group_keys` slots each (padded)."""
    if queries < MIN_QUERIES:
        return False
    return gathered_work(groups, group_queries, group_keys, gather_cost) <= SPARSE_FRACTION * queries * slots


@dataclass
class SparsePlan:
    """Made once per forward, read by every layer."""

    keys: torch.Tensor  # [B * K] long: slot of group b's k-th key (padding: slot 0, masked)
    queries: torch.Tensor  # [B * Q] long: row of group b's q-th query (padding: the group's first row)
    back: torch.Tensor  # [M] long: where row m's output lies among the B * Q padded rows
    masks: object  # [B, Q, K] additive, or a dict of them by layer type (as the engine's mask)
    groups: int  # B
    group_queries: int  # Q
    group_keys: int  # K
    rows: dict = field(default_factory=dict)  # per cache row stride: [B * G * K] rows to gather
    stacked: dict = field(default_factory=dict)  # per mask: [B * G, H/G * Q, K], the bmm core's rows

    def attend(self, core: str, onednn: bool, layer_type: str, query, keys, values, scale: float):
        """[1, M, H * D]: this layer's attention on the "bmm" core or sdpa (as oneDNN products where
        `onednn` and they apply: mdcli.backends.attention.gemm)."""
        mask = self.masks.get(layer_type) if isinstance(self.masks, dict) else self.masks
        if core == "bmm":
            return grouped_attention(self, query, keys, values, mask, scale)
        return sdpa_attention(self, onednn, query, keys, values, mask, scale)


def plan_for(mask, gather_cost: float = GATHER_COST, mode: str = "auto",
             joined_min_queries: int = JOINED_MIN_QUERIES) -> SparsePlan | PrefixPlan | None:
    """A plan for the engine's additive mask ([1, 1, M, N], or a dict by layer type), or None
    where the dense attention should run (off, a lone query, or too little to save): the gathered
    plan (within SPARSE_FRACTION of the dense work) or the prefix plan (mdcli.backends.attention.prefix,
    within PREFIX_FRACTION), the one doing less work where both qualify. gather_cost: a gathered
    slot in query rows (the plan's gather_cost). mode: "auto", "off", "always" (the gathered plan
    for every forward of 2+ queries) or "prefix" (the prefix plan wherever it applies); the last two
    for tests and measurement (MDCLI_SPARSE_ATTENTION). joined_min_queries: from how many queries
    one product over a shared document is taken whatever its work count says (the forward raises
    it where mdcli's attention kernel serves dense attention: mdcli.backends.attention.fused)."""
    if mask is None or mode == "off":
        return None
    kinds = list(mask.values()) if isinstance(mask, dict) else [mask]
    full = mask.get("full_attention", kinds[0]) if isinstance(mask, dict) else mask
    m, n = full.shape[-2], full.shape[-1]
    if m < MIN_QUERIES:
        return None
    allowed = full[0, 0] == 0  # [M, N]: the widest mask (a window only narrows it)
    if mode == "always":
        return _gathered(mask, allowed, forced=True)
    prefix_budget = None if mode == "prefix" else PREFIX_FRACTION * dense_work(m, n)
    prefix = _prefix(mask, kinds, allowed, gather_cost, prefix_budget, joined_min_queries)
    if mode == "prefix":
        return prefix
    beat = None if prefix is None else prefix.work(gather_cost)
    return _gathered(mask, allowed, gather_cost, beat=beat) or prefix


def _prefix(mask, kinds, allowed, gather_cost: float, budget: float | None,
            joined_min_queries: int = JOINED_MIN_QUERIES) -> PrefixPlan | None:
    """The prefix plan if its work is within `budget` (None: any), or if it is one product over a
    shared document of at least `joined_min_queries` queries (`PrefixPlan.one_product`)."""
    common = allowed  # [M, N]: seen under every mask
    for other in kinds if len(kinds) > 1 else []:
        common = common & (other[0, 0] == 0)
    buckets = bucket_prefixes(common, gather_cost=gather_cost)
    many = allowed.shape[0] >= joined_min_queries  # a single bucket may pay whatever its work
    if buckets is None or (budget is not None and not many and work_floor(*buckets) > budget):
        return None
    plan = plan_prefixes(mask, common, allowed, *buckets, gather_cost)
    if budget is None or plan.work(gather_cost) <= budget or plan.one_product(joined_min_queries):
        return plan
    return None


def _gathered(mask, allowed, gather_cost: float = GATHER_COST, *, forced: bool = False,
              beat: float | None = None) -> SparsePlan | None:
    """The gathered plan where `sparse_wanted` takes it and its work is at most `beat` (the prefix
    plan's, if any), or whatever it costs when `forced`."""
    m, n = allowed.shape

    def wanted(keys: int) -> bool:
        cheaper = beat is None or gathered_work(b, q_max, keys, gather_cost) <= beat
        return forced or (sparse_wanted(m, n, b, q_max, keys, gather_cost) and cheaper)

    device = allowed.device
    starts = group_starts(allowed)  # [B] first row of each group
    b = starts.shape[0]
    group_of_row = torch.zeros(m, dtype=torch.long, device=device)
    group_of_row[starts[1:]] = 1
    group_of_row = group_of_row.cumsum(0)  # [M]
    sizes = torch.bincount(group_of_row, minlength=b)  # [B]
    q_max = int(sizes.max())
    seen = int(allowed.sum(1).max())  # a group sees at least as many slots as its widest row
    if not wanted(seen):
        return None  # dense for sure: skip the union below (an [M, N] pass)
    if b == m:  # every row its own group (a decode step)
        visible = allowed  # [B, N]
    else:  # [B, N]: a slot is visible to a group when any of its rows sees it
        visible = torch.zeros(b, n, dtype=torch.int32, device=device).index_add_(
            0, group_of_row, allowed.to(torch.int32)) > 0
    counts = visible.sum(1)  # [B]
    k_max = int(counts.max())
    if not wanted(k_max):
        return None
    return _plan(mask, visible, counts, starts, sizes, group_of_row, q_max, k_max)


def group_starts(allowed: torch.Tensor) -> torch.Tensor:
    """[B] long: rows that begin a group. Row r + 1 joins row r's group when it sees row r's own
    new slot (the next token of the same chain); allowed: [M, N], the last M columns the new tokens."""
    m, n = allowed.shape
    rows = torch.arange(1, m, device=allowed.device)
    continues = allowed[rows, n - m + rows - 1]  # [M - 1]
    return torch.cat([torch.zeros(1, dtype=torch.long, device=allowed.device), rows[~continues]])


def _plan(mask, visible, counts, starts, sizes, group_of_row, q_max: int, k_max: int) -> SparsePlan:
    b, n = visible.shape
    m = group_of_row.shape[0]
    device = visible.device
    group, slot = visible.nonzero(as_tuple=True)  # ascending by group, then slot
    first = torch.cumsum(counts, 0) - counts  # [B]
    keys = torch.zeros(b, k_max, dtype=torch.long, device=device)
    keys[group, torch.arange(group.shape[0], device=device) - first[group]] = slot
    key_valid = torch.arange(k_max, device=device)[None, :] < counts[:, None]  # [B, K]
    within = torch.arange(m, device=device) - starts[group_of_row]  # [M] row's place in its group
    queries = starts[:, None].expand(b, q_max).clone()
    queries[group_of_row, within] = torch.arange(m, device=device)
    back = group_of_row * q_max + within

    def small(additive):  # [1, 1, M, N] -> [B, Q, K]
        picked = additive[0, 0][queries[:, :, None], keys[:, None, :]]
        return picked.masked_fill_(~key_valid[:, None, :], torch.finfo(additive.dtype).min)

    masks = {kind: small(x) for kind, x in mask.items()} if isinstance(mask, dict) else small(mask)
    return SparsePlan(keys=keys.flatten(), queries=queries.flatten(), back=back, masks=masks,
                      groups=b, group_queries=q_max, group_keys=k_max)


def gather(plan: SparsePlan, query, keys, values):
    """The plan's operands: query [1, H, M, D] -> [B, H, Q, D]; keys, values [1, G, N, D] ->
    [B, G, K, D] each, gathered as whole rows of D numbers straight into that order (one
    index_select along the first dimension of the cache buffer: 2-3x faster than along N)."""
    b, q, k = plan.groups, plan.group_queries, plan.group_keys
    _, heads, _, dim = query.shape
    groups = keys.shape[1]
    picked = query[0].index_select(1, plan.queries).view(heads, b, q, dim).transpose(0, 1)  # [B, H, Q, D]
    return picked, _rows(plan, keys).view(b, groups, k, dim), _rows(plan, values).view(b, groups, k, dim)


def _rows(plan: SparsePlan, cache):
    """[B * G * K, D]: cache [1, G, N, D] rows in the plan's order (group, head, key)."""
    heads, _, dim = cache.shape[1:]
    one = cache[0]  # [G, N, D]
    if one.stride(2) == 1 and one.stride(1) == dim and one.stride(0) % dim == 0:  # rows of one buffer
        per_head = one.stride(0) // dim
        flat = one.as_strided((heads * per_head - (per_head - one.shape[1]), dim), (dim, 1))  # [G * cap, D]
    else:
        per_head = one.shape[1]
        flat = one.reshape(heads * per_head, dim)
    index = plan.rows.get(per_head)
    if index is None:  # [B, G, K]: head g's slot s is row g * per_head + s
        offsets = torch.arange(heads, device=one.device) * per_head
        index = (plan.keys.view(plan.groups, 1, plan.group_keys) + offsets[None, :, None]).flatten()
        plan.rows[per_head] = index
    return flat.index_select(0, index)


def grouped_attention(plan: SparsePlan, query, keys, values, mask, scale: float):
    """The bmm core on gathered operands: the H / G query heads of a key/value group stacked.
    query [1, H, M, D], keys/values [1, G, N, D], mask [B, Q, K] additive. Returns [1, M, H * D]."""
    q_small, k_small, v_small = gather(plan, query, keys, values)
    b, heads, q, dim = q_small.shape
    groups = k_small.shape[1]
    per_group = heads // groups
    stacked = q_small.reshape(b * groups, per_group * q, dim)  # [B * G, H/G * Q, D]
    rows = plan.stacked.get(id(mask))
    if rows is None:  # once per forward and mask, not per layer
        rows = mask[:, None, None].expand(b, groups, per_group, q, mask.shape[-1])
        rows = plan.stacked[id(mask)] = rows.reshape(b * groups, per_group * q, mask.shape[-1])  # [B * G, H/G * Q, K]
    scores = torch.baddbmm(rows, stacked, k_small.reshape(b * groups, -1, dim).transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), v_small.reshape(b * groups, -1, dim))  # [B * G, H/G * Q, D]
    out = out.view(b, heads, q, dim).transpose(1, 2).reshape(b * q, heads * dim)  # [B * Q, H * D]
    return out.index_select(0, plan.back)[None]  # [1, M, H * D]


def sdpa_attention(plan: SparsePlan, onednn: bool, query, keys, values, mask, scale: float):
    """sdpa (mdcli.backends.attention.gemm.sdpa_attention) on gathered operands: [1, M, H * D]."""
    q_small, k_small, v_small = gather(plan, query, keys, values)
    b, heads, q, dim = q_small.shape
    out = gemm.sdpa_attention(q_small, k_small, v_small, mask[:, None], scale, onednn)  # [B, Q, H, D]
    return out.reshape(b * q, heads * dim).index_select(0, plan.back)[None]
