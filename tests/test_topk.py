"""spiffy.topk.top_ranked / top_ranked_static: the top k of every row, value descending then column ascending, on
both paths (streaming with host reads, and static shapes)."""

from __future__ import annotations

import pytest
import torch

from spiffy.topk import top_ranked, top_ranked_static


def _oracle(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, cols = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[:, :k], cols[:, :k]


@pytest.mark.parametrize("width", [1, 7, 100, 1000, 4099, 20000])
def test_top_ranked_equals_stable_sort_with_ties_and_infinities(width):
    g = torch.Generator().manual_seed(width)
    for k in (1, 2, 3, 16, 64, 257):
        if k > width:
            continue
        tied = torch.randint(0, 30, (5, width), generator=g).float()  # many exact ties, at the cut too
        spread = torch.randn(5, width, generator=g, dtype=torch.float64)
        spread[0, ::3] = float("-inf")
        spread[1] = float("-inf")  # a row with nothing finite: every entry ties
        clustered = torch.zeros(5, width)  # the k-th value tied across many chunks, above-k entries in a later one
        clustered[:, -min(width, 3):] = 1.0
        for scores in (tied, spread, clustered):
            want_vals, want_cols = _oracle(scores, k)
            for top in (top_ranked, top_ranked_static):
                vals, cols = top(scores, k)
                assert vals.dtype == scores.dtype and cols.dtype == torch.long
                assert torch.equal(vals, want_vals) and torch.equal(cols, want_cols), (top.__name__, width, k)


@pytest.mark.parametrize("top", [top_ranked, top_ranked_static])
def test_top_ranked_edges(top):
    x = torch.randn(3, 50)
    v, c = top(x, 0)
    assert v.shape == (3, 0) and c.shape == (3, 0)
    v, c = top(x[:0], 4)
    assert v.shape == (0, 4)
    with pytest.raises(ValueError, match="k must be"):
        top(x, 51)
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        top(x[0], 1)
