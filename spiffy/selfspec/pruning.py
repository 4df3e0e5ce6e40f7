"""Dynamic pruning of a calibrated draft graph: keep the ``budget`` most promising nodes for this step.

Scores are computed from the current ranking (the latest distribution ``P``):

* ``"gm"`` (default, SPEC section 5): ``local(q)`` = geometric mean of the probabilities ``p_ij`` of the pairs the
  node unmasks relative to the real state (all its pairs); ``score(q) = sqrt(local(q) * mean(score(children)))``
  computed bottom-up, leaves (no scorable child) score ``local(q)``.
* ``"product"``: product of the probabilities of the node's pairs (the probability of the state under
  independent per-position draws).
* ``"local"``: the geometric mean ``local(q)`` alone (no look-ahead through the children).
* ``"count"``: the node's calibration frequency (``DraftNode.count``), independent of ``P``.

Nodes with a pair whose rank is unavailable (fewer masked positions than ``i``, or ``j`` beyond the kept token
ranks) cannot be instantiated and are never kept. Selection is greedy by score subject to **parent closure**: a
node is eligible only if it is level 1 or one of its parents is already kept (an orphan can never be accepted).
Ties are broken deterministically: higher score, then lower level, then lower id.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Protocol, Sequence

from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import Ranking, pair_probs

SCORES: tuple[str, ...] = ("gm", "product", "local", "count")


class _Graph(Protocol):
    """What the pruning reads of a :class:`~spiffy.selfspec.graph.DraftGraph`: its nodes and its children index."""

    nodes: list

    def child_ids(self, id: int | None) -> tuple[int, ...]: ...


def _geo_mean(values: Sequence[float]) -> float:
    if not values:
        return 1.0
    if any(v <= 0.0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def check_budget(budget: Any) -> None:
    """ConfigError unless ``budget`` (drafts kept per step) is an integer >= 0."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"budget={budget!r} must be an integer >= 0; fix: pass e.g. --budget 3 (0 disables drafts)")


def node_scores(graph: _Graph, ranking: Ranking, score: str = "gm") -> dict[int, float]:
    """Score every instantiable node of ``graph`` under ``ranking``.

    Args:
        graph: a :class:`~spiffy.selfspec.graph.DraftGraph` (or anything with ``nodes`` in topological order).
        ranking: the current ranking (from :func:`~spiffy.selfspec.formulas.rank_state`).
        score: one of :data:`SCORES`.
    Returns:
        ``{node id: score}`` for the nodes whose pairs are all available (the others are absent).
    """
    if score not in SCORES:
        raise ConfigError(f"unknown pruning score {score!r}; fix: use one of {', '.join(SCORES)}")
    nodes = list(graph.nodes)
    probs: dict[int, list[float]] = {}
    for n in nodes:
        p = pair_probs(n.pairs, ranking)
        if p is not None:
            probs[n.id] = p
    if score == "count":
        return {n.id: float(n.count) for n in nodes if n.id in probs}
    if score == "product":
        return {nid: math.prod(p) for nid, p in probs.items()}
    local = {nid: _geo_mean(p) for nid, p in probs.items()}
    if score == "local":
        return local
    out: dict[int, float] = {}
    for n in reversed(nodes):  # children come after parents: reverse topological order is bottom-up
        if n.id not in local:
            continue
        child_scores = [out[c] for c in graph.child_ids(n.id) if c in out]
        if child_scores:
            out[n.id] = math.sqrt(local[n.id] * (sum(child_scores) / len(child_scores)))
        else:
            out[n.id] = local[n.id]
    return out


def prune(graph: _Graph, ranking: Ranking, budget: int, score: str = "gm") -> list[int]:
    """Select at most ``budget`` node ids, greedily by score, subject to parent closure.

    Args:
        graph: the calibrated draft graph.
        ranking: the current ranking.
        budget: number of drafts to keep (``0`` = no drafts, pure baseline cost).
        score: one of :data:`SCORES` (default ``"gm"``).
    Returns:
        Kept node ids in selection order (every kept node is level 1 or has a kept parent).
    Raises:
        ConfigError: ``budget < 0`` or an unknown score.
    """
    check_budget(budget)
    if score not in SCORES:
        raise ConfigError(f"unknown pruning score {score!r}; fix: use one of {', '.join(SCORES)}")
    if budget == 0 or not graph.nodes:
        return []
    return select_closed(graph, node_scores(graph, ranking, score), budget)


def select_closed(graph: _Graph, scores: dict[int, float], budget: int) -> list[int]:
    """Greedy parent-closed top-``budget`` selection among the nodes present in ``scores``."""
    nodes = {n.id: n for n in graph.nodes}
    heap: list[tuple[float, int, int]] = []
    pushed: set[int] = set()

    def push(nid: int) -> None:
        if nid in scores and nid not in pushed:
            pushed.add(nid)
            heapq.heappush(heap, (-scores[nid], nodes[nid].level, nid))

    for n in graph.nodes:
        if n.level == 1:
            push(n.id)
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, _, nid = heapq.heappop(heap)
        kept.append(nid)
        for c in graph.child_ids(nid):
            push(c)
    return kept


def is_parent_closed(graph: _Graph, kept: Sequence[int]) -> bool:
    """Whether every kept node is level 1 or has at least one kept parent."""
    nodes = {n.id: n for n in graph.nodes}
    ks = set(kept)
    return all(nodes[k].level == 1 or any(p in ks for p in nodes[k].parents) for k in kept)


__all__ = ["SCORES", "check_budget", "node_scores", "prune", "select_closed", "is_parent_closed"]
