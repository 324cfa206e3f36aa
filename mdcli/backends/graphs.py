"""Decode forwards on static buffers, each width's captured once as a CUDA graph and replayed.

A decode step launches a few hundred small kernels (30 layers of norms, products, rotary, attention)
whose work on a GPU takes less time than launching them from Python. A CUDA graph records one such
forward's kernels once and replays them with one launch, provided every tensor it touches keeps its
address and shape from one replay to the next. This module gives a forward of M <= 64 tokens that
shape:

* the width is padded up to a bucket (1, 2, 4, 8, 16, 32, 64 tokens: `BUCKETS`); padded rows are
  token 0 at depth 0, see what the last real row sees, and their logits are never read;
* tokens, depths, the slots the new keys and values go to and the mask live in buffers made once per
  bucket; a step copies its own into them;
* the new keys and values are written into the KV cache's own buffers at their slots (no append), and
  attention reads each layer's whole buffer, the mask hiding every slot past the filled part and
  every slot a token does not descend from (mdcli.core.cache keeps those slots finite, so a masked
  slot adds an exact zero);
* the logits of every row are computed and the kept ones gathered afterwards.

The forward is mdcli's own (mdcli.backends.llama, with its attention kept dense: the sparse plans read
the mask on the host), handed these buffers, so the arithmetic is the same as an uncaptured step's;
a padded product or a longer key range may only sum in another order (within float32 rounding).

A graph stays valid while the cache's buffers keep their addresses (a compaction moves the kept
slots down inside them). When the cache grows past its buffer (by a quarter: mdcli.core.cache),
every graph is dropped and each bucket is captured again on its next use; `captures` counts every capture, and a run reports its own
(`done.stats.graph_captures`). Wider forwards (a document's prefill, a wide verification tree) and
forwards this shape cannot hold run as they come.

`MDCLI_CUDA_GRAPHS=static` runs the same buffers, padding and slot writes on any device without
capturing, so the CPU suite checks this logic. Uncaptured, the own forward keeps its own routes (the
sparse and prefix plans, mdcli's attention kernel), and attention reads only the filled part and the
step's slots; a dense core handed in (the captured step's, CAPTURED_CORE) reads the whole buffer, as
a graph must. The plan (mdcli.backends.select) decides which mode a model gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # padded forward widths: a graph each
# A captured step attends as two batched products per key/value group with the mask added (the
# "bmm" core: mdcli.backends.llama): sdpa's kernels read a masked buffer several times slower, and
# FlexAttention, faster still, compiles for seconds at every new shape (notebook/gpu.md, "CUDA graphs
# for the forest's decode step").
CAPTURED_CORE = "bmm"


@dataclass
class _Inputs:
    """One bucket's static inputs and, once captured, its graph and output."""

    tokens: torch.Tensor  # [W] long
    positions: torch.Tensor  # [W] long: depths
    slots: torch.Tensor  # [W] long: the cache slots the W new keys and values are written to
    mask: torch.Tensor  # [1, 1, W, capacity] additive, model dtype
    rows: torch.Tensor  # [W] long: 0..W-1, every row's logits
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [W, V]: the captured forward's output, overwritten by each replay


class _SlotCache:
    """The cache as the own forward sees it inside a static step: `update` writes the new keys and
    values ([1, G, W, D]) at the step's slots of each layer's buffer and hands attention the whole
    buffer ([1, G, capacity, D]), or its first `reach` slots."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor,
                 reach: int | None = None) -> None:
        self.buffers = buffers
        self.slots = slots
        self.reach = reach

    def update(self, key, value, index):
        keys, values = self.buffers[index]
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        if self.reach is None:
            return keys, values
        return keys[..., : self.reach, :], values[..., : self.reach, :]


class StaticStep:
    """Callable as (own, tokens, positions, mask, cache, keep) -> [C, V] logits or None, `own` the
    forward to run and the rest as it takes them, for the forwards `serves` accepts. `capture`: record
    each bucket's forward as a CUDA graph and replay it (a CUDA model); else run it on the same
    buffers as it comes (any device)."""

    def __init__(self, *, capture: bool, core: str | None = None, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.capture = capture
        self.core = core  # the attention core, dense ("bmm", "sdpa"); None: the own forward's choice (uncaptured only)
        if capture and core is None:
            raise ValueError("a captured step needs a dense attention core: the sparse plans read the mask on the host")
        self.buckets = buckets
        self.captures = 0  # graphs recorded, over this forward's life
        self.steps = 0  # forwards served
        self._inputs: dict[int, _Inputs] = {}
        self._buffer_key: tuple | None = None  # the cache buffers' addresses the inputs and graphs were made for
        self._pool = None  # one memory pool for every bucket's graph

    def serves(self, tokens, mask, cache) -> bool:
        """A forward the own forward takes (mdcli.backends.forward decides that: a mask, or none for a
        lone token where no window applies) of at most the widest bucket, with one mask, not a dict of
        them by layer type, over a non-empty cache whose layers keep static buffers."""
        if tokens.shape[0] > self.buckets[-1] or isinstance(mask, dict):
            return False
        layers = getattr(cache, "layers", None)
        return bool(layers) and cache.get_seq_length() > 0 and all(hasattr(layer, "reserve") for layer in layers)

    def __call__(self, own, tokens, positions, mask, cache, keep) -> torch.Tensor | None:
        """own: the forward that runs on the buffers (mdcli.backends.llama.FastForward); the rest as
        it takes them."""
        m, filled = tokens.shape[0], cache.get_seq_length()
        width = next(b for b in self.buckets if b >= m)
        for layer in cache.layers:
            layer.reserve(filled + width)
        buffers = [layer.buffers for layer in cache.layers]
        self._follow(buffers, own)
        inputs = self._inputs.get(width) or self._new_inputs(width, buffers, tokens.device)
        self._fill(inputs, tokens, positions, mask, filled)
        if not self.capture:
            logits = self._forward(own, inputs, buffers, None if self.core else filled + m)
        else:
            if inputs.graph is None:
                self._record(own, inputs, buffers)
            inputs.graph.replay()
            logits = inputs.logits
        for layer in cache.layers:
            layer.set_length(filled + m)
        self.steps += 1
        return None if keep is None else logits[keep]  # a gather: a copy the next replay leaves alone

    def _follow(self, buffers, own) -> None:
        """Drop every bucket's inputs and graph when the cache's buffers moved (grown) or another
        forward runs on them."""
        key = (id(own), *((k.data_ptr(), v.data_ptr(), k.shape[-2]) for k, v in buffers))
        if key != self._buffer_key:
            self._inputs.clear()
            self._pool = None  # the dropped graphs freed their pool: the next capture takes a new one
            self._buffer_key = key

    def _new_inputs(self, width: int, buffers, device) -> _Inputs:
        capacity = buffers[0][0].shape[-2]
        dtype = buffers[0][0].dtype
        long = {"dtype": torch.long, "device": device}
        inputs = _Inputs(tokens=torch.zeros(width, **long), positions=torch.zeros(width, **long),
                         slots=torch.zeros(width, **long),
                         mask=torch.zeros(1, 1, width, capacity, dtype=dtype, device=device),
                         rows=torch.arange(width, **long))
        self._inputs[width] = inputs
        return inputs

    def _fill(self, inputs: _Inputs, tokens, positions, mask, filled: int) -> None:
        """This step's tokens, depths, slots and mask into the bucket's buffers; padded rows: token 0
        at depth 0, written to the slots after the step's (which no row sees), seeing what the last
        real row sees (so a rule that reads the mask finds only the real rows' shapes)."""
        m, width = tokens.shape[0], inputs.tokens.shape[0]
        inputs.tokens[:m].copy_(tokens)
        inputs.positions[:m].copy_(positions)
        if m < width:
            inputs.tokens[m:].zero_()
            inputs.positions[m:].zero_()
        torch.arange(filled, filled + width, out=inputs.slots)
        full = inputs.mask[0, 0]  # [W, capacity]
        full.fill_(torch.finfo(full.dtype).min)
        if mask is None:  # a lone token seeing the whole cache and itself
            full[:m, : filled + m].zero_()
        else:
            full[:m, : filled + m].copy_(mask[0, 0])
        if m < width:
            full[m:, : filled + m].copy_(full[m - 1, : filled + m].expand(width - m, -1))

    def _forward(self, own, inputs: _Inputs, buffers, reach: int | None = None) -> torch.Tensor:
        """The own forward over the bucket's buffers: [W, V] logits of every row. Attention reads each
        whole buffer (reach None: a captured step's), or its first `reach` slots, the filled part and
        the step's real tokens (an uncaptured step on the plan's own routes, so that its sparse,
        prefix and kernel rules see the mask an unpadded step would)."""
        mask = inputs.mask if reach is None else inputs.mask[..., :reach]
        return own(inputs.tokens, inputs.positions, mask, _SlotCache(buffers, inputs.slots, reach), inputs.rows,
                   core=self.core)

    def _record(self, own, inputs: _Inputs, buffers) -> None:
        """Capture the bucket's forward as a CUDA graph, after warming it up on a side stream (as
        torch.cuda.graphs asks: lazy initialisation stays out of the graph). The warm-up writes the
        same keys and values to the same slots that the first replay writes again."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(own, inputs, buffers)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            inputs.logits = self._forward(own, inputs, buffers)
        inputs.graph = graph
        self.captures += 1


def capture_reason(model, device: torch.device) -> str | None:
    """Why a CUDA model's decode forwards cannot be captured (None: they can): a rotary embedding
    that recomputes its frequencies from the depths it is given (dynamic, longrope) reads them on
    the host, which a graph cannot do."""
    if device.type != "cuda":
        return "not a CUDA model"
    rope = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", "default")
    if "dynamic" in str(rope) or rope == "longrope":
        return f"the {rope} rotary embedding reads the depths on the host"
    return None
