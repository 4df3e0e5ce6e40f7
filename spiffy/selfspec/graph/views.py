"""Views of a draft graph: networkx conversion, a text summary for people, a PNG drawing (matplotlib optional)."""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

import networkx as nx

from spiffy.errors import ConfigError, GraphError
from spiffy.io import atomic_write_with
from spiffy.selfspec.graph.fileformat import short
from spiffy.selfspec.graph.nodes import DraftNode, Pair, is_int


def to_networkx(graph: Any, *, include_root: bool = False) -> Any:
    """A ``networkx.DiGraph``: nodes keyed by id with attributes ``level``, ``pairs``, ``count``; edges
    parent -> child. ``graph.graph`` carries ``meta`` and ``projected``. ``include_root`` adds node ``"root"``
    (level 0) with edges to the level-1 nodes."""
    g = nx.DiGraph()
    g.graph["meta"] = copy.deepcopy(graph.meta)
    g.graph["projected"] = copy.deepcopy(graph.projected)
    if include_root:
        g.add_node("root", level=0, pairs=(), count=0, root=True)
    for n in graph.nodes:
        g.add_node(n.id, level=n.level, pairs=n.pairs, count=n.count)
    for n in graph.nodes:
        for p in n.parents:
            g.add_edge(p, n.id)
        if include_root and n.level == 1:
            g.add_edge("root", n.id)
    return g


def from_networkx(cls: Any, g: Any, meta: Mapping[str, Any] | None = None) -> Any:
    """Inverse of :meth:`to_networkx`. Parent links come from the edges; a ``"root"`` / level-0 node is skipped.
    Node keys that are not already ``0..D-1`` in a valid order are renumbered in topological order."""
    if not isinstance(g, nx.DiGraph):
        raise GraphError(f"from_networkx expects a networkx.DiGraph, got {type(g).__name__}")
    if not nx.is_directed_acyclic_graph(g):
        cyc = nx.find_cycle(g)
        raise GraphError(f"networkx graph has a cycle {cyc}; a draft graph must be acyclic")
    data = dict(g.nodes(data=True))
    roots = {k for k, a in data.items() if a.get("root") or a.get("level") == 0}
    keys = [k for k in data if k not in roots]
    for k in keys:
        for attr in ("level", "pairs"):
            if attr not in data[k]:
                raise GraphError(f"networkx node {k!r} has no {attr!r} attribute; fix: set level and pairs on every node")
    ident = all(is_int(k) for k in keys) and sorted(keys) == list(range(len(keys)))
    if ident and all(p < c for p, c in g.edges() if p not in roots):
        order = sorted(keys)
    else:
        order = list(
            nx.lexicographical_topological_sort(
                g.subgraph(keys), key=lambda k: (data[k]["level"], _sorted_pairs(data[k]["pairs"]), str(k))
            )
        )
    new_id = {k: i for i, k in enumerate(order)}
    nodes = []
    for k in order:
        a = data[k]
        parents = tuple(sorted(new_id[p] for p in g.predecessors(k) if p not in roots))
        nodes.append(
            DraftNode(id=new_id[k], level=a["level"], pairs=tuple(tuple(p) for p in a["pairs"]), parents=parents, count=a.get("count", 0))
        )
    if meta is None:
        meta = g.graph.get("meta", {})
    return cls(nodes, copy.deepcopy(dict(meta)), copy.deepcopy(g.graph.get("projected", {})))


def summary(graph: Any) -> str:
    """Human-readable text: what it was calibrated for, levels, nodes per level, counts, projected reduction."""
    lines = [f"Spiffy draft graph: {len(graph.nodes)} node(s), {graph.max_level()} level(s)" + (f"  [{graph.path}]" if graph.path else "")]
    cf = graph.calibrated_for
    if cf:
        shown = ["family", "model", "model_revision", "config_fingerprint", "mask_id", "block_length",
                 "steps_per_block", "threshold", "remasking", "alg", "strategy", "temperature", "cache", "tokens_per_step"]
        parts = [f"{k}={cf[k]}" for k in shown if k in cf]
        lines.append("calibrated for: " + ", ".join(parts))
    cal = graph.meta.get("calibration")
    if isinstance(cal, dict) and cal:
        shown = ["dataset", "num_prompts", "seed", "i_max", "j_max", "max_level", "nodes", "objective", "shape",
                 "score", "budget", "library_version", "date"]
        lines.append("calibration:    " + ", ".join(f"{k}={cal[k]}" for k in shown if k in cal))
        if cal.get("command"):
            lines.append(f"command:        {cal['command']}")
    total = sum(n.count for n in graph.nodes)
    lines.append("levels:")
    for lvl, ns in graph.levels().items():
        lines.append(f"  level {lvl}: {len(ns)} node(s), total count {sum(n.count for n in ns)}")
    lines.append("nodes (id  level  count  parents  pairs (i,j)):")
    for n in graph.nodes:
        share = f" ({100.0 * n.count / total:.1f}%)" if total else ""
        par = ",".join(map(str, n.parents)) or "root"
        lines.append(f"  {n.id:>3}  L{n.level:<3} {n.count:>7}{share:<9} <- {par:<10} {n.label()}")
    p = graph.projected
    if p:
        if "baseline_nfe" in p and "projected_nfe" in p:
            red = p.get("reduction")
            red_s = f" ({red:.3f}x fewer forwards, ceiling with all nodes kept)" if isinstance(red, (int, float)) else ""
            lines.append(f"projected:      NFE {p['baseline_nfe']} -> {p['projected_nfe']}{red_s}")
        shown_apart = ("baseline_nfe", "projected_nfe", "reduction", "at_budget", "candidates", "candidate_test")
        extra = {k: v for k, v in p.items() if k not in shown_apart}
        if extra:
            lines.append("                " + ", ".join(f"{k}={short(v)}" for k, v in extra.items()))
        at = p.get("at_budget")
        if isinstance(at, dict) and "reduction" in at:
            lines.append(f"at D* = {at.get('budget')}:      NFE {at.get('baseline_nfe')} -> {at.get('projected_nfe')} "
                         f"({at['reduction']:.3f}x fewer forwards, the runtime's {at.get('score')} pruning replayed on "
                         "the calibration prompts)")
        verdict = {True: "clearly more than the chain", False: "not clearly more than the chain"}
        test = p.get("candidate_test") if isinstance(p.get("candidate_test"), dict) else {}
        for c in p.get("candidates") or []:
            if isinstance(c, dict):
                said = verdict.get(c.get("clearly_more"))
                if said and isinstance(c.get("p_value"), (int, float)):  # files from before the paired test lack it
                    said += f", one-sided p = {c['p_value']:.3g} (level {test.get('level')})"
                lines.append(f"  candidate {c.get('label')}: {c.get('nodes')} nodes, max_level={c.get('max_level')}, "
                             f"score={c.get('score')}: {c.get('reduction', 0.0):.3f}x" + (f" ({said})" if said else ""))
        if test:
            lines.append(f"  candidate test: {test.get('test')}, over {test.get('prompts')} prompt(s), "
                         f"level {test.get('level')}")
    return "\n".join(lines)


def render(graph: Any, path: str | os.PathLike[str], *, dpi: int = 120, title: str | None = None) -> None:
    """Draw the DAG (layered by level, root at the left) to a PNG file, written atomically.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "rendering a draft graph needs matplotlib, which is not installed; "
            "fix: pip install 'spiffy-decoding[plot]' (or pip install matplotlib), or use `spiffy graph show`"
        ) from exc
    levels = graph.levels()
    width = max([1] + [len(v) for v in levels.values()])
    pos: dict[Any, tuple[float, float]] = {"root": (0.0, 0.0)}
    for lvl, ns in levels.items():
        k = len(ns)
        for r, n in enumerate(ns):
            pos[n.id] = (float(lvl), (k - 1) / 2.0 - r)
    fig = Figure(figsize=(2.4 + 2.2 * max(1, graph.max_level()), 1.2 + 0.75 * width), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_axis_off()
    maxc = max([1] + [n.count for n in graph.nodes])
    for n in graph.nodes:
        srcs = list(n.parents) if n.parents else ["root"]
        for s in srcs:
            (x0, y0), (x1, y1) = pos[s], pos[n.id]
            ax.annotate("", xy=(x1 - 0.12, y1), xytext=(x0 + 0.12, y0),
                        arrowprops=dict(arrowstyle="->", color="0.45", lw=0.8, shrinkA=2, shrinkB=2))
    ax.scatter([0.0], [0.0], s=500, c="0.2", zorder=3)
    ax.text(0.0, -0.38, "x_n (root)", ha="center", va="top", fontsize=8)
    for n in graph.nodes:
        x, y = pos[n.id]
        size = 150 + 550 * (n.count / maxc)
        ax.scatter([x], [y], s=size, c=[(0.2, 0.45, 0.8)], zorder=3, edgecolors="white")
        ax.text(x, y - 0.3, f"#{n.id} {n.label()}\ncount {n.count}", ha="center", va="top", fontsize=7)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(min(ys) - 0.9, max(ys) + 0.5)
    red = graph.projected.get("reduction")
    head = title or f"Spiffy draft graph: {len(graph.nodes)} nodes, {graph.max_level()} levels" + (
        f", projected {red:.2f}x fewer NFE" if isinstance(red, (int, float)) else ""
    )
    ax.set_title(head, fontsize=10)
    for lvl in range(0, graph.max_level() + 1):
        ax.text(float(lvl), max(ys) + 0.35, f"level {lvl}", ha="center", fontsize=8, color="0.35")
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"))


def _sorted_pairs(pairs: Any) -> tuple[Pair, ...]:
    try:
        return tuple(sorted(tuple(p) for p in pairs))
    except TypeError:
        return ()


__all__ = ["from_networkx", "render", "summary", "to_networkx"]
