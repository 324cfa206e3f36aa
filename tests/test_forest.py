"""The forest invariants, as properties: every new token sees exactly its ancestors and itself,
and its position is its depth. Checked on the pure layout function, with no model involved."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdcli.core.forest import Forest, layout_chains, pad_rows
from mdcli.prefixes import common_prefix_length, trie_size


def grow(forest: Forest, plan: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
    """Apply rounds of (hang-off index, chain length); return the row of every node ever made.

    Hang-off index -1 means a new root; otherwise it picks an existing node (modulo count).
    """
    rows: list[torch.Tensor] = []
    for round_ in plan:
        n = len(forest)
        parent_rows = []
        for hang, _ in round_:
            if hang < 0 or n == 0:
                parent_rows.append(torch.zeros(n, dtype=torch.bool))
            else:
                parent_rows.append(pad_rows(rows[hang % n][None], n)[0])
        lengths = [length for _, length in round_]
        layout = layout_chains(torch.stack(parent_rows), lengths, n)
        forest.append(torch.zeros(sum(lengths), dtype=torch.long), layout.positions, layout.parents)
        rows.extend(layout.allowed)  # row of each new token, in slot order
    return rows


plans = st.lists(
    st.lists(st.tuples(st.integers(-1, 50), st.integers(1, 4)), min_size=1, max_size=5), min_size=1, max_size=6
)


@given(plans)
@settings(max_examples=150, deadline=None)
def test_every_token_sees_exactly_its_ancestors_and_itself(plan):
    forest = Forest()
    rows = grow(forest, plan)
    for node, row in enumerate(rows):
        expected = torch.zeros(row.shape[0], dtype=torch.bool)
        expected[forest.ancestors(node)] = True
        assert torch.equal(row, expected), f"node {node}"


@given(plans)
@settings(max_examples=150, deadline=None)
def test_every_position_equals_the_depth_in_its_tree(plan):
    forest = Forest()
    grow(forest, plan)
    for node in range(len(forest)):
        assert int(forest.depth[node]) == len(forest.ancestors(node)) - 1


@given(plans, st.data())
@settings(max_examples=100, deadline=None)
def test_compaction_keeps_paths_and_depths_of_kept_rows(plan, data):
    forest = Forest()
    rows = grow(forest, plan)
    n = len(forest)
    live = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4, unique=True))
    live_rows = torch.stack([pad_rows(rows[i][None], n)[0] for i in live])
    paths_before = [forest.tokens.new_tensor(forest.ancestors(i)).tolist() for i in live]
    depths_before = [int(forest.depth[i]) for i in live]

    keep = live_rows.any(0).nonzero().flatten()
    forest.compact(keep)
    remapped = live_rows[:, keep]

    for row, path, depth in zip(remapped, paths_before, depths_before):
        tip = int(row.nonzero().max())
        assert len(forest.ancestors(tip)) == len(path)
        assert int(forest.depth[tip]) == depth
        expected = torch.zeros(len(forest), dtype=torch.bool)
        expected[forest.ancestors(tip)] = True
        assert torch.equal(row, expected)


@given(plans, st.lists(st.integers(0, 10_000), min_size=1, max_size=9))
@settings(max_examples=100, deadline=None)
def test_a_decode_step_lays_out_one_token_per_chain_as_the_general_layout_does(plan, picks):
    forest = Forest()
    rows = grow(forest, plan)
    n = len(forest)
    tips = torch.stack([pad_rows(rows[p % len(rows)][None], n)[0] for p in picks])
    quick = layout_chains(tips, [1] * len(picks), n)  # the decode step's few ops
    general = layout_chains(tips, [1] * len(picks), n, start_depths=tips.sum(-1))  # the general path
    for field in ("positions", "parents", "allowed", "ends"):
        assert torch.equal(getattr(quick, field), getattr(general, field)), field


def test_a_chain_hanging_off_a_node_starts_one_deeper_than_it():
    forest = Forest()
    trunk = layout_chains(torch.zeros(1, 0, dtype=torch.bool), [5], 0)
    forest.append(torch.arange(5), trunk.positions, trunk.parents)
    tip_row = trunk.allowed[trunk.ends[0]]
    branches = layout_chains(torch.stack([tip_row, tip_row]), [2, 3], 5)
    assert branches.positions.tolist() == [5, 6, 5, 6, 7]
    assert branches.parents.tolist() == [4, 5, 4, 7, 8]
    # the second chain never sees the first
    assert not branches.allowed[2:, 5:7].any()


@given(st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=6))
@settings(max_examples=200, deadline=None)
def test_a_trie_holds_each_distinct_prefix_once(prompts):
    # mdcli.prefixes.trie_size: what a radix prefill of the prompts feeds, each shared leading run once
    distinct = {tuple(prompt[: end + 1]) for prompt in prompts for end in range(len(prompt))}
    assert trie_size(prompts) == len(distinct)
    for a in prompts:
        for b in prompts:
            shared = common_prefix_length(a, b)
            assert a[:shared] == b[:shared] and (shared == min(len(a), len(b)) or a[shared] != b[shared])
