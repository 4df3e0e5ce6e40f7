"""Dynamic pruning of a calibrated draft graph: keep the ``budget`` most promising nodes for this step.

Scores are computed from the current ranking (the latest distribution ``P``):

* ``"gm"`` (default, SPEC section 5): ``local(q)`` = geometric mean of the probabilities ``p_ij`` of the pairs the
  node unmasks relative to the real state (all its pairs); ``score(q) = sqrt(local(q) * mean(score(children)))``
  computed bottom-up, leaves (no scorable child) score ``local(q)``.
* ``"product"``: product of the probabilities of the node's pairs (the probability of the state under
  independent per-position draws).
* ``"local"``: the geometric mean ``local(q)`` alone (no look-ahead through the children).
* ``"count"``: the node's calibration frequency (``DraftNode.count``), independent of ``P``.
* ``"reach"``: an estimate of how likely the baseline's trajectory is to pass through the node, the quantity whose
  sum over the kept nodes is the expected number of accepted drafts: ``product(q) * (count(q) / max count) **``
  :data:`REACH_FREQUENCY_EXPONENT`. The product is the chance of the node's tokens under ``P``; the calibrated
  frequency carries what ``P`` cannot see, whether the baseline unmasks positions in rank order. The frequency is
  tempered (exponent 1/4) because calibration counts already include the token outcomes the product measures.
  Made for graphs with branches (``spiffy calibrate --budget D*`` picks it when it pays, or ``--max-level L
  --score reach`` by hand): ``"gm"`` averages probabilities instead of multiplying them, so on such a graph it ranks
  a short branch of near-certain tokens above the next level of the chain as soon as both look certain, and keeps
  branches the trajectory rarely takes.
  On a chain-shaped graph every score keeps the same nodes (parent closure leaves no choice).

Which score a graph is run with: the one its calibration recorded (``calibration.score`` in the file,
:attr:`~spiffy.selfspec.graph.DraftGraph.pruning_score`), else ``"gm"``; an explicit ``score`` argument overrides
it (:func:`resolve_score`).

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

SCORES: tuple[str, ...] = ("gm", "product", "local", "count", "reach")
DEFAULT_SCORE = "gm"
#: drafts kept per step when neither the caller nor the graph (its tuned ``calibration.budget``) says
DEFAULT_BUDGET = 3
#: exponent of the calibrated frequency in the ``"reach"`` score. Chosen on calibration trajectories of the shipped
#: tiny SDAR (HumanEval 41-90, never the evaluation prompts): the simulated reduction is flat between 0.15 and 0.5
#: at D* = 2..5 and falls off towards 0 (the frequency then only breaks ties) and towards 1.
REACH_FREQUENCY_EXPONENT = 0.25


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


def check_score(score: Any) -> None:
    """ConfigError unless ``score`` is one of :data:`SCORES`."""
    if score not in SCORES:
        raise ConfigError(f"unknown pruning score {score!r}; fix: use one of {', '.join(SCORES)}")


def resolve_score(score: str | None, graph: Any) -> str:
    """The pruning score to run ``graph`` with: ``score`` when given, else the score the graph's calibration recorded
    (``graph.pruning_score``), else :data:`DEFAULT_SCORE`. ConfigError for an unknown score."""
    chosen = score if score is not None else getattr(graph, "pruning_score", None) or DEFAULT_SCORE
    check_score(chosen)
    return chosen


def resolve_budget(budget: int | None, graph: Any) -> int:
    """Drafts to keep per step: ``budget`` when given, else the ``D*`` the graph was tuned for
    (``graph.tuned_budget``, :mod:`spiffy.selfspec.tune`), else :data:`DEFAULT_BUDGET`. ConfigError if invalid."""
    chosen = budget if budget is not None else getattr(graph, "tuned_budget", None)
    chosen = DEFAULT_BUDGET if chosen is None else chosen
    check_budget(chosen)
    return chosen


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
    check_score(score)
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
    if score == "reach":
        top = max((int(n.count) for n in nodes), default=0)
        return {
            n.id: math.prod(probs[n.id]) * ((max(int(n.count), 0) / top) ** REACH_FREQUENCY_EXPONENT if top > 0 else 1.0)
            for n in nodes
            if n.id in probs
        }
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
        budget: number of drafts to keep (``0`` = no drafts, pure baseline cost), validated where it entered
            (:class:`~spiffy.selfspec.config.SpiffyConfig`, the tuning's ``D*``): this runs at every step.
        score: one of :data:`SCORES` (default ``"gm"``).
    Returns:
        Kept node ids in selection order (every kept node is level 1 or has a kept parent).
    Raises:
        ConfigError: an unknown score.
    """
    if budget <= 0 or not graph.nodes:
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


__all__ = ["SCORES", "DEFAULT_SCORE", "DEFAULT_BUDGET", "REACH_FREQUENCY_EXPONENT", "check_score", "resolve_score",
           "resolve_budget", "check_budget", "node_scores", "prune", "select_closed", "is_parent_closed"]
