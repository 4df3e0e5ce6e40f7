"""Ranking and instantiation of (i, j) formulas (spiffy.selfspec.formulas)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spiffy.decoding.session import TransitionProbs
from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import instantiate, instantiate_many, pair_probs, rank_state, window_covers

MASK = 99


def _reference_ranking(logits: torch.Tensor, x: torch.Tensor, bs: int, be: int, ws: int, i_max: int, j_max: int):
    """Plain-Python statement of the ranking rule (sorted() with explicit tie keys)."""
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    masked = [r for r in range(bs, be) if int(x[r]) == MASK]
    top1 = {r: max(probs[r - ws]) for r in masked}
    rows = sorted(masked, key=lambda r: (-top1[r], r))[:i_max]
    toks = []
    for r in rows:
        p = probs[r - ws]
        toks.append(sorted(range(len(p)), key=lambda t: (-p[t], t))[:j_max])
    return rows, toks


def test_rank_order_and_ties_by_hand() -> None:
    # window rows 2..7, block rows 2..6; rows 3 and 5 are masked with identical distributions (tie -> row 3 first)
    logits = torch.full((6, 5), -5.0, dtype=torch.float64)
    logits[1] = torch.tensor([0.0, 2.0, 2.0, -1.0, 0.0], dtype=torch.float64)  # row 3: tokens 1 and 2 tie
    logits[3] = logits[1].clone()  # row 5: same distribution as row 3
    logits[2] = torch.tensor([4.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # row 4: most confident
    x = torch.tensor([7, 7, 7, MASK, MASK, MASK, 7, MASK])  # row 7 is masked but outside the block
    r = rank_state(logits, x, 2, 7, 2, 10, 3, mask_id=MASK)
    assert r.rows.tolist() == [4, 3, 5]
    assert r.num_masked == 3
    assert r.token_ids.tolist() == [[0, 1, 2], [1, 2, 0], [1, 2, 0]]  # tokens 0 and 4 tie at rank 3 -> id 0
    p = torch.softmax(logits[2], -1)
    assert r.token_probs[0, 0].item() == pytest.approx(p[0].item())


def test_caps_and_tie_across_boundary() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([MASK])
    r = rank_state(logits, x, 0, 1, 0, 1, 2, mask_id=MASK)
    assert r.token_ids.tolist() == [[1, 2]]  # three-way tie: the two lowest ids
    assert r.num_tokens == 2 and r.num_positions == 1
    assert r.available((1, 2)) and not r.available((1, 3)) and not r.available((2, 1))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    w=st.integers(1, 6),
    v=st.integers(1, 6),
    i_max=st.integers(1, 7),
    j_max=st.integers(1, 7),
)
def test_rank_matches_reference(data, w: int, v: int, i_max: int, j_max: int) -> None:
    # small integer logits make ties frequent
    vals = data.draw(st.lists(st.integers(-2, 2), min_size=w * v, max_size=w * v))
    logits = torch.tensor(vals, dtype=torch.float64).view(w, v)
    ws = data.draw(st.integers(0, 2))
    mask_bits = data.draw(st.lists(st.booleans(), min_size=w, max_size=w))
    t = ws + w + 1
    x = torch.zeros(t, dtype=torch.long)
    for k, b in enumerate(mask_bits):
        if b:
            x[ws + k] = MASK
    bs = data.draw(st.integers(ws, ws + w - 1))
    be = data.draw(st.integers(bs + 1, ws + w))
    r = rank_state(logits, x, bs, be, ws, i_max, j_max, mask_id=MASK)
    rows, toks = _reference_ranking(logits, x, bs, be, ws, i_max, j_max)
    assert r.rows.tolist() == rows
    assert r.token_ids.tolist() == toks if rows else r.token_ids.shape[0] == 0
    assert r.token_ids.shape == (len(rows), min(j_max, v))


def test_float32_logits_and_batch_dims() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 9)
    x = torch.tensor([[MASK] * 4])
    r = rank_state(logits, x, 0, 4, 0, 4, 3, mask_id=MASK)
    r64 = rank_state(logits.double(), x, 0, 4, 0, 4, 3, mask_id=MASK)
    assert r.token_probs.dtype == torch.float32
    assert r.rows.tolist() == r64.rows.tolist()


def test_window_must_cover_block() -> None:
    logits = torch.zeros(4, 3, dtype=torch.float64)
    x = torch.full((10,), MASK)
    assert window_covers(2, 4, 2, 6) and not window_covers(3, 4, 2, 6)
    with pytest.raises(ConfigError, match="does not cover"):
        rank_state(logits, x, 2, 7, 2, 3, 3, mask_id=MASK)
    with pytest.raises(ConfigError, match="i_max"):
        rank_state(logits, x, 2, 6, 2, 0, 3, mask_id=MASK)


def test_instantiate_and_pair_probs() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[1, MASK, MASK, 2]])
    r = rank_state(logits, x, 1, 3, 1, 5, 3, mask_id=MASK)
    assert r.rows.tolist() == [2, 1]
    y = instantiate(x, ((1, 1), (2, 3)), r)
    assert y is not None and y.shape == x.shape
    assert y.tolist() == [[1, 0, 0, 2]]  # row 2 <- its argmax 0; row 1 <- its 3rd token 0
    assert instantiate(x, ((3, 1),), r) is None
    assert instantiate(x, ((1, 4),), r) is None
    assert x.tolist() == [[1, MASK, MASK, 2]]  # untouched
    p = torch.softmax(logits, -1)
    probs = pair_probs(((1, 1), (2, 2)), r)
    assert probs is not None
    assert probs[0] == pytest.approx(p[1, 0].item()) and probs[1] == pytest.approx(p[0, 1].item())
    assert pair_probs(((2, 1), (3, 1)), r) is None
    assert math.isclose(sum(pair_probs(((1, j),), r)[0] for j in (1, 2, 3)), 1.0)


def test_instantiate_many_matches_single() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 11, dtype=torch.float64)
    x = torch.tensor([[3, 4] + [MASK] * 6])
    r = rank_state(logits, x, 2, 8, 2, 4, 3, mask_id=MASK)
    formulas = [((1, 1),), ((5, 1),), ((1, 2), (2, 1)), ((1, 1), (3, 3), (4, 2)), ()]
    states, index = instantiate_many(x, formulas, r)
    assert index == [0, -1, 1, 2, 3]
    for f, k in zip(formulas, index):
        single = instantiate(x, f, r)
        if k < 0:
            assert single is None
        else:
            assert torch.equal(states[k], single[0])
    assert instantiate_many(x, [], r) is None


def _rank_inputs(seed: int):
    """A random ranking problem with exact ties: quantised logits (equal rows and equal tokens), a random mask and
    block, and every form of published probabilities a session hands over."""
    g = torch.Generator().manual_seed(seed)
    v = int(torch.randint(3, 700, (1,), generator=g))
    w = int(torch.randint(4, 24, (1,), generator=g))
    dtype = (torch.float32, torch.float64, torch.bfloat16)[seed % 3]
    logits = (torch.randint(0, 4, (w, v), generator=g).to(torch.float64) * 0.5).to(dtype)
    logits[torch.randint(0, w, (2,), generator=g)] = logits[0].clone()  # identical rows: position ties
    ws = int(torch.randint(0, 3, (1,), generator=g))
    bs = ws + int(torch.randint(0, 2, (1,), generator=g))
    be = int(torch.randint(bs, ws + w + 1, (1,), generator=g))
    x = torch.randint(0, MASK, (ws + w + 2,), generator=g)
    x[torch.rand(x.shape, generator=g) < (0.2, 0.7, 1.0)[seed % 3]] = MASK
    probs = torch.softmax(logits.to(torch.float32 if dtype != torch.float64 else dtype), dim=-1)
    conf = torch.where(x[ws : ws + w] == MASK, probs.amax(dim=-1), -torch.inf).to(dtype)  # [W] the rule's frame
    pad = int(torch.randint(0, 3, (1,), generator=g))  # the frame may start before the window
    selection = torch.cat([torch.full((pad,), -torch.inf, dtype=dtype), conf])
    forms = [None, probs, TransitionProbs(probs=probs, top1=probs.amax(dim=-1)[None]),
             TransitionProbs(selection=selection[None], selection_start=ws - pad),
             TransitionProbs(probs=probs, selection=selection[None], selection_start=ws - pad)]
    return logits, x, bs, be, ws, forms, g


@pytest.mark.parametrize("seed", range(24))
def test_static_ranking_equals_the_host_ranking(seed: int) -> None:
    """The sync-free ranking (static shapes, one host read) is the host ranking: rows, tokens, probabilities, the
    masked count and the host tables, for every published form, position ties, token ties and an empty block."""
    logits, x, bs, be, ws, forms, g = _rank_inputs(seed)
    for probs in forms:
        for i_max, j_max in ((1, 1), (3, 2), (40, 5), (int(torch.randint(1, 9, (1,), generator=g)), 900)):
            host = rank_state(logits, x, bs, be, ws, i_max, j_max, mask_id=MASK, probs=probs, sync_free=False)
            static = rank_state(logits, x, bs, be, ws, i_max, j_max, mask_id=MASK, probs=probs, sync_free=True)
            where = (seed, type(probs).__name__, i_max, j_max)
            assert static.num_masked == host.num_masked and static.num_positions == host.num_positions, where
            assert torch.equal(static.rows, host.rows) and torch.equal(static.token_ids, host.token_ids), where
            if host.num_positions:
                assert torch.equal(static.token_probs, host.token_probs), where
            assert static.probs_list() == host.probs_list() and static.ids_list() == host.ids_list(), where
            assert host.ids_list() == host.token_ids.tolist()
