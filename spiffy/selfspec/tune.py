"""Tune a calibrated draft graph for the number of drafts kept per step (``D*``) by replaying the runtime's pruning.

The ceiling that calibration projects keeps every node of the graph; at run time only ``D*`` nodes are kept per step,
chosen from the current ranking by a pruning score (:mod:`spiffy.selfspec.pruning`). Calibration records each step's
ranking probabilities (:attr:`~spiffy.selfspec.chains.Trajectory.probs`), so that choice can be replayed on the
calibration trajectories: at step ``n`` keep ``prune(graph, ranking_n, D*, score)``, accept the longest prefix of the
step's recorded chain whose formulas are kept and linked, and go on at step ``n + 1 + accepted``. This is the walk
of :func:`~spiffy.selfspec.select.project` restricted to the kept nodes (:func:`project_at_budget`).

:func:`tune_for_budget` builds candidate graphs from the same chains and replays each with each score at ``D*``:

* ``default``: ``nodes`` nodes and the given level cap (none by default): on confident models the chain of the
  top-ranked positions, as deep as the nodes allow;
* ``capped``: lookahead capped at ``D*`` with ``max(nodes, 4 * D*)`` nodes, which leaves nodes for branches (the
  second-ranked position first, the second token), for the ``reach`` score to choose among per step;
* ``chain``: the top-k chain of depth ``D*`` (FreeDave's drafts, :mod:`spiffy.selfspec.freedave`), the reference.

A candidate replaces the chain only when it saves clearly more on the calibration prompts: a one-sided Wilcoxon
signed-rank test of its per-prompt savings against the chain's (paired by prompt, prompts with equal savings dropped;
``scipy.stats.wilcoxon``, whose ``method="auto"`` takes the exact null distribution or all sign permutations on
small samples and the tie-corrected normal approximation on large ones) rejects "no more than the chain" at level
:data:`CLEARLY_MORE_LEVEL` = 0.05. Among those, the one that saves most is kept (ties: the earlier one). A margin of a
few forwards in thousands is noise, and the chain, which needs no calibration, is what such noise should fall back
to. The signed-rank test suits per-prompt savings, which are heavy-tailed (a few prompts save many forwards); it
cannot reach 0.05 on fewer than 5 prompts (its smallest p-value is ``2**-n``), so on fewer the chain is kept. The
graph file records each candidate's p-value (``projected["candidates"][k]["p_value"]``) and the test
(``projected["candidate_test"]``).

Replaying costs no model call: a pruning per recorded step and candidate (milliseconds per thousand steps).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from scipy import stats

from spiffy.errors import ConfigError
from spiffy.selfspec.chains import Chain, Trajectory, count_formulas
from spiffy.selfspec.formulas import Ranking
from spiffy.selfspec.freedave import chain_formulas
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.pruning import check_score, prune
from spiffy.selfspec.select import build_graph, project, walk_depth

#: node count of a ``capped`` candidate per draft kept (with at least the requested ``nodes``)
CAPPED_NODES_PER_DRAFT = 4
#: one-sided level at which a candidate's per-prompt savings must beat the chain's to replace it
CLEARLY_MORE_LEVEL = 0.05
#: the paired test behind :func:`clearly_more`, as the graph file records it
CLEARLY_MORE_TEST = "wilcoxon signed-rank, one-sided (candidate saves more), paired by prompt, equal prompts dropped"


def check_tune_budget(budget: Any) -> None:
    """ConfigError unless ``budget`` is a ``D*`` a graph can be tuned for (an integer >= 1)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"budget={budget!r}: tuning needs an integer D* >= 1; fix: pass e.g. --budget 3")


def replay_ranking(probs: torch.Tensor) -> Ranking:
    """A :class:`Ranking` carrying only recorded probabilities ``[I, J]`` (all the pruning scores read)."""
    i, j = int(probs.shape[0]), int(probs.shape[1])
    return Ranking(
        rows=torch.arange(i),
        token_ids=torch.zeros(i, j, dtype=torch.long),
        token_probs=probs,
        num_masked=i,
        block_start=0,
        block_end=i,
    )


def replay_walks(trajectories: Sequence[Trajectory],
                 depth_at: Callable[[Trajectory, int, Chain], int]) -> dict[str, Any]:
    """Walk recorded trajectories the way the runtime walks a generation, with drafts decided by ``depth_at``.

    At step ``n`` with a recorded chain, ``depth_at(trajectory, n, chain)`` drafts are accepted (what a pruned graph,
    the chain, or a bound would accept there); the walk saves that many forwards and goes on at ``n + 1 + depth``.
    Steps without a chain (block starts, commit forwards) cost what they cost the baseline, as in
    :func:`~spiffy.selfspec.select.project`.

    Returns:
        ``{"baseline_nfe", "projected_nfe", "reduction", "saved_forwards", "walks", "accepted_per_level",
        "saved_per_prompt"}``.
    Raises:
        ValueError: ``depth_at`` returned a negative depth (the walk would not advance).
    """
    baseline = sum(t.nfe for t in trajectories)
    saved = walks = 0
    per_level: Counter[int] = Counter()
    per_prompt: list[int] = []
    for t in trajectories:
        saved_before = saved
        n = 0
        while n < t.num_steps:  # bounded: every pass advances n by at least 1
            chain = t.chains.get(n)
            depth = 0
            if chain is not None:
                walks += 1
                depth = depth_at(t, n, chain)
                if depth < 0:
                    raise ValueError(f"depth_at returned {depth} at step {n}: accepted drafts cannot be negative")
            per_level.update(range(1, depth + 1))
            saved += depth
            n += 1 + depth
        per_prompt.append(saved - saved_before)
    projected = baseline - saved
    return {
        "baseline_nfe": baseline,
        "projected_nfe": projected,
        "reduction": (baseline / projected) if projected > 0 else 1.0,
        "saved_forwards": saved,
        "walks": walks,
        "accepted_per_level": [per_level[lvl] for lvl in range(1, max(per_level, default=0) + 1)],
        "saved_per_prompt": per_prompt,
    }


def project_at_budget(trajectories: Sequence[Trajectory], graph: DraftGraph, budget: int, score: str) -> dict[str, Any]:
    """Replay the runtime's pruning at ``budget`` drafts per step on recorded trajectories.

    Args:
        trajectories: calibration trajectories with their ranking probabilities (:class:`Trajectory.probs`).
        graph: the draft graph to prune.
        budget: drafts kept per step (``D*``).
        score: the pruning score (:data:`~spiffy.selfspec.pruning.SCORES`).
    Returns:
        ``{"budget", "score"}`` and :func:`replay_walks`' counts.
    Raises:
        ConfigError: a bad score, or a trajectory recorded without probabilities.
    """
    check_score(score)  # the budget is a D* validated where it entered (check_tune_budget)

    def depth(t: Trajectory, n: int, chain: Chain) -> int:
        if budget <= 0 or not chain.formulas or not graph.nodes:
            return 0
        probs = t.probs.get(n)
        if probs is None:
            raise ConfigError(
                f"trajectory of prompt {t.prompt} has no ranking probabilities at step {n}; fix: record it "
                "with spiffy.selfspec.chains.ChainRecorder (calibrate does)"
            )
        kept = set(prune(graph, replay_ranking(probs), budget, score))
        return walk_depth(chain.formulas, graph, kept)

    return {"budget": budget, "score": score, **replay_walks(trajectories, depth)}


def paired_p_value(saved: Sequence[int], reference: Sequence[int]) -> float:
    """One-sided p-value that per-prompt savings ``saved`` exceed ``reference`` (paired by prompt): Wilcoxon's
    signed-rank test (``scipy.stats.wilcoxon``, ``alternative="greater"``, prompts with equal savings dropped);
    1.0 when no prompt differs.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(saved) != len(reference):
        raise ValueError(f"paired savings need one value per prompt on both sides, got {len(saved)} and "
                         f"{len(reference)}")
    diffs = np.asarray(saved, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    if not np.any(diffs != 0):
        return 1.0
    return float(stats.wilcoxon(diffs, alternative="greater").pvalue)


def clearly_more(saved: Sequence[int], reference: Sequence[int], level: float = CLEARLY_MORE_LEVEL) -> bool:
    """Whether per-prompt savings ``saved`` exceed ``reference`` beyond noise: :func:`paired_p_value` < ``level``."""
    return paired_p_value(saved, reference) < level


def _capped(chains: Sequence[Chain], cap: int) -> list[Chain]:
    return [Chain(c.prompt, c.index, c.block, c.step, c.formulas[:cap]) for c in chains]


def tune_for_budget(
    chains: Sequence[Chain],
    trajectories: Sequence[Trajectory],
    budget: int,
    *,
    nodes: int,
    objective: str = "greedy",
    max_level: int | None = None,
    meta: Mapping[str, Any] | None = None,
    tokens_per_step: int | None = None,
) -> DraftGraph:
    """Build the candidate graphs (module docstring), replay each under each score at ``budget``, return the best.

    Args:
        chains: the calibration chains (recorded with ``max_level``, if any).
        trajectories: the trajectories they came from, with ranking probabilities.
        budget: ``D*`` to tune for (``>= 1``).
        nodes: ``D`` of the default candidate; objective: the node-selection objective of every candidate.
        max_level: the level cap the chains were recorded with (the capped candidate uses ``min(D*, max_level)``).
        meta: ``calibrated_for`` / ``calibration`` sections; the returned graph's ``calibration`` gets the chosen
            ``nodes``, ``max_level``, ``score`` and ``budget``.
        tokens_per_step: static tokens per step (``None`` = dynamic), as for :func:`~spiffy.selfspec.select.build_graph`.
    Returns:
        The chosen :class:`DraftGraph`; ``projected["at_budget"]`` holds its replayed savings at ``budget`` and
        ``projected["candidates"]`` every candidate's (``label``, ``nodes``, ``max_level``, ``score``,
        ``reduction``, ``p_value`` of :func:`paired_p_value` against the chain, ``clearly_more``: whether it is
        below :data:`CLEARLY_MORE_LEVEL`; both ``None`` for the chain); ``projected["candidate_test"]`` the test,
        its level and the number of prompts.
    Raises:
        ConfigError: ``budget < 1``.
    """
    check_tune_budget(budget)
    cap = budget if max_level is None else min(budget, max_level)
    base_meta = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (meta or {}).items()}
    shapes: list[tuple[str, int, int | None, DraftGraph, tuple[str, ...]]] = []
    for label, n_nodes, level_cap, shape_chains in (("default", nodes, max_level, chains),
                                                    ("capped", max(nodes, CAPPED_NODES_PER_DRAFT * budget), cap,
                                                     _capped(chains, cap))):
        graph = build_graph(shape_chains, n_nodes, objective, meta=base_meta, tokens_per_step=tokens_per_step,
                            trajectories=trajectories)
        shapes.append((label, n_nodes, level_cap, graph, ("gm", "reach") if label == "default" else ("reach", "gm")))
    chain = DraftGraph.from_formulas(chain_formulas(budget, tokens_per_step or 1), meta=base_meta,
                                     counts=count_formulas(chains))
    chain.projected = project(trajectories, chain)
    shapes.append(("chain", budget, budget, chain, ("gm",)))  # every score keeps the whole chain
    results = [(label, n_nodes, level_cap, graph, score, project_at_budget(trajectories, graph, budget, score))
               for label, n_nodes, level_cap, graph, scores in shapes for score in scores]
    reference = results[-1][5]["saved_per_prompt"]  # the chain's
    candidates: list[dict[str, Any]] = []
    best: tuple[float, DraftGraph, dict[str, Any]] | None = None
    for label, n_nodes, level_cap, graph, score, result in results:
        p_value = None if label == "chain" else paired_p_value(result["saved_per_prompt"], reference)
        clear = p_value is None or p_value < CLEARLY_MORE_LEVEL
        candidates.append({"label": label, "nodes": len(graph), "max_level": level_cap, "score": score,
                           "reduction": result["reduction"], "p_value": p_value,
                           "clearly_more": clear if label != "chain" else None})
        if clear and (best is None or result["reduction"] > best[0]):
            chosen = {"nodes": n_nodes, "max_level": level_cap, "score": score, "budget": budget, "shape": label}
            best = (result["reduction"], graph, {"result": result, "calibration": chosen})
    assert best is not None
    _, graph, info = best
    meta_out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in graph.meta.items()}
    meta_out.setdefault("calibration", {}).update(info["calibration"])
    test = {"test": CLEARLY_MORE_TEST, "level": CLEARLY_MORE_LEVEL, "prompts": len(reference)}
    projected = {**graph.projected, "at_budget": info["result"], "candidates": candidates, "candidate_test": test}
    return DraftGraph(list(graph.nodes), meta_out, projected)


__all__ = ["CAPPED_NODES_PER_DRAFT", "CLEARLY_MORE_LEVEL", "CLEARLY_MORE_TEST", "check_tune_budget", "replay_ranking",
           "replay_walks", "project_at_budget", "paired_p_value", "clearly_more", "tune_for_budget"]
