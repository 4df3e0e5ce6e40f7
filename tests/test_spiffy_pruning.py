"""Dynamic pruning of draft graphs (spiffy.selfspec.pruning)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import rank_state
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.oracle import random_formulas
from spiffy.selfspec.config import SpiffyConfig
from spiffy.selfspec.pruning import (
    DEFAULT_BUDGET, REACH_FREQUENCY_EXPONENT, SCORES, is_parent_closed, node_scores, prune, resolve_score,
)

MASK = 50


def _ranking_from_probs(probs: list[list[float]]):
    """A ranking whose (i, j) probabilities are exactly ``probs`` (rows already in rank order, tokens sorted)."""
    logits = torch.tensor(probs, dtype=torch.float64).log()
    x = torch.full((len(probs),), MASK)
    r = rank_state(logits, x, 0, len(probs), 0, len(probs), len(probs[0]), mask_id=MASK)
    assert r.rows.tolist() == list(range(len(probs)))  # the construction keeps the given order
    return r


# p[i-1][j-1]: position 1 most confident, token ranks descending
PROBS = [[0.8, 0.15, 0.05], [0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]
A, B, C, D, E = ((1, 1),), ((2, 1),), ((1, 1), (2, 1)), ((1, 1), (3, 2)), ((1, 1), (2, 1), (3, 1))


def _hand_graph() -> DraftGraph:
    return DraftGraph.from_formulas([(1, A), (1, B), (2, C), (2, D), (3, E)])


def _ids(graph: DraftGraph) -> dict[tuple, int]:
    return {n.pairs: n.id for n in graph.nodes}


def test_gm_score_hand_computed() -> None:
    g = _hand_graph()
    ids = _ids(g)
    r = _ranking_from_probs(PROBS)
    s = node_scores(g, r, "gm")
    p11, p21, p32, p31 = 0.8, 0.5, 0.35, 0.4
    e = (p11 * p21 * p31) ** (1 / 3)  # leaf: local only
    c = math.sqrt(math.sqrt(p11 * p21) * e)  # GM(local, mean of children = E)
    d = math.sqrt(p11 * p32)  # leaf
    a = math.sqrt(p11 * ((c + d) / 2))  # children C and D
    b = math.sqrt(p21 * c)  # child C
    for pairs, want in ((A, a), (B, b), (C, c), (D, d), (E, e)):
        assert s[ids[pairs]] == pytest.approx(want, rel=1e-12)
    assert prune(g, r, 1) == [ids[A]]
    # A (0.668) first; then C (0.586) over B (0.541) and D (0.529); then E (0.543, now eligible) over B
    assert a > c > e > b > d
    assert prune(g, r, 3) == [ids[A], ids[C], ids[E]]
    assert prune(g, r, 5) == [ids[A], ids[C], ids[E], ids[B], ids[D]]


def test_product_local_count_scores() -> None:
    g = DraftGraph.from_formulas([(1, A), (1, B), (2, C), (2, D), (3, E)], counts=[1, 9, 3, 2, 7])
    ids = _ids(g)
    r = _ranking_from_probs(PROBS)
    prod = node_scores(g, r, "product")
    assert prod[ids[D]] == pytest.approx(0.8 * 0.35)
    loc = node_scores(g, r, "local")
    assert loc[ids[E]] == pytest.approx((0.8 * 0.5 * 0.4) ** (1 / 3))
    cnt = node_scores(g, r, "count")
    assert cnt[ids[B]] == 9.0
    # count: B (9) first; E (7) is not eligible until C (3) is kept
    assert prune(g, r, 3, score="count") == [ids[B], ids[C], ids[E]]


def test_reach_score_hand_computed() -> None:
    """reach = product of the pairs' probabilities x (count / max count) ** 1/4: a frequent deep chain node beats
    a rare shallow branch even when the branch's tokens look as certain, which gm gets the other way round."""
    assert REACH_FREQUENCY_EXPONENT == 0.25
    certain = [[1.0, 0.0, 0.0]] * 3  # every top-1 token certain: the situation of an end-of-text run
    g = DraftGraph.from_formulas([(1, A), (1, B), (2, C), (3, E)], counts=[100, 2, 90, 81])
    ids = _ids(g)
    r = _ranking_from_probs([[v if v > 0 else 1e-12 for v in row] for row in certain])
    reach = node_scores(g, r, "reach")
    assert reach[ids[E]] == pytest.approx(0.81 ** 0.25, rel=1e-9)
    assert reach[ids[B]] == pytest.approx(0.02 ** 0.25, rel=1e-9)
    assert prune(g, r, 3, score="reach") == [ids[A], ids[C], ids[E]]  # the chain, depth 3
    assert ids[B] in prune(g, r, 3, score="gm")  # gm: B's local 1.0 ties the chain's, the lower level wins
    # with real probabilities the product decides between nodes of similar frequency
    g2 = DraftGraph.from_formulas([(1, A), (1, B), (2, C), (2, D), (3, E)], counts=[100, 20, 50, 50, 40])
    ids2 = _ids(g2)
    r2 = _ranking_from_probs(PROBS)
    s2 = node_scores(g2, r2, "reach")
    assert s2[ids2[D]] == pytest.approx(0.8 * 0.35 * 0.5 ** 0.25)
    assert s2[ids2[E]] == pytest.approx(0.8 * 0.5 * 0.4 * 0.4 ** 0.25)
    # uncalibrated graphs (all counts 0): the product alone
    g3 = DraftGraph.from_formulas([(1, A), (2, C)])
    assert node_scores(g3, r2, "reach")[_ids(g3)[C]] == pytest.approx(0.8 * 0.5)


def test_resolve_score_prefers_argument_then_graph_then_gm() -> None:
    g = DraftGraph.from_formulas([(1, A)], meta={"calibrated_for": {}, "calibration": {"score": "reach"}})
    assert g.pruning_score == "reach"
    assert resolve_score(None, g) == "reach"
    assert resolve_score("count", g) == "count"
    assert resolve_score(None, _hand_graph()) == "gm"
    assert resolve_score(None, None) == "gm"
    with pytest.raises(ConfigError, match="unknown pruning score 'nope'"):
        resolve_score("nope", g)
    bad = DraftGraph.from_formulas([(1, A)], meta={"calibrated_for": {}, "calibration": {"score": "nope"}})
    with pytest.raises(ConfigError, match="use one of"):
        resolve_score(None, bad)
    # the score travels through the file
    again = DraftGraph.from_json_dict(g.to_json_dict())
    assert again.pruning_score == "reach"


def test_unavailable_nodes_never_kept() -> None:
    g = _hand_graph()
    ids = _ids(g)
    r = _ranking_from_probs([[0.8, 0.2], [0.6, 0.4]])  # only 2 positions, 2 tokens: D (3,2) and E (3,1) unavailable
    kept = prune(g, r, 10)
    assert set(kept) == {ids[A], ids[B], ids[C]}
    assert ids[D] not in node_scores(g, r)


def test_budget_errors_and_zero() -> None:
    """A budget is validated once, where it enters (SpiffyConfig); prune, run at every step, keeps nothing at 0."""
    g = _hand_graph()
    r = _ranking_from_probs(PROBS)
    assert prune(g, r, 0) == []
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="budget"):
            SpiffyConfig(g, bad)
    with pytest.raises(ConfigError, match="score"):
        SpiffyConfig(g, 2, "nope")
    with pytest.raises(ConfigError, match="score"):
        prune(g, r, 2, score="nope")
    settings = SpiffyConfig(g)  # resolved once: the graph's tuned D* (none here: the default) and score
    assert (settings.budget, settings.score) == (DEFAULT_BUDGET, "gm") and settings.uses_drafts
    assert SpiffyConfig.of(settings) is settings and SpiffyConfig.of(settings, 0).budget == 0
    assert not SpiffyConfig(g, 0).uses_drafts and not SpiffyConfig(None, 3).uses_drafts
    assert set(SCORES) >= {"gm", "product", "count"}


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    levels=st.integers(1, 4),
    nodes=st.integers(1, 25),
    budget=st.integers(0, 30),
    score=st.sampled_from(SCORES),
    n_masked=st.integers(1, 6),
)
def test_parent_closure_property(seed: int, levels: int, nodes: int, budget: int, score: str, n_masked: int) -> None:
    g = DraftGraph.from_formulas(random_formulas(levels, nodes, seed, i_max=6, j_max=3))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_masked, 5, generator=gen, dtype=torch.float64)
    r = rank_state(logits, torch.full((n_masked,), MASK), 0, n_masked, 0, 6, 3, mask_id=MASK)
    kept = prune(g, r, budget, score=score)
    assert len(kept) == len(set(kept)) <= budget
    assert is_parent_closed(g, kept)
    scores = node_scores(g, r, score)
    assert all(k in scores for k in kept)  # only instantiable nodes
    # maximality: if fewer than budget were kept, no eligible scorable node was left out
    if len(kept) < budget:
        ks = set(kept)
        for n in g.nodes:
            if n.id in scores and n.id not in ks:
                assert n.level > 1 and not any(p in ks for p in n.parents)
    # the first pick is the best level-1 node
    if kept:
        lvl1 = [n.id for n in g.nodes if n.level == 1 and n.id in scores]
        best = max(scores[i] for i in lvl1)
        assert scores[kept[0]] == best
    assert prune(g, r, budget, score=score) == kept  # deterministic
