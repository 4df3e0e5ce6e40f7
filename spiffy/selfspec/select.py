"""Choosing the draft graph from calibration chains, and projecting its savings.

Every recorded step contributes a chain ``f_1 ⊂ f_2 ⊂ ...`` (:mod:`spiffy.selfspec.chains`). With a graph ``G``
the walk of that step accepts ``depth(chain, G)`` drafts: the length of the longest prefix ``f_1..f_k`` all in ``G``.
Objectives (all select a parent-closed set: a node is eligible when it is level 1 or one of its parents - one
level up, a strict subset, ``tokens_per_step`` fewer tokens under a static schedule - is already chosen):

* ``"greedy"`` (default): add the eligible node with the largest marginal gain of ``Σ_chains depth``
  (ties: higher count, lower level, smaller pairs); stop at ``D`` nodes or when no node gains anything. Optimal
  when the candidates form a tree (every candidate has at most one candidate parent); a heuristic otherwise.
* ``"cumfreq"``: the paper's maximum-cumulative-frequency connected subgraph, built greedily: add the eligible
  node with the largest ``count`` (number of chains containing it at its level).
* ``"degree1"``: the paper's degree-1 accumulation: as ``cumfreq`` with score ``count(q) + Σ count(parents of q)``.
* ``"exact"``: the optimum of the depth objective by integer programming (scipy's HiGHS MILP); for small or
  medium calibrations (refuses problems with more than ``max_vars`` variables).

:func:`project` simulates the walk on the recorded trajectories (one verification forward pays for ``1 + depth``
steps; block-start and commit forwards are unchanged) and reports the ceiling of the NFE reduction with every
node kept.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix
from spiffy.errors import ConfigError
from spiffy.selfspec.chains import Chain, Trajectory
from spiffy.selfspec.graph import DraftGraph

Pair = tuple[int, int]
Formula = tuple[Pair, ...]
Key = tuple[int, Formula]  # (level, formula)

OBJECTIVES: tuple[str, ...] = ("greedy", "cumfreq", "degree1", "exact")


# ---------------------------------------------------------------------------------------------------------- helpers
def weighted_chains(chains: Iterable[Chain | Sequence[Formula]]) -> Counter[tuple[Formula, ...]]:
    """Identical chains merged: ``{formulas: number of steps}`` (empty chains dropped)."""
    c: Counter[tuple[Formula, ...]] = Counter()
    for ch in chains:
        f = ch.formulas if isinstance(ch, Chain) else tuple(tuple(sorted(x)) for x in ch)
        if f:
            c[f] += 1
    return c


def formula_counts(wc: Mapping[tuple[Formula, ...], int]) -> Counter[Key]:
    """``{(level, formula): weight of the chains containing it at that level}``."""
    counts: Counter[Key] = Counter()
    for ch, w in wc.items():
        for lvl, f in enumerate(ch, start=1):
            counts[(lvl, f)] += w
    return counts


def candidate_parents(keys: Iterable[Key], tokens_per_step: int | None = None) -> dict[Key, list[Key]]:
    """For every candidate, its parents among the candidates (one level up, strict subset, size step)."""
    by_level: dict[int, list[Key]] = defaultdict(list)
    for k in sorted(set(keys)):
        by_level[k[0]].append(k)
    parents: dict[Key, list[Key]] = {}
    for lvl, ks in by_level.items():
        up = by_level.get(lvl - 1, [])
        bucket: dict[Pair, list[Key]] = defaultdict(list)
        for p in up:
            bucket[p[1][0]].append(p)  # index by the smallest pair
        for k in ks:
            if lvl == 1:
                parents[k] = []
                continue
            fs = set(k[1])
            found = []
            for a in k[1]:
                for p in bucket.get(a, []):
                    if len(p[1]) < len(fs) and set(p[1]) < fs:
                        if tokens_per_step is None or len(fs) - len(p[1]) == tokens_per_step:
                            found.append(p)
            parents[k] = sorted(set(found))
    return parents


def depth(chain: Sequence[Formula], selected: set[Key] | frozenset[Key]) -> int:
    """Longest prefix ``f_1..f_k`` of ``chain`` with every ``(l, f_l)`` in ``selected``."""
    d = 0
    for lvl, f in enumerate(chain, start=1):
        if (lvl, f) not in selected:
            break
        d = lvl
    return d


def objective_value(selected: Iterable[Key], wc: Mapping[tuple[Formula, ...], int]) -> int:
    """``Σ_chains weight * depth``: the calibration's saved forwards if every step started a walk."""
    s = set(selected)
    return sum(w * depth(ch, s) for ch, w in wc.items())


def is_closed(selected: Iterable[Key], tokens_per_step: int | None = None) -> bool:
    """Whether every selected formula is level 1 or has a selected parent."""
    s = set(selected)
    par = candidate_parents(s, tokens_per_step)
    return all(k[0] == 1 or par[k] for k in s)


def _tie(k: Key, counts: Mapping[Key, int]) -> tuple:
    return (-counts.get(k, 0), k[0], k[1])


# ---------------------------------------------------------------------------------------------------------- select
def select_formulas(
    chains: Iterable[Chain | Sequence[Formula]],
    nodes: int,
    objective: str = "greedy",
    *,
    tokens_per_step: int | None = None,
    max_vars: int = 200_000,
    time_limit: float = 120.0,
) -> list[Key]:
    """Choose at most ``nodes`` formulas forming a parent-closed set.

    Args:
        chains: calibration chains (or plain formula sequences).
        nodes: ``D``, the number of graph nodes (``>= 0``).
        objective: one of :data:`OBJECTIVES`.
        tokens_per_step: uniform static tokens per step (parent links need exactly this many more tokens).
        max_vars, time_limit: limits of the ``"exact"`` solver.
    Returns:
        ``[(level, formula), ...]`` in selection order (parents before children).
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown calibration objective {objective!r}; fix: use one of {', '.join(OBJECTIVES)}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"nodes={nodes!r} must be an integer >= 0; fix: pass e.g. nodes=10")
    wc = weighted_chains(chains)
    if tokens_per_step is not None:
        wc = _static_prefixes(wc, tokens_per_step)
    if nodes == 0 or not wc:
        return []
    counts = formula_counts(wc)
    parents = candidate_parents(counts, tokens_per_step)
    if objective == "greedy":
        chosen = _greedy(wc, counts, parents, nodes)
    elif objective == "exact":
        chosen = _exact(wc, counts, parents, nodes, max_vars=max_vars, time_limit=time_limit)
    else:
        if objective == "cumfreq":
            score = {k: counts[k] for k in counts}
        else:
            score = {k: counts[k] + sum(counts[p] for p in parents[k]) for k in counts}
        chosen = _by_score(score, counts, parents, nodes)
    return _topological(chosen)


def _static_prefixes(wc: Mapping[tuple[Formula, ...], int], tps: int) -> Counter[tuple[Formula, ...]]:
    """Chains cut before the first level whose size is not ``level * tps`` (a static graph cannot hold it; this
    happens when a schedule announced as uniform is not, e.g. a step unmasking a different number of tokens)."""
    out: Counter[tuple[Formula, ...]] = Counter()
    for ch, w in wc.items():
        k = 0
        while k < len(ch) and len(ch[k]) == (k + 1) * tps:
            k += 1
        if k:
            out[ch[:k]] += w
    return out


def _topological(keys: list[Key]) -> list[Key]:
    return sorted(keys, key=lambda k: k[0])  # stable: selection order inside a level


def _children_index(parents: Mapping[Key, list[Key]]) -> dict[Key, list[Key]]:
    kids: dict[Key, list[Key]] = defaultdict(list)
    for k, ps in parents.items():
        for p in ps:
            kids[p].append(k)
    return kids


def _by_score(score: Mapping[Key, int], counts: Mapping[Key, int], parents: Mapping[Key, list[Key]], nodes: int) -> list[Key]:
    kids = _children_index(parents)
    eligible = {k for k in score if k[0] == 1}
    chosen: list[Key] = []
    while len(chosen) < nodes and eligible:
        best = min(eligible, key=lambda k: (-score[k],) + _tie(k, counts))
        if score[best] <= 0:
            break
        chosen.append(best)
        eligible.discard(best)
        chosen_set = set(chosen)
        for c in kids.get(best, []):
            if c not in chosen_set:
                eligible.add(c)
    return chosen


def _greedy(
    wc: Mapping[tuple[Formula, ...], int], counts: Mapping[Key, int], parents: Mapping[Key, list[Key]], nodes: int
) -> list[Key]:
    chain_list = list(wc.items())
    occ: dict[Key, list[tuple[int, int]]] = defaultdict(list)  # key -> [(chain index, level)]
    for ci, (ch, _) in enumerate(chain_list):
        for lvl, f in enumerate(ch, start=1):
            occ[(lvl, f)].append((ci, lvl))
    depth_of = [0] * len(chain_list)
    chosen: list[Key] = []
    chosen_set: set[Key] = set()
    kids = _children_index(parents)
    eligible = {k for k in counts if k[0] == 1}
    gains: dict[Key, int] = {}

    def gain(k: Key) -> int:
        g = 0
        for ci, lvl in occ[k]:
            if depth_of[ci] != lvl - 1:
                continue
            ch, w = chain_list[ci]
            e = lvl
            while e < len(ch) and (e + 1, ch[e]) in chosen_set:
                e += 1
            g += w * (e - (lvl - 1))
        return g

    stale = set(eligible)
    while len(chosen) < nodes and eligible:
        for k in stale:
            if k in eligible:
                gains[k] = gain(k)
        stale = set()
        best = min(eligible, key=lambda k: (-gains[k],) + _tie(k, counts))
        if gains[best] <= 0:
            break
        chosen.append(best)
        chosen_set.add(best)
        eligible.discard(best)
        gains.pop(best, None)
        # update depths of the chains the new node extends; their formulas' gains are stale
        # (a chain containing the new node changes the gain of its other formulas even when its depth stays)
        for ci, lvl in occ[best]:
            ch, _ = chain_list[ci]
            stale.update((l2, f) for l2, f in enumerate(ch, start=1))
            if depth_of[ci] != lvl - 1:
                continue
            e = lvl
            while e < len(ch) and (e + 1, ch[e]) in chosen_set:
                e += 1
            depth_of[ci] = e
        for c in kids.get(best, []):
            if c not in chosen_set and c not in eligible:
                eligible.add(c)
                stale.add(c)
    return chosen


def _exact(
    wc: Mapping[tuple[Formula, ...], int],
    counts: Mapping[Key, int],
    parents: Mapping[Key, list[Key]],
    nodes: int,
    *,
    max_vars: int,
    time_limit: float,
) -> list[Key]:
    # a chain prefix longer than D can never be fully selected
    chains = [(ch[:nodes], w) for ch, w in wc.items()]
    keys = sorted({(lvl, f) for ch, _ in chains for lvl, f in enumerate(ch, start=1)})
    xi = {k: n for n, k in enumerate(keys)}
    yi: list[tuple[int, int]] = []  # (chain, level)
    ycol: dict[tuple[int, int], int] = {}
    for ci, (ch, _) in enumerate(chains):
        for lvl in range(1, len(ch) + 1):
            ycol[(ci, lvl)] = len(keys) + len(yi)
            yi.append((ci, lvl))
    nvar = len(keys) + len(yi)
    if nvar > max_vars:
        raise ConfigError(
            f"the exact calibration objective would need {nvar} variables (limit {max_vars}); "
            "fix: use --objective greedy, fewer prompts, or a smaller --max-level / --i-max / --j-max"
        )
    eps = 1.0 / (2.0 * (nodes + 1))  # prefer fewer nodes among equal optima, never at the cost of a saved step
    c = np.zeros(nvar)
    c[: len(keys)] = eps
    for (ci, lvl), col in ycol.items():
        c[col] = -float(chains[ci][1])
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)
        r += 1

    for (ci, lvl), col in ycol.items():
        f = chains[ci][0][lvl - 1]
        add([(col, 1.0), (xi[(lvl, f)], -1.0)], -np.inf, 0.0)  # y <= x
        if lvl > 1:
            add([(col, 1.0), (ycol[(ci, lvl - 1)], -1.0)], -np.inf, 0.0)  # y_l <= y_{l-1}
    for k in keys:
        if k[0] > 1:
            ps = [xi[p] for p in parents.get(k, []) if p in xi]
            add([(xi[k], 1.0)] + [(p, -1.0) for p in ps], -np.inf, 0.0)  # closure
    add([(xi[k], 1.0) for k in keys], 0.0, float(nodes))
    A = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    res = milp(
        c,
        constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
        integrality=np.ones(nvar),
        bounds=Bounds(np.zeros(nvar), np.ones(nvar)),
        options={"time_limit": float(time_limit)},
    )
    if res.x is None:
        raise ConfigError(f"the exact calibration solver found no solution ({res.message}); fix: use --objective greedy")
    chosen = [k for k in keys if res.x[xi[k]] > 0.5]
    return sorted(chosen, key=lambda k: (k[0],) + _tie(k, counts))


# ---------------------------------------------------------------------------------------------------------- project
def walk_depth(chain: Sequence[Formula], graph: DraftGraph, kept: set[int] | None = None) -> int:
    """Drafts the walk accepts for this chain (follows the graph's links) with every node of ``graph`` drafted, or
    only the ``kept`` node ids."""
    node: int | None = None
    d = 0
    for lvl, f in enumerate(chain, start=1):
        nxt = None
        for c in graph.children(node):
            if c.level == lvl and c.pairs == f and (kept is None or c.id in kept):
                nxt = c.id
                break
        if nxt is None:
            break
        node = nxt
        d = lvl
    return d


def project(trajectories: Sequence[Trajectory], graph: DraftGraph) -> dict[str, Any]:
    """Simulate the walk on recorded trajectories with every node of ``graph`` kept (the ceiling of the savings).

    One verification forward at step ``n`` pays for ``1 + depth`` steps; the next walk starts at step
    ``n + 1 + depth``; steps without drafts (first step, block-start refresh, uncovered block) and block-start /
    commit forwards cost what they cost the baseline.

    Returns:
        ``{"baseline_nfe", "projected_nfe", "reduction", "saved_forwards", "steps", "num_prompts", "walks",
        "accepted_per_level", "mean_accepted_per_walk", "objective"}`` (``objective`` = ``Σ_steps depth``, the
        calibration objective, an optimistic bound that ignores skipped steps).
    """
    baseline = sum(t.nfe for t in trajectories)
    saved = 0
    walks = 0
    per_level: Counter[int] = Counter()
    objective = 0
    cache: dict[tuple[Formula, ...], int] = {}

    def dep(ch: Chain) -> int:
        d = cache.get(ch.formulas)
        if d is None:
            d = walk_depth(ch.formulas, graph)
            cache[ch.formulas] = d
        return d

    for t in trajectories:
        for ch in t.chains.values():
            objective += dep(ch)
        n = 0
        while n < t.num_steps:
            ch = t.chains.get(n)
            d = dep(ch) if ch is not None else 0
            if ch is not None:
                walks += 1
            for lvl in range(1, d + 1):
                per_level[lvl] += 1
            saved += d
            n += 1 + d
    projected = baseline - saved
    return {
        "baseline_nfe": baseline,
        "projected_nfe": projected,
        "reduction": (baseline / projected) if projected > 0 else 1.0,
        "saved_forwards": saved,
        "steps": sum(t.num_steps for t in trajectories),
        "num_prompts": len(trajectories),
        "walks": walks,
        "mean_accepted_per_walk": (saved / walks) if walks else 0.0,
        "accepted_per_level": [per_level[lvl] for lvl in range(1, max(per_level, default=0) + 1)],
        "objective": objective,
    }


def build_graph(
    chains: Sequence[Chain],
    nodes: int,
    objective: str = "greedy",
    *,
    meta: Mapping[str, Any] | None = None,
    tokens_per_step: int | None = None,
    trajectories: Sequence[Trajectory] | None = None,
) -> DraftGraph:
    """Select the formulas and build the :class:`DraftGraph` (counts = chain frequencies; ``projected`` filled
    from ``trajectories`` when given)."""
    if tokens_per_step is None:
        tps = (meta or {}).get("calibrated_for", {}).get("tokens_per_step")
        tokens_per_step = tps if isinstance(tps, int) and not isinstance(tps, bool) and tps >= 1 else None
    keys = select_formulas(chains, nodes, objective, tokens_per_step=tokens_per_step)
    wc = weighted_chains(chains)
    counts = formula_counts(_static_prefixes(wc, tokens_per_step) if tokens_per_step is not None else wc)
    g = DraftGraph.from_formulas([(lvl, f) for lvl, f in keys], meta=meta, counts=[counts[k] for k in keys])
    if trajectories is not None:
        g.projected = project(trajectories, g)
    return g


__all__ = [
    "OBJECTIVES",
    "weighted_chains",
    "formula_counts",
    "candidate_parents",
    "depth",
    "objective_value",
    "is_closed",
    "select_formulas",
    "walk_depth",
    "project",
    "build_graph",
]
