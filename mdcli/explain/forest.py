"""A picture of a forest: how a recipe's prompts share the cache, and the mask that keeps each
branch exact.

The layout is computed without running the model. `plan_layout` drives the real
`mdcli.core.run.prefill_prompts` (the radix tree of token prefixes) and the real `Engine.extend` (how
chains are packed into forwards) over a model-free stand-in whose `forward` only places tokens
with `forest.layout_chains`, exactly as `Engine.forward` does before it calls the model. So the
slots, positions and parents shown are the ones a run would use, not a re-derivation that could
drift from them.

Follow-up branches (children) cannot be placed in advance: they fork after their parent's answer,
whose length is known only at run time. The tree lists them; the mask shows the roots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.tree import Tree

from mdcli.core.decoding import BranchSpec
from mdcli.core.engine import ChainResult, Engine
from mdcli.core.forest import Forest, layout_chains, pad_rows
from mdcli.core.run import prefill_prompts
from mdcli.strategies.job import RunOptions, run_options


TOKEN_GRID_LIMIT = 48
"""Largest forest drawn token by token (--tokens); bigger ones get one row per radix edge."""

FILLED, EMPTY, TRIANGLE = "■", "·", "◣"


# -- the layout --------------------------------------------------------------------------------


@dataclass
class Edge:
    """A radix-tree edge: a run of cache slots read by exactly the same prompts.

    `slots` are in depth order; they are contiguous unless a long prompt was fed in several
    forwards (--max-forward-tokens) together with other prompts."""

    id: int
    parent: int | None  # the edge this one hangs off
    prompts: tuple[int, ...]  # indices of the prompts whose path contains these slots
    slots: list[int]
    depths: list[int]
    ends: tuple[int, ...] = ()  # prompts whose last token is this edge's last slot

    @property
    def depth_range(self) -> tuple[int, int]:
        return self.depths[0], self.depths[-1]

    @property
    def slot_range(self) -> tuple[int, int]:
        return min(self.slots), max(self.slots)

    @property
    def contiguous(self) -> bool:
        low, high = self.slot_range
        return high - low + 1 == len(self.slots)


@dataclass
class ForestLayout:
    """Every prompt token in the shared cache, in physical order, and the radix edges."""

    token_ids: list[int]
    depth: list[int]  # the position id (RoPE) of each slot
    parent: list[int]  # parent slot, -1 for a root token
    prompt_ends: list[int]  # slot of each prompt's last token
    edges: list[Edge] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def path(self, slot: int) -> list[int]:
        """Slots that `slot` attends to: its ancestors and itself, root first."""
        chain = []
        while slot >= 0:
            chain.append(slot)
            slot = self.parent[slot]
        return chain[::-1]

    def mask(self) -> list[list[bool]]:
        """[query slot][key slot]: True where attention is allowed. For small forests (it is N x N)."""
        rows = []
        for slot in range(len(self)):
            allowed = set(self.path(slot))
            rows.append([key in allowed for key in range(len(self))])
        return rows

    def edge_ancestors(self, edge_id: int) -> set[int]:
        """Edges whose every token the given edge's tokens attend to (not the edge itself)."""
        found, parent = set(), self.edges[edge_id].parent
        while parent is not None:
            found.add(parent)
            parent = self.edges[parent].parent
        return found


class _ModelFreeEngine:
    """What `prefill_prompts` needs from an Engine, without a model: the real packing
    (`Engine.extend`, reused as is) and the real placement (`layout_chains`)."""

    extend = Engine.extend
    extend_steps = Engine.extend_steps

    def __init__(self, options: RunOptions) -> None:
        self.forest = Forest("cpu")
        for name, value in options.engine_settings().items():  # what Engine.extend reads of them
            setattr(self, name, value)

    def __len__(self) -> int:
        return len(self.forest)

    def forward(self, rows: torch.Tensor, chains: list[list[int]], *, logits: bool = True) -> list[ChainResult]:
        """Engine.forward up to the model call: place the chains, record them, return end rows."""
        layout = layout_chains(rows, [len(chain) for chain in chains], len(self.forest))
        tokens = torch.tensor([t for chain in chains for t in chain], dtype=torch.long)  # [M]
        self.forest.append(tokens, layout.positions, layout.parents)
        ends = layout.allowed[layout.ends]  # [C, N + M]
        return [ChainResult(row=ends[i], logits=None) for i in range(len(chains))]


def plan_layout(prompts: Sequence[Sequence[int]], options: RunOptions | None = None, **engine_options) -> ForestLayout:
    """Where a run with `options` (RunOptions, or its fields as keywords) would put these prompts'
    tokens: slots, positions (depths), parents, edges."""
    options = run_options(options, engine_options, every=True)
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    engine = _ModelFreeEngine(options)
    results = prefill_prompts(engine, [list(prompt) for prompt in prompts])  # type: ignore[arg-type]
    forest = engine.forest
    n = len(forest)
    readers = torch.stack([pad_rows(result.row[None], n)[0] for result in results])  # [P, N]
    layout = ForestLayout(
        token_ids=forest.tokens.tolist(),
        depth=forest.depth.tolist(),
        parent=forest.parent.tolist(),
        prompt_ends=[int(result.row.nonzero().max()) for result in results],
    )
    layout.edges = _edges(layout, readers.T.tolist())
    return layout


def _edges(layout: ForestLayout, readers_of_slot: list[list[bool]]) -> list[Edge]:
    """Group slots into radix edges: an edge ends exactly where the set of prompts reading it changes
    (a split, or a prompt that ends inside another's path)."""
    by_readers: dict[tuple[int, ...], Edge] = {}
    edges: list[Edge] = []
    slots_by_depth = sorted(range(len(layout)), key=lambda slot: (layout.depth[slot], slot))
    for slot in slots_by_depth:
        readers = tuple(i for i, reads in enumerate(readers_of_slot[slot]) if reads)
        edge = by_readers.get(readers)
        if edge is None:
            parent_slot = layout.parent[slot]
            parent = None if parent_slot < 0 else _edge_holding(edges, parent_slot)
            edge = Edge(id=-1, parent=parent, prompts=readers, slots=[], depths=[])
            by_readers[readers] = edge
            edges.append(edge)
        edge.slots.append(slot)
        edge.depths.append(layout.depth[slot])
    return _number_by_first_slot(edges, layout.prompt_ends)


def _edge_holding(edges: list[Edge], slot: int) -> int:
    return next(index for index, edge in enumerate(edges) if slot in edge.slots)


def _number_by_first_slot(edges: list[Edge], prompt_ends: list[int]) -> list[Edge]:
    """Edges numbered in physical order (the order a reader scans the cache)."""
    order = sorted(range(len(edges)), key=lambda index: min(edges[index].slots))
    new_id = {old: new for new, old in enumerate(order)}
    numbered = []
    for old in order:
        edge = edges[old]
        edge.id = new_id[old]
        edge.parent = None if edge.parent is None else new_id[edge.parent]
        edge.ends = tuple(i for i, end in enumerate(prompt_ends) if end == edge.slots[-1])
        numbered.append(edge)
    return numbered


# -- the picture -------------------------------------------------------------------------------

TokenText = Callable[[int], str]


def render_explanation(
    console: Console,
    roots: list[BranchSpec],
    layout: ForestLayout,
    token_text: TokenText,
    *,
    title: str,
    tokens: bool = False,
) -> None:
    """Print the branch tree and the attention mask (token by token, or one row per edge)."""
    console.print(forest_tree(roots, layout, token_text, title=title))
    for line in constraint_lines(roots):
        console.print(line, markup=False, highlight=False)
    console.print()
    if tokens and len(layout) <= TOKEN_GRID_LIMIT:
        lines = token_grid(layout, token_text)
    else:
        if tokens:
            console.print(
                f"({len(layout)} tokens is more than the {TOKEN_GRID_LIMIT} a token grid can show: "
                "one row per shared run of tokens instead)"
            )
        lines = edge_grid(layout, token_text)
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def constraint_lines(roots: list[BranchSpec]) -> list[str]:
    """One line per constraint the branches (children included) answer under, naming them."""
    under: dict[str, list[str]] = {}

    def visit(spec: BranchSpec, path: str) -> None:
        if spec.constraint is not None:
            under.setdefault(spec.constraint.description, []).append(_clip(path))
        for child in spec.children:
            visit(child, f"{path}/{child.label}")

    for root in roots:
        visit(root, root.label)
    return [f"answers under {description}: {', '.join(labels)}" for description, labels in under.items()]


def forest_tree(roots: list[BranchSpec], layout: ForestLayout, token_text: TokenText, *, title: str):
    """A rich Tree: radix edges (shared prefixes, then each branch), follow-ups under their parent."""
    prompt_tokens = sum(len(root.prompt_ids) for root in roots)
    follow_ups = sum(_count(root.children) for root in roots)
    saved = prompt_tokens - len(layout)
    head = (
        f"{title} · {len(roots)} branch{'es' if len(roots) != 1 else ''}"
        + (f" + {follow_ups} follow-up{'s' if follow_ups != 1 else ''}" if follow_ups else "")
        + f" · {prompt_tokens} prompt tokens in {len(layout)} cache slots ({saved} saved by sharing)"
    )
    tree = Tree(head)
    nodes = {}
    for edge in layout.edges:
        holder = tree if edge.parent is None else nodes[edge.parent]
        nodes[edge.id] = holder.add(_edge_label(edge, roots, layout, token_text))
        for prompt in edge.ends:
            node = nodes[edge.id]
            if len(edge.prompts) > 1:
                node = node.add(f"{roots[prompt].label} ends here · answer from pos {edge.depth_range[1] + 1}")
            _add_children(node, roots[prompt], roots[prompt].label, edge.depth_range[1] + 1)
    return tree


def _edge_label(edge: Edge, roots: list[BranchSpec], layout: ForestLayout, token_text: TokenText) -> str:
    low, high = edge.depth_range
    first, last = edge.slot_range
    slots = f"slots {first}–{last}" + ("" if edge.contiguous else " in pieces")
    who = _readers(edge, roots)
    preview = preview_tokens([layout.token_ids[s] for s in edge.slots], token_text)
    return f"{who} · {len(edge.slots)} tok · pos {low}–{high} · {slots} · {preview}"


def _readers(edge: Edge, roots: list[BranchSpec]) -> str:
    """Who reads an edge, short enough for one tree line."""
    labels = [_clip(roots[i].label) for i in edge.prompts]
    if len(labels) == 1:
        return labels[0]
    if len(labels) == 2:
        return f"shared by {labels[0]}, {labels[1]}"
    if len(labels) == len(roots):
        return f"shared by all {len(labels)} branches"
    return f"shared by {len(labels)} branches: {labels[0]}, …"


def _clip(label: str, width: int = 32) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _add_children(node, spec: BranchSpec, path: str, answer_starts: int) -> None:
    for child in spec.children:
        child_path = f"{path}/{child.label}"
        sub = node.add(
            f"↳ {child_path} · forks after {path} finishes · {len(child.prompt_ids)} prompt tok "
            f"after its answer (pos {answer_starts} + answer length on)"
        )
        _add_children(sub, child, child_path, answer_starts)


def _count(children: list[BranchSpec]) -> int:
    return sum(1 + _count(child.children) for child in children)


def preview_tokens(token_ids: list[int], token_text: TokenText, *, count: int = 4, width: int = 28) -> str:
    """The first few tokens as one quoted line (newlines shown as \\n)."""
    text = "".join(token_text(t) for t in token_ids[:count]) + ("…" if len(token_ids) > count else "")
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 2] + "…" + shown[0]


def token_grid(layout: ForestLayout, token_text: TokenText) -> list[str]:
    """The slides' mask picture: a row per query token, a column per key token, ■ where allowed.

    Row labels give the query's slot (physical index), position (RoPE = depth) and text; the
    column headers give each key's slot and position, digits stacked top to bottom."""
    n = len(layout)
    labels = [token_label(token_text(t)) for t in layout.token_ids]
    label_width = max([len("token")] + [len(label) for label in labels])
    lead = f"{'slot':>4} {'pos':>4}  {'token':<{label_width}}  "
    lines = ["Attention mask: row = query token, column = key token; ■ = attends, · = masked"]
    lines += stacked_header("key slot", list(range(n)), len(lead))
    lines += stacked_header("key pos", layout.depth, len(lead))
    lines.append(lead.rstrip())
    for slot, row in enumerate(layout.mask()):
        cells = " ".join(FILLED if allowed else EMPTY for allowed in row)
        lines.append(f"{slot:>4} {layout.depth[slot]:>4}  {labels[slot]:<{label_width}}  {cells}")
    return lines


def token_label(text: str, width: int = 14) -> str:
    """A token quoted, so that spaces show ('▁5' tokens often begin with one)."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 2] + "…" + shown[0]


def stacked_header(name: str, numbers: list[int], lead: int) -> list[str]:
    """Numbers written vertically, one column each (1-cell columns, a space between)."""
    digits = max(len(str(number)) for number in numbers)
    lines = []
    for place in range(digits):
        title = name if place == digits - 1 else ""
        cells = " ".join(str(number).rjust(digits)[place] for number in numbers)
        lines.append(f"{title:>{lead - 2}}  {cells}")
    return lines


def edge_grid(layout: ForestLayout, token_text: TokenText) -> list[str]:
    """The mask compressed to radix edges: ■ every token of the row's run attends to every token
    of the column's run (an ancestor run), ◣ the run's own tokens (causal within it), · none."""
    rows = []
    for edge in layout.edges:
        low, high = edge.depth_range
        first, last = edge.slot_range
        slots = f"{first}–{last}" + ("" if edge.contiguous else " (in pieces)")
        rows.append((f"e{edge.id}", slots, f"{low}–{high}", str(len(edge.slots)),
                     preview_tokens([layout.token_ids[s] for s in edge.slots], token_text)))
    headers = ("run", "slots", "positions", "tokens", "first tokens")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    cell_width = max(3, len(f"e{len(layout.edges) - 1}") + 1)

    def label(values) -> str:
        return "  ".join(value.ljust(width) for value, width in zip(values, widths))

    lines = ["Attention mask by run of shared tokens: row = query run, column = key run",
             f"{FILLED} = attends to the whole run · {TRIANGLE} = its own run, causally · {EMPTY} = masked"]
    lines.append(label(headers) + "  " + "".join(f"e{edge.id}".rjust(cell_width) for edge in layout.edges))
    for edge, values in zip(layout.edges, rows):
        cells = "".join(edge_cell(layout, edge.id, key.id).rjust(cell_width) for key in layout.edges)
        lines.append(label(values) + "  " + cells)
    return lines


def edge_cell(layout: ForestLayout, query: int, key: int) -> str:
    if key == query:
        return TRIANGLE
    return FILLED if key in layout.edge_ancestors(query) else EMPTY
