"""Edge-case draft graphs for tests and benchmarks.

* :func:`oracle_graph`: a graph calibrated on the baseline's own trajectory with no rank caps, so that replaying
  the same generation (same prompt, config, seed) accepts (almost) every step: the "oracle drafter".
* :func:`random_graph`: a valid random DAG of formulas: the "random drafter" (little is accepted).
* :func:`trajectory_formulas`: the chains of (i, j) formulas a baseline trajectory realises, ranked exactly as the
  runtime ranks (via :func:`~spiffy.selfspec.formulas.rank_state`).

Both graphs are :class:`~spiffy.selfspec.graph.DraftGraph` objects built with ``DraftGraph.from_formulas``.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Sequence

import torch

from spiffy.decoding.batch import run_baseline
from spiffy.decoding.session import DecodeSession, StepRecord
from spiffy.errors import ConfigError
from spiffy.selfspec.formulas import Pair, rank_state, window_covers
from spiffy.selfspec.graph import DraftGraph

Formula = tuple[int, tuple[Pair, ...]]


def record_trajectory(session: DecodeSession) -> list[StepRecord]:
    """Run the baseline on ``session`` and return its step records (``session.x`` holds the final state)."""
    records: list[StepRecord] = []
    run_baseline(session, observer=records.append)
    return records


def trajectory_formulas(
    records: Sequence[StepRecord],
    mask_id: int,
    *,
    i_max: int | None = None,
    j_max: int | None = None,
    max_level: int | None = None,
) -> Counter[Formula]:
    """Count the formulas ``(level, pairs)`` a baseline trajectory realises.

    At step ``n`` (state ``x_n = records[n].x_before``) whose previous logits ``P_{n-1} = records[n-1].logits``
    cover the current block, the chain ``f_1 ⊂ f_2 ⊂ ...`` has ``f_l`` = the (i, j) ranks under ``P_{n-1}`` of the
    (position, token) pairs unmasked between ``x_n`` and ``x_{n+l}`` inside the block. A chain stops at the block
    end, at ``max_level``, or when a rank exceeds the caps. No-op steps (nothing unmasked) add no level: the runtime
    reuses the known logits for them, so levels count productive steps; no chain starts right after a no-op step
    (the runtime never ranks there).

    Args:
        records: the trajectory (``[1, T]`` states, ``[1, W, V]`` logits).
        mask_id: the family's mask id.
        i_max, j_max: rank caps (``None`` = no cap).
        max_level: longest lookahead (``None`` = to the block end).
    Returns:
        ``Counter`` of ``(level, pairs)``.
    """
    counts: Counter[Formula] = Counter()
    for n in range(1, len(records)):
        prev, cur = records[n - 1], records[n]
        info = cur.info
        if torch.equal(prev.x_before, prev.x_after):
            continue
        w = int(prev.logits.shape[1])
        if not window_covers(prev.info.window_start, w, info.block_start, info.block_end):
            continue
        x_n = cur.x_before[0]
        v = int(prev.logits.shape[-1])
        ranking = rank_state(
            prev.logits[0],
            x_n,
            info.block_start,
            info.block_end,
            prev.info.window_start,
            i_max or (info.block_end - info.block_start),
            j_max or v,
            mask_id=mask_id,
            probs=prev.probs,
        )
        rows = ranking.rows.tolist()
        rank_of_row = {r: k + 1 for k, r in enumerate(rows)}
        tok_ids = ranking.token_ids.tolist()
        level = 0
        for m in range(n, len(records)):
            if records[m].info.block != info.block or (max_level is not None and level >= max_level):
                break
            if torch.equal(records[m].x_before, records[m].x_after):
                continue
            level += 1
            x_l = records[m].x_after[0]
            changed = ((x_n != x_l) & (x_n == mask_id)).nonzero().squeeze(1).tolist()
            pairs: list[Pair] = []
            ok = True
            for row in changed:
                i = rank_of_row.get(row)
                tok = int(x_l[row])
                if i is None or tok not in tok_ids[i - 1]:
                    ok = False
                    break
                pairs.append((i, tok_ids[i - 1].index(tok) + 1))
            if not ok or not pairs:
                break
            counts[(level, tuple(sorted(pairs)))] += 1
    return counts


def _make_graph(formulas: Sequence[Formula], counts: Sequence[int] | None, meta: dict | None) -> Any:
    return DraftGraph.from_formulas(list(formulas), meta=meta, counts=None if counts is None else list(counts))


def oracle_graph_from_records(
    records: Sequence[StepRecord], mask_id: int, *, max_level: int | None = None, meta: dict | None = None
) -> Any:
    """The oracle graph of a recorded baseline trajectory (see :func:`oracle_graph`).

    Raises:
        ConfigError: the trajectory yields no formula (e.g. one step per block).
    """
    counts = trajectory_formulas(records, mask_id, max_level=max_level)
    if not counts:
        raise ConfigError(
            "the baseline trajectory yields no draft formula (no step has a previous distribution covering its "
            "block); fix: use more steps per block"
        )
    formulas = sorted(counts, key=lambda f: (f[0], f[1]))
    return _make_graph(formulas, [counts[f] for f in formulas], meta)


def oracle_graph(session: DecodeSession, *, max_level: int | None = None, meta: dict | None = None) -> Any:
    """A graph from the baseline's own trajectory on ``session`` (which is consumed: it runs the baseline).

    Replaying the same generation (same prompt, config, seed) with this graph and a budget of
    ``len(graph.nodes)`` accepts every step whose previous distribution covers the block, up to the block end.

    Args:
        session: a fresh batch-1 session; run to completion here.
        max_level: deepest lookahead kept (``None`` = to the block end).
        meta: optional graph meta.
    Returns:
        A ``DraftGraph``.
    Raises:
        ConfigError: the trajectory yields no formula (e.g. one step per block).
    """
    return oracle_graph_from_records(record_trajectory(session), session.mask_id, max_level=max_level, meta=meta)


def random_formulas(
    levels: int, nodes: int, seed: int, i_max: int, j_max: int, tokens_per_step: int = 1
) -> list[Formula]:
    """Random parent-closed formulas: level-1 nodes pick ``tokens_per_step`` pairs; a deeper node extends a random
    node of the level above by ``tokens_per_step`` pairs at new position ranks. Deterministic for ``seed``."""
    if levels < 1 or nodes < 1 or i_max < 1 or j_max < 1 or tokens_per_step < 1:
        raise ConfigError("random_graph needs levels, nodes, i_max, j_max, tokens_per_step >= 1")
    if levels * tokens_per_step > i_max:
        raise ConfigError(f"levels*tokens_per_step={levels * tokens_per_step} exceeds i_max={i_max}; fix: raise i_max")
    rng = random.Random(seed)
    by_level: dict[int, list[tuple[Pair, ...]]] = {lvl: [] for lvl in range(1, levels + 1)}
    seen: set[Formula] = set()
    out: list[Formula] = []
    attempts = 0
    while len(out) < nodes and attempts < 50 * nodes:
        attempts += 1
        candidates = [lvl for lvl in range(1, levels + 1) if lvl == 1 or by_level[lvl - 1]]
        lvl = rng.choice(candidates) if out else 1
        base: tuple[Pair, ...] = () if lvl == 1 else rng.choice(by_level[lvl - 1])
        used = {i for i, _ in base}
        free = [i for i in range(1, i_max + 1) if i not in used]
        new = [(i, rng.randint(1, j_max)) for i in rng.sample(free, tokens_per_step)]
        pairs = tuple(sorted(base + tuple(new)))
        if (lvl, pairs) in seen:
            continue
        seen.add((lvl, pairs))
        by_level[lvl].append(pairs)
        out.append((lvl, pairs))
    return sorted(out)


def random_graph(
    levels: int,
    nodes: int,
    seed: int = 0,
    i_max: int = 4,
    j_max: int = 3,
    tokens_per_step: int = 1,
    meta: dict | None = None,
) -> Any:
    """A valid random draft graph (``DraftGraph``) with up to ``nodes`` nodes over ``levels`` levels."""
    return _make_graph(random_formulas(levels, nodes, seed, i_max, j_max, tokens_per_step), None, meta)


__all__ = ["record_trajectory", "trajectory_formulas", "oracle_graph", "oracle_graph_from_records", "random_formulas", "random_graph"]
