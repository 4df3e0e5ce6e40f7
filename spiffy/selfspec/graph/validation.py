"""Structural validation of a draft graph's nodes (what :meth:`DraftGraph.validate` checks)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import networkx as nx

from spiffy.errors import GraphError
from spiffy.selfspec.graph.nodes import DraftNode, Pair, is_int, static_tps


def validate_nodes(nodes: Sequence[DraftNode], meta: Mapping[str, Any]) -> None:
    """Check the structure; raises :class:`GraphError` saying what is wrong, where, and how to fix it.

    Checks: node types, unique ids ``0..D-1`` in list order, levels ``>= 1``, pairs (non-empty, sorted,
    ranks ``>= 1``, distinct position ranks), no duplicate formulas, parents exist, no cycles, every parent
    one level up and a strict subset (static schedules: sizes grow by ``tokens_per_step``), no orphans,
    parents listed before children.
    """
    tps = static_tps(meta)
    fix_regen = "fix: regenerate the graph with `spiffy calibrate` (or build it with DraftGraph.from_formulas)"
    ids: dict[Any, int] = {}
    for k, n in enumerate(nodes):
        if not isinstance(n, DraftNode):
            raise GraphError(f"entry {k} of the node list is a {type(n).__name__}, not a DraftNode; fix: build DraftNode objects")
        if not is_int(n.id) or n.id < 0:
            raise GraphError(f"node at index {k}: id {n.id!r} must be an integer >= 0; {fix_regen}")
        if n.id in ids:
            raise GraphError(f"node id {n.id} appears twice (indices {ids[n.id]} and {k}); node ids must be unique; {fix_regen}")
        ids[n.id] = k
    # parents exist; cycles (reported before ordering problems, which a cycle always also causes)
    for n in nodes:
        for p in n.parents:
            if not is_int(p):
                raise GraphError(f"node {n.id}: parent id {p!r} is not an integer; {fix_regen}")
            if p not in ids:
                raise GraphError(f"node {n.id}: parent {p} does not exist (orphaned link); {fix_regen}")
            if p == n.id:
                raise GraphError(f"node {n.id} is its own parent (cycle {n.id} -> {n.id}); the graph must be acyclic; {fix_regen}")
    cycle = find_cycle({n.id: n.parents for n in nodes})
    if cycle:
        path = " -> ".join(str(c) for c in cycle)
        raise GraphError(f"cycle in the parent links: {path}; a draft graph must be acyclic; {fix_regen}")
    seen_keys: dict[tuple[int, tuple[Pair, ...]], int] = {}
    for k, n in enumerate(nodes):
        where = f"node {n.id}"
        if not is_int(n.level) or n.level < 1:
            raise GraphError(
                f"{where}: bad level {n.level!r}; levels are integers >= 1 (the root, level 0, is implicit); {fix_regen}"
            )
        if not n.pairs:
            raise GraphError(f"{where}: no (i, j) pairs; a draft node unmasks at least one token; {fix_regen}")
        for pair in n.pairs:
            if len(pair) != 2 or not all(is_int(v) for v in pair):
                raise GraphError(f"{where}: pair {pair!r} is not two integers (i, j); {fix_regen}")
            if pair[0] < 1 or pair[1] < 1:
                raise GraphError(f"{where}: pair {pair!r} has a rank < 1; ranks are 1-based; {fix_regen}")
        if list(n.pairs) != sorted(n.pairs):
            raise GraphError(f"{where}: pairs {list(map(list, n.pairs))} are not sorted; fix: sort them by (i, j)")
        pos = [i for i, _ in n.pairs]
        if len(set(pos)) != len(pos):
            raise GraphError(
                f"{where}: position rank repeated in {list(map(list, n.pairs))}; a position receives one token; {fix_regen}"
            )
        if tps is not None and len(n.pairs) != n.level * tps:
            raise GraphError(
                f"{where}: level {n.level} with {len(n.pairs)} pairs, but the static schedule unmasks {tps} token(s) "
                f"per step ({n.level * tps} expected); {fix_regen}"
            )
        if not is_int(n.count) or n.count < 0:
            raise GraphError(f"{where}: count {n.count!r} must be an integer >= 0; {fix_regen}")
        if n.key in seen_keys:
            raise GraphError(
                f"{where} duplicates node {seen_keys[n.key]} (same level {n.level} and pairs); fix: remove one of them"
            )
        seen_keys[n.key] = n.id
        if n.level == 1:
            if n.parents:
                raise GraphError(f"{where}: level-1 nodes are children of the root and list no parents, got {list(n.parents)}")
        elif not n.parents:
            raise GraphError(
                f"{where} (level {n.level}) is orphaned: it has no parent, so it could never be reached; "
                "fix: add a parent one level up whose pairs are a subset, or remove the node"
            )
        if len(set(n.parents)) != len(n.parents):
            raise GraphError(f"{where}: parent ids repeated in {list(n.parents)}")
        for p in n.parents:
            a = nodes[ids[p]]
            if a.level != n.level - 1:
                raise GraphError(
                    f"{where} (level {n.level}): parent {p} has level {a.level}; parents are exactly one level up; {fix_regen}"
                )
            if not set(a.pairs) < set(n.pairs):
                raise GraphError(
                    f"{where}: parent {p}'s pairs {list(map(list, a.pairs))} are not a strict subset of "
                    f"{list(map(list, n.pairs))}; {fix_regen}"
                )
            if tps is not None and len(n.pairs) - len(a.pairs) != tps:
                raise GraphError(
                    f"{where}: adds {len(n.pairs) - len(a.pairs)} token(s) to parent {p}, but the static schedule "
                    f"unmasks {tps} per step; {fix_regen}"
                )
    for k, n in enumerate(nodes):
        if n.id != k:
            raise GraphError(
                f"node at index {k} has id {n.id}; ids must be 0..{len(nodes) - 1} in list order with parents "
                "before children; fix: renumber the nodes (DraftGraph.from_networkx renumbers automatically)"
            )
        for p in n.parents:
            if p >= n.id:
                raise GraphError(f"node {n.id}: parent {p} is listed after it; parents must come before children")



def find_cycle(parents: Mapping[int, Sequence[int]]) -> list[int] | None:
    """A cycle in the parent relation as ``[a, b, ..., a]`` (child -> parent direction), or ``None``."""
    g = nx.DiGraph()
    g.add_nodes_from(parents)
    g.add_edges_from((child, p) for child, ps in parents.items() for p in ps if p in parents)
    try:
        edges = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return None
    return [u for u, _ in edges] + [edges[0][0]]


__all__ = ["find_cycle", "validate_nodes"]
