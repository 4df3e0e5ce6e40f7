"""Trajectory -> formula chains, graph selection objectives, and projected savings (hand-built inputs)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiffy.decoding.session import StepInfo, StepRecord
from spiffy.errors import ConfigError
from spiffy.selfspec.chains import Chain, Trajectory, count_formulas, extract_chains
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.select import (
    build_graph,
    candidate_parents,
    formula_counts,
    is_closed,
    objective_value,
    project,
    select_formulas,
    weighted_chains,
)

# ------------------------------------------------------------------------------------------ hand-built trajectory
V, MASK, P_LEN, BL = 6, 5, 1, 4  # vocabulary, mask id, prompt rows, block length; 2 blocks -> T = 9
T = P_LEN + 2 * BL


def dist(order: list[int], top: float) -> list[float]:
    """A distribution over V tokens: ``order[0]`` gets ``top``, the rest share ``1 - top`` decreasingly."""
    rest = order[1:]
    weights = list(range(len(rest), 0, -1))
    p = [1e-6] * V
    p[order[0]] = top
    for tok, w in zip(rest, weights):
        p[tok] = (1.0 - top) * w / sum(weights)
    return p


GENERIC = dist([0, 1, 2, 3, 4], 0.4)  # token k has rank k + 1


def logits(rows: dict[int, list[float]]) -> torch.Tensor:
    """``[1, T, V]`` log-probabilities; unspecified rows get GENERIC."""
    table = [rows.get(r, GENERIC) for r in range(T)]
    return torch.tensor(table, dtype=torch.float64).log().unsqueeze(0)


L0 = logits({1: dist([2, 0, 1, 3, 4], 0.5), 2: dist([3, 0, 1, 2, 4], 0.9), 3: dist([2, 1, 0, 3, 4], 0.3), 4: dist([1, 0, 2, 3, 4], 0.6)})
TIE = [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]  # tokens 0 and 1 tie (lower id first); rows 3 and 4 tie (lower row first)
L1 = logits({3: TIE, 4: TIE})
L2 = logits({})
L3 = logits({5: dist([0, 1, 2, 3, 4], 0.4), 6: dist([3, 4, 0, 1, 2], 0.35), 7: dist([1, 0, 2, 3, 4], 0.8), 8: dist([2, 0, 1, 3, 4], 0.5)})
L4 = L5 = L6 = L7 = logits({})
LOGITS = [L0, L1, L2, L3, L4, L5, L6, L7]
# (row, token) unmasked at each step: block 0 = steps 0-3, block 1 = steps 4-7
UNMASK = [(2, 3), (1, 0), (4, 1), (3, 2), (6, 4), (5, 0), (8, 2), (7, 1)]


def trajectory(window: str = "full", rewrite_at: int | None = None) -> list[StepRecord]:
    x = torch.full((1, T), MASK, dtype=torch.long)
    x[0, 0] = 0
    records = []
    for n, (row, tok) in enumerate(UNMASK):
        block, step = divmod(n, BL)
        bs = P_LEN + block * BL
        x_next = x.clone()
        x_next[0, row] = tok
        if rewrite_at == n:
            x_next[0, 2] = 4  # rewrites a token decoded at step 0 (no baseline does this)
        lg = LOGITS[n]
        ws = 0
        if window == "block":  # block-causal / dual cache: the logits cover the current block only
            lg, ws = lg[:, bs : bs + BL], bs
        info = StepInfo(block=block, block_start=bs, block_end=bs + BL, step=step, window_start=ws)
        records.append(StepRecord(info=info, x_before=x, logits=lg, x_after=x_next))
        x = x_next
    return records


def chains_of(traj: Trajectory) -> dict[int, tuple]:
    return {n: c.formulas for n, c in traj.chains.items()}


def test_chain_extraction_by_hand() -> None:
    traj = extract_chains(trajectory(), mask_id=MASK, i_max=4, j_max=3, nfe=8)
    assert traj.num_steps == 8 and traj.nfe == 8 and traj.blocks == [0, 0, 0, 0, 1, 1, 1, 1]
    got = chains_of(traj)
    assert 0 not in got  # first step of the generation: no previous distribution
    # step 1: P = L0, masked {1,3,4} ranked row4 (0.6) i=1, row1 (0.5) i=2, row3 (0.3) i=3.
    #   step 1 unmasks row1 token0 (rank 2 in [2,0,...]) -> (2,2); step 2 row4 token1 (rank 1) -> (1,1);
    #   step 3 produces the block's final state, which no step follows: not a useful draft.
    assert got[1] == (((2, 2),), ((1, 1), (2, 2)))
    # step 2: P = L1, rows 3 and 4 tie (row 3 first); tokens 0 and 1 tie (token 0 first): row4 token1 = (2, 2)
    #   (level 2 would be x_4, the block's final state)
    assert got[2] == (((2, 2),),)
    assert got[3] == ()  # its only future state is the block's final state
    # step 4 (block 1, step 0): L3's window covers block 1: rows 7 (0.8), 8 (0.5), 5 (0.4), 6 (0.35)
    #   step 4 row6 token4 (rank 2) -> (4,2); step 5 row5 token0 -> (3,1); step 6 row8 token2 -> (2,1)
    assert got[4] == (((4, 2),), ((3, 1), (4, 2)), ((2, 1), (3, 1), (4, 2)))
    # steps 5, 6 under GENERIC (all rows tie -> row order; token k has rank k+1)
    assert got[5] == (((1, 1),), ((1, 1), (3, 3)))
    assert got[6] == (((2, 3),),)
    assert got[7] == ()
    counts = count_formulas(traj.chain_list())
    assert counts[(1, ((2, 2),))] == 2 and counts[(2, ((1, 1), (2, 2)))] == 1


def test_chain_caps_levels_refresh_and_windows() -> None:
    capped = chains_of(extract_chains(trajectory(), mask_id=MASK, i_max=3, j_max=3))
    assert capped[4] == ()  # row 6 has position rank 4 > i_max
    assert capped[1] == (((2, 2),), ((1, 1), (2, 2)))
    jcap = chains_of(extract_chains(trajectory(), mask_id=MASK, i_max=4, j_max=1))
    assert jcap[1] == ()  # token rank 2 > j_max
    assert jcap[4] == ()
    short = chains_of(extract_chains(trajectory(), mask_id=MASK, i_max=4, j_max=3, max_level=2))
    assert short[4] == (((4, 2),), ((3, 1), (4, 2)))
    refreshed = chains_of(extract_chains(trajectory(), mask_id=MASK, i_max=4, j_max=3, refreshed_blocks=[1]))
    assert 4 not in refreshed and 5 in refreshed  # a block-start refresh forward carries no drafts
    per_block = chains_of(extract_chains(trajectory("block"), mask_id=MASK, i_max=4, j_max=3))
    assert 4 not in per_block  # the previous window (block 0) does not cover block 1
    assert per_block[1] == (((2, 2),), ((1, 1), (2, 2)))
    rewritten = chains_of(extract_chains(trajectory(rewrite_at=5), mask_id=MASK, i_max=4, j_max=3))
    assert rewritten[4] == (((4, 2),),)  # the step that rewrites a decoded token ends the chain
    with pytest.raises(ConfigError):
        extract_chains(trajectory(), mask_id=MASK, i_max=0, j_max=3)


# ------------------------------------------------------------------------------------------ selection
def brute_force(wc, nodes: int, tps: int | None = None) -> int:  # noqa: ANN001
    keys = sorted(formula_counts(wc))
    best = 0
    for k in range(0, min(nodes, len(keys)) + 1):
        for sub in itertools.combinations(keys, k):
            if is_closed(sub, tps):
                best = max(best, objective_value(sub, wc))
    return best


@st.composite
def tree_chains(draw):  # noqa: ANN001, ANN201
    """Chains whose pair at depth k has position rank k: every candidate has exactly one candidate parent."""
    chains = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=6))
    out = []
    for js in chains:
        pairs = [(k + 1, j) for k, j in enumerate(js)]
        out.append([tuple(sorted(pairs[: lvl + 1])) for lvl in range(len(pairs))])
    return out


@st.composite
def dag_chains(draw):  # noqa: ANN001, ANN201
    """Chains over a small pair alphabet: the same formula is reached in several orders (a DAG)."""
    chains = draw(
        st.lists(
            st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2)), min_size=1, max_size=3, unique_by=lambda p: p[0]),
            min_size=1,
            max_size=6,
        )
    )
    return [[tuple(sorted(pairs[: lvl + 1])) for lvl in range(len(pairs))] for pairs in chains]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_chains(), st.integers(1, 4))
def test_greedy_is_optimal_on_trees(chains, nodes: int) -> None:  # noqa: ANN001
    wc = weighted_chains(chains)
    sel = select_formulas(chains, nodes, "greedy", tokens_per_step=1)
    assert len(sel) <= nodes and is_closed(sel, 1)
    assert objective_value(sel, wc) == brute_force(wc, nodes, 1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_chains(), st.integers(1, 4))
def test_objectives_closed_and_exact_is_optimal(chains, nodes: int) -> None:  # noqa: ANN001
    wc = weighted_chains(chains)
    best = brute_force(wc, nodes, 1)
    exact = select_formulas(chains, nodes, "exact", tokens_per_step=1)
    assert is_closed(exact, 1) and len(exact) <= nodes
    assert objective_value(exact, wc) == best
    for objective in ("greedy", "cumfreq", "degree1"):
        sel = select_formulas(chains, nodes, objective, tokens_per_step=1)
        assert len(sel) <= nodes and len(set(sel)) == len(sel)
        assert is_closed(sel, 1), objective
        assert objective_value(sel, wc) <= best
        # parents come before children in the returned order
        assert [lvl for lvl, _ in sel] == sorted(lvl for lvl, _ in sel)
    # deterministic
    assert select_formulas(chains, nodes, "greedy", tokens_per_step=1) == select_formulas(list(chains), nodes, "greedy", tokens_per_step=1)


def test_greedy_by_hand_and_alternatives() -> None:
    A, B, C = ((1, 1),), ((2, 1),), ((1, 2),)
    AB, AC2 = ((1, 1), (2, 1)), ((1, 1), (2, 2))
    chains = [[A, AB]] * 3 + [[B, AB]] * 2 + [[C]] * 4 + [[A, AC2]] * 1
    # marginal gains from empty: A = 4 (chains A..), B = 2, C = 4 -> tie on gain, A wins on count (4 vs 4: tie) ->
    # then lower level (both 1) -> smaller pairs: A ((1,1)) < C ((1,2))
    sel = select_formulas(chains, 3, "greedy", tokens_per_step=1)
    assert sel == [(1, A), (1, C), (2, AB)]
    assert objective_value(sel, weighted_chains(chains)) == 4 + 4 + 3
    # cumfreq: counts A 4, C 4, AB 5 (eligible after A), B 2
    assert select_formulas(chains, 3, "cumfreq", tokens_per_step=1) == [(1, A), (1, C), (2, AB)]
    # degree1: score(AB) = 5 + count(A) + count(B) = 11 -> AB right after A
    assert select_formulas(chains, 2, "degree1", tokens_per_step=1) == [(1, A), (2, AB)]
    assert candidate_parents(formula_counts(weighted_chains(chains)), 1)[(2, AB)] == [(1, A), (1, B)]
    assert select_formulas(chains, 0) == [] and select_formulas([], 5) == []
    with pytest.raises(ConfigError, match="objective"):
        select_formulas(chains, 3, "best")
    with pytest.raises(ConfigError, match="nodes"):
        select_formulas(chains, -1)


def test_greedy_stops_when_nothing_gains() -> None:
    A = ((1, 1),)
    assert select_formulas([[A]] * 3, 10) == [(1, A)]


# ------------------------------------------------------------------------------------------ projection
def test_projected_savings_by_hand() -> None:
    A, B, AB, AC = ((1, 1),), ((2, 1),), ((1, 1), (2, 1)), ((1, 1), (3, 1))
    g = DraftGraph.from_formulas([(1, A), (1, B), (2, AB)], meta={"calibrated_for": {"tokens_per_step": 1}})

    def ch(n: int, *fs: tuple) -> Chain:
        return Chain(0, n, n // 4, n % 4, tuple(fs))

    traj = Trajectory(prompt=0, nfe=10, num_steps=8, blocks=[0] * 4 + [1] * 4,
                      chains={1: ch(1, A, AB), 2: ch(2, B), 3: ch(3), 5: ch(5, A), 6: ch(6, A, AC)})
    p = project([traj], g)
    # walk: step 0 (no drafts) -> step 1 accepts A, AB (pays steps 1-3) -> step 4 (no drafts) ->
    #       step 5 accepts A (pays 5-6) -> step 7: 2 + 1 forwards saved of 10
    assert p["saved_forwards"] == 3
    assert p["baseline_nfe"] == 10 and p["projected_nfe"] == 7
    assert math.isclose(p["reduction"], 10 / 7)
    assert p["walks"] == 2 and p["accepted_per_level"] == [2, 1]
    assert p["objective"] == 2 + 1 + 0 + 1 + 1  # per-step depths, ignoring skipped steps
    # a second prompt adds up
    p2 = project([traj, traj], g)
    assert p2["baseline_nfe"] == 20 and p2["projected_nfe"] == 14 and p2["num_prompts"] == 2
    # an empty graph saves nothing
    assert project([traj], DraftGraph([]))["projected_nfe"] == 10


def test_build_graph_from_hand_trajectory() -> None:
    traj = extract_chains(trajectory(), mask_id=MASK, i_max=4, j_max=3, nfe=8)
    g = build_graph(traj.chain_list(), 4, meta={"calibrated_for": {"tokens_per_step": 1}}, trajectories=[traj])
    g.validate()
    assert g.node(0).key == (1, ((2, 2),)) and g.node(0).count == 2  # the most useful level-1 formula first
    assert g.projected["baseline_nfe"] == 8
    assert g.projected["projected_nfe"] == 8 - g.projected["saved_forwards"] < 8
