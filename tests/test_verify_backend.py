"""The shared verification backend: packed/tree/batched compilation and the generic walk."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spiffy.verify import DraftStructure, compile_batched, compile_packed, compile_tree, follow, tree_ancestor_mask


@st.composite
def trees(draw):
    n = draw(st.integers(min_value=0, max_value=24))
    parents = [draw(st.integers(min_value=-1, max_value=i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return tokens, parents


def _brute_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


@given(trees(), st.integers(min_value=0, max_value=5))
@settings(max_examples=60, deadline=None)
def test_compile_tree_equals_compile_packed_and_ancestor_visibility(tree, ctx):
    tokens, parents = tree
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    tok = torch.tensor(tokens, dtype=torch.long)
    pos = torch.tensor(depths, dtype=torch.long) + 7
    par = torch.tensor(parents, dtype=torch.long)
    root = (torch.tensor([3]), torch.tensor([7]))
    fast = compile_tree(tok, pos, par, context_len=ctx, dtype=torch.float64, prefix_rows=root)
    slow = compile_packed(
        DraftStructure(
            tokens=[t.view(1) for t in tok],
            positions=[p.view(1) for p in pos],
            parents=[(p,) if p >= 0 else () for p in parents],
            visibility="ancestors",
        ),
        context_len=ctx,
        dtype=torch.float64,
        prefix_rows=root,
    )
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert torch.equal(fast.position_ids, slow.position_ids)
    assert torch.equal(fast.attention_mask, slow.attention_mask)
    assert fast.row_offsets == slow.row_offsets
    visible = fast.attention_mask[0, 0] == 0
    n = len(tokens)
    assert bool(visible[:, :ctx].all())  # the committed context is visible to every row
    assert bool(visible[0, ctx + 1 :].logical_not().all())  # the root never sees draft rows
    assert torch.equal(visible[1:, ctx + 1 :], _brute_ancestors(parents)) if n else True
    assert torch.equal(tree_ancestor_mask(par), _brute_ancestors(parents))
    depth = [0] * n  # the known-depth walk (no host sync per level) gives the same mask, and so does compile_tree
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert torch.equal(tree_ancestor_mask(par, max(depth, default=0)), _brute_ancestors(parents))
    known = compile_tree(tok, pos, par, context_len=ctx, dtype=torch.float64, prefix_rows=root, max_depth=max(depth, default=0))
    assert torch.equal(known.attention_mask, fast.attention_mask)


def test_self_visibility_spans_never_see_each_other():
    s = DraftStructure(
        tokens=[torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
        positions=[torch.tensor([10, 11, 12]), torch.tensor([10, 11])],
        parents=[(), (0,)],
        visibility="self",
    )
    c = compile_packed(s, context_len=2, dtype=torch.float32, prefix_rows=(torch.tensor([9]), torch.tensor([9])))
    vis = c.attention_mask[0, 0] == 0
    assert c.row_offsets == [0, 1, 4, 6]
    assert c.input_ids.tolist() == [[9, 1, 2, 3, 4, 5]]
    # real row sees context + itself only; each span sees context + itself only
    assert vis[0].tolist() == [True, True, True, False, False, False, False, False]
    assert vis[1:4, 3:6].all() and not vis[1:4, 6:].any() and not vis[1:4, 2].any()
    assert vis[4:6, 6:8].all() and not vis[4:6, 2:6].any()


def test_compile_batched_layout_and_errors():
    s = DraftStructure(tokens=[torch.tensor([1, 2]), torch.tensor([3, 4])], positions=[torch.tensor([5, 6])] * 2)
    c = compile_batched(s, context_len=3)
    assert c.input_ids.tolist() == [[1, 2], [3, 4]]
    assert c.attention_mask.shape == (2, 1, 2, 5) and bool((c.attention_mask == 0).all())
    assert c.node_rows(1) == 1
    bad = DraftStructure(tokens=[torch.tensor([1]), torch.tensor([3, 4])], positions=[torch.tensor([5]), torch.tensor([5, 6])])
    try:
        compile_batched(bad, context_len=0)
    except ValueError as exc:
        assert "equal-length" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("unequal spans must be rejected")


def test_structure_rejects_parent_after_child():
    try:
        DraftStructure(tokens=[torch.tensor([1]), torch.tensor([2])], positions=[torch.tensor([0])] * 2, parents=[(1,), ()])
    except ValueError as exc:
        assert "precede" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a parent after its child must be rejected")


def test_follow_walks_until_no_child_matches():
    # tree: root -> a(5) -> b(7); root -> c(6)
    children = {(-1, 5): "a", ("a", 7): "b", (-1, 6): "c"}
    target = {-1: 5, "a": 7, "b": 9, "c": 1}
    accepted, final = follow(-1, lambda n: target[n], lambda n, s: children.get((n, s)))
    assert accepted == ["a", "b"] and final == 9
    accepted, final = follow(-1, lambda n: 8, lambda n, s: children.get((n, s)))
    assert accepted == [] and final == 8
