"""Spiffy draft graphs: the calibrated DAG of (i, j) draft formulas, its versioned JSON file, and views of it.

A :class:`DraftGraph` holds ``D`` :class:`DraftNode` s in topological order (parents before children, ids
``0..D-1``). A node of level ``l`` is a formula - a set of ``(i, j)`` pairs - that guesses the state ``l``
denoising steps after the real state ``x_n`` (the root, level 0, not stored). Node ``A`` is a parent of node ``B``
iff ``B.level == A.level + 1`` and ``set(A.pairs) < set(B.pairs)`` (and, for static schedules with a uniform
``tokens_per_step`` ``S``, ``|B| - |A| == S``). Level-1 nodes are the root's children; every other node needs at
least one parent (an orphan could never be accepted).

File format (``"format": "spiffy-draft-graph"``, ``"version": 1``; JSON, human readable)::

    {
      "format": "spiffy-draft-graph",
      "version": 1,
      "calibrated_for": {"family": ..., "model": ..., ["model_revision": ...,] "config_fingerprint": ...,
                         "mask_id": ..., "block_length": ..., "steps_per_block": ..., "threshold": ...,
                         "remasking": ..., "temperature": ..., "cache": ..., "tokens_per_step": ...},
      "calibration": {"dataset": ..., "num_prompts": ..., "seed": ..., "i_max": ..., "j_max": ..., "max_level": ...,
                      "objective": ..., "library_version": ..., "date": ..., "command": ...},
      "graph": {"num_nodes": D, "max_level": L,
                "nodes": [{"id": 0, "level": 1, "pairs": [[1, 1]], "parents": [], "count": 123}, ...]},
      "projected": {"baseline_nfe": ..., "projected_nfe": ..., "reduction": ...}
    }

``model`` is a directory path or a Hub id; for a model loaded from the Hub (or from a Hugging Face cache snapshot)
it is ``ORG/NAME`` and ``model_revision`` the snapshot's commit. This module needs only the standard library
(networkx and matplotlib are imported when their views are used).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import numbers
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from spiffy.checkpoint_ref import checkpoint_name, split_reference
from spiffy.errors import ConfigError, GraphError, GraphMismatchError

Pair = tuple[int, int]

FORMAT = "spiffy-draft-graph"
VERSION = 1

#: ``calibrated_for`` fields whose difference makes a graph unusable at run time (GraphMismatchError).
INCOMPATIBLE_FIELDS: tuple[str, ...] = (
    "family",
    "config_fingerprint",
    "mask_id",
    "block_length",
    "steps_per_block",
    "threshold",
    "remasking",
    "alg",
    "strategy",
    "cache",
    "tokens_per_step",
)
#: ``calibrated_for`` fields that may differ (the graph still works; acceptance may be lower).
SOFT_FIELDS: tuple[str, ...] = ("model", "temperature")

# spellings of runtime-dict keys accepted by check_compatible -> canonical calibrated_for key
_ALIASES: dict[str, str] = {
    "cache_mode": "cache",
    "model_type": "family",
    "mask_token_id": "mask_id",
    "fingerprint": "config_fingerprint",
    "model_fingerprint": "config_fingerprint",
    "model_path": "model",
}

# CLI flag a user changes to recalibrate for a differing field (used in error messages)
_FIELD_FLAGS: dict[str, str] = {
    "block_length": "--block-length",
    "steps_per_block": "--steps",
    "threshold": "--threshold",
    "remasking": "--remasking",
    "alg": "--alg",
    "strategy": "--strategy",
    "cache": "--cache",
    "tokens_per_step": "--steps / --threshold",
    "temperature": "--temperature",
}


class GraphCompatibilityWarning(UserWarning):
    """A graph is usable at run time but was calibrated under a different soft setting (model path, temperature)."""


# ---------------------------------------------------------------------------------------------------------- nodes
@dataclass(frozen=True)
class DraftNode:
    """One node of a draft graph.

    Attributes:
        id: ``0..D-1``, unique; parents have smaller ids (topological order).
        level: ``>= 1``; denoising steps ahead of the real state (the root, level 0, is not stored).
        pairs: sorted ``(i, j)`` pairs with distinct position ranks ``i``: 1-based position rank ``i`` and 1-based
            token rank ``j`` under the latest distribution ``P``; the tokens this node's state unmasks relative to
            the real state ``x_n``.
        parents: ids of the parent nodes (one level up); ``()`` for level 1.
        count: calibration frequency (how many recorded steps produced this formula at this level).
    """

    id: int
    level: int
    pairs: tuple[Pair, ...]
    parents: tuple[int, ...] = ()
    count: int = 0

    def __post_init__(self) -> None:
        # normalise containers (lists from JSON / networkx) to tuples; the values are checked by validate()
        try:
            pairs = tuple(tuple(_as_int(v) for v in p) for p in self.pairs)
        except TypeError as exc:
            raise GraphError(f"node {self.id!r}: pairs must be a sequence of (i, j) pairs, got {self.pairs!r}") from exc
        object.__setattr__(self, "pairs", pairs)
        try:
            parents = tuple(_as_int(p) for p in self.parents)
        except TypeError as exc:
            raise GraphError(f"node {self.id!r}: parents must be a sequence of node ids, got {self.parents!r}") from exc
        object.__setattr__(self, "parents", parents)

    @property
    def size(self) -> int:
        """Number of tokens the node unmasks relative to the real state."""
        return len(self.pairs)

    @property
    def key(self) -> tuple[int, tuple[Pair, ...]]:
        """``(level, pairs)``: what identifies the formula independently of its id."""
        return (self.level, self.pairs)

    def label(self) -> str:
        """Compact text form, e.g. ``"(1,1)(2,1)"``."""
        return "".join(f"({i},{j})" for i, j in self.pairs)


def _as_int(v: Any) -> Any:
    """numpy / torch integer scalars -> int; anything else unchanged (validate() reports it)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
        return int(v)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_parent(a: DraftNode, b: DraftNode, tokens_per_step: int | None = None) -> bool:
    """Whether ``a`` is a parent of ``b``: one level up, a strict subset, and (static schedules with a uniform
    ``tokens_per_step``) exactly ``tokens_per_step`` tokens fewer."""
    if b.level != a.level + 1:
        return False
    sa, sb = set(a.pairs), set(b.pairs)
    if not sa < sb:
        return False
    if tokens_per_step is not None and len(sb) - len(sa) != tokens_per_step:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------- graph
class DraftGraph:
    """A calibrated draft graph (see the module docstring for the structure and the file format).

    Args:
        nodes: the nodes, parents before children, ids ``0..D-1`` in list order.
        meta: the ``"calibrated_for"`` and ``"calibration"`` sections (and any other top-level file sections).
        projected: projected savings of the calibration (``baseline_nfe``, ``projected_nfe``, ``reduction``, ...).
        validate: check the structure now (raises :class:`GraphError`).
    """

    def __init__(
        self,
        nodes: Iterable[DraftNode],
        meta: Mapping[str, Any] | None = None,
        projected: Mapping[str, Any] | None = None,
        *,
        validate: bool = True,
    ) -> None:
        self.nodes: list[DraftNode] = list(nodes)
        self.meta: dict[str, Any] = dict(meta or {})
        self.meta.setdefault("calibrated_for", {})  # the file always has both sections
        self.meta["calibrated_for"] = _with_model_revision(self.meta["calibrated_for"])
        self.meta.setdefault("calibration", {})
        self.projected: dict[str, Any] = dict(projected or {})
        self.path: str | None = None  # file the graph was loaded from / saved to (informational)
        if validate:
            self.validate()
        self._index()

    # ------------------------------------------------------------------ lookups
    def _index(self) -> None:
        self._by_id: dict[int, DraftNode] = {}
        self._children: dict[int | None, list[DraftNode]] = {None: []}
        for n in self.nodes:
            self._by_id[n.id] = n
            self._children.setdefault(n.id, [])
        for n in self.nodes:
            if n.level == 1 and not n.parents:
                self._children[None].append(n)
            for p in n.parents:
                self._children.setdefault(p, []).append(n)

    def node(self, id: int) -> DraftNode:
        """The node with id ``id`` (KeyError if absent)."""
        try:
            return self._by_id[id]
        except KeyError:
            raise KeyError(f"draft graph has no node {id!r} (ids are 0..{len(self.nodes) - 1})") from None

    def children(self, id: int | None) -> list[DraftNode]:
        """Children of node ``id`` in id order; ``None`` = the root (the real state): the level-1 nodes."""
        if id is not None and id not in self._by_id:
            raise KeyError(f"draft graph has no node {id!r} (ids are 0..{len(self.nodes) - 1})")
        return list(self._children.get(id, []))

    def parents(self, id: int) -> list[DraftNode]:
        """Parent nodes of node ``id``."""
        return [self._by_id[p] for p in self.node(id).parents]

    def level1(self) -> list[DraftNode]:
        """The level-1 nodes (children of the root)."""
        return [n for n in self.nodes if n.level == 1]

    def max_level(self) -> int:
        """Deepest level (0 for an empty graph)."""
        return max((n.level for n in self.nodes), default=0)

    def levels(self) -> dict[int, list[DraftNode]]:
        """``{level: nodes of that level}`` in level order."""
        out: dict[int, list[DraftNode]] = {}
        for n in sorted(self.nodes, key=lambda n: (n.level, n.id)):
            out.setdefault(n.level, []).append(n)
        return out

    def find(self, level: int, pairs: Iterable[Pair]) -> DraftNode | None:
        """The node with this level and pair set, if any."""
        key = (int(level), tuple(sorted(tuple(p) for p in pairs)))
        for n in self.nodes:
            if n.key == key:
                return n
        return None

    @property
    def calibrated_for(self) -> dict[str, Any]:
        """The ``"calibrated_for"`` section (empty dict if absent)."""
        cf = self.meta.get("calibrated_for")
        return cf if isinstance(cf, dict) else {}

    @property
    def tokens_per_step(self) -> int | None:
        """Uniform tokens per step of a static schedule, or ``None`` (dynamic / non-uniform / unknown)."""
        return _static_tps(self.meta)

    @property
    def i_max(self) -> int:
        """Largest position rank any node uses (0 if empty)."""
        return max((i for n in self.nodes for i, _ in n.pairs), default=0)

    @property
    def j_max(self) -> int:
        """Largest token rank any node uses (0 if empty)."""
        return max((j for n in self.nodes for _, j in n.pairs), default=0)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[DraftNode]:
        return iter(self.nodes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftGraph):
            return NotImplemented
        return self.nodes == other.nodes and self.meta == other.meta and self.projected == other.projected

    def __repr__(self) -> str:
        per_level = {lvl: len(ns) for lvl, ns in self.levels().items()}
        return f"DraftGraph({len(self.nodes)} nodes, nodes per level {per_level})"

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the structure; raises :class:`GraphError` saying what is wrong, where, and how to fix it.

        Checks: node types, unique ids ``0..D-1`` in list order, levels ``>= 1``, pairs (non-empty, sorted,
        ranks ``>= 1``, distinct position ranks), no duplicate formulas, parents exist, no cycles, every parent
        one level up and a strict subset (static schedules: sizes grow by ``tokens_per_step``), no orphans,
        parents listed before children.
        """
        nodes = self.nodes
        tps = _static_tps(self.meta)
        fix_regen = "fix: regenerate the graph with `spiffy calibrate` (or build it with DraftGraph.from_formulas)"
        ids: dict[Any, int] = {}
        for k, n in enumerate(nodes):
            if not isinstance(n, DraftNode):
                raise GraphError(f"entry {k} of the node list is a {type(n).__name__}, not a DraftNode; fix: build DraftNode objects")
            if not _is_int(n.id) or n.id < 0:
                raise GraphError(f"node at index {k}: id {n.id!r} must be an integer >= 0; {fix_regen}")
            if n.id in ids:
                raise GraphError(f"node id {n.id} appears twice (indices {ids[n.id]} and {k}); node ids must be unique; {fix_regen}")
            ids[n.id] = k
        # parents exist; cycles (reported before ordering problems, which a cycle always also causes)
        for n in nodes:
            for p in n.parents:
                if not _is_int(p):
                    raise GraphError(f"node {n.id}: parent id {p!r} is not an integer; {fix_regen}")
                if p not in ids:
                    raise GraphError(f"node {n.id}: parent {p} does not exist (orphaned link); {fix_regen}")
                if p == n.id:
                    raise GraphError(f"node {n.id} is its own parent (cycle {n.id} -> {n.id}); the graph must be acyclic; {fix_regen}")
        cycle = _find_cycle({n.id: n.parents for n in nodes})
        if cycle:
            path = " -> ".join(str(c) for c in cycle)
            raise GraphError(f"cycle in the parent links: {path}; a draft graph must be acyclic; {fix_regen}")
        seen_keys: dict[tuple[int, tuple[Pair, ...]], int] = {}
        for k, n in enumerate(nodes):
            where = f"node {n.id}"
            if not _is_int(n.level) or n.level < 1:
                raise GraphError(
                    f"{where}: bad level {n.level!r}; levels are integers >= 1 (the root, level 0, is implicit); {fix_regen}"
                )
            if not n.pairs:
                raise GraphError(f"{where}: no (i, j) pairs; a draft node unmasks at least one token; {fix_regen}")
            for pair in n.pairs:
                if len(pair) != 2 or not all(_is_int(v) for v in pair):
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
            if not _is_int(n.count) or n.count < 0:
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

    # ------------------------------------------------------------------ compatibility
    def check_compatible(self, runtime: Mapping[str, Any], *, warn: bool = True) -> None:
        """Compare the graph's ``calibrated_for`` with the runtime configuration.

        Args:
            runtime: runtime values keyed like ``calibrated_for`` (e.g. from
                :func:`spiffy.selfspec.calibrate.runtime_signature`); fields absent on either side are not compared.
            warn: emit a :class:`GraphCompatibilityWarning` when a soft field differs (the model, compared by
                :func:`model_name`; the temperature).
        Raises:
            GraphMismatchError: an incompatible field differs; ``.field``, ``.graph_value``, ``.runtime_value`` name
                the first, ``.mismatches`` lists all ``(field, graph value, runtime value)``.
        """
        cf = _normalize(self.calibrated_for)
        rt = _normalize(runtime)
        if cf.get("threshold") is not None and rt.get("threshold") is not None:
            # the step count does not shape threshold decoding (blocks end when fully unmasked)
            cf.pop("steps_per_block", None)
            rt.pop("steps_per_block", None)
        mismatches = [
            (f, cf[f], rt[f]) for f in INCOMPATIBLE_FIELDS if f in cf and f in rt and not _same(cf[f], rt[f])
        ]
        if mismatches:
            where = f"graph {self.path!r}" if self.path else "the draft graph"
            diffs = "; ".join(f"{f}: graph {g!r} vs runtime {r!r}" for f, g, r in mismatches)
            flags = sorted({_FIELD_FLAGS[f] for f, _, _ in mismatches if f in _FIELD_FLAGS})
            model = rt.get("model") or "MODEL_DIR"
            hint = f" (set {', '.join(flags)} like this run)" if flags else ""
            err = GraphMismatchError(
                f"{where} was calibrated for another model or decoding configuration - {diffs}; "
                f"fix: recalibrate with `spiffy calibrate --model {model} --prompts default --out NEW_GRAPH.json` "
                f"using this run's decoding flags{hint}, or pass a graph calibrated for this configuration"
            )
            err.field, err.graph_value, err.runtime_value = mismatches[0]  # type: ignore[attr-defined]
            err.mismatches = mismatches  # type: ignore[attr-defined]
            raise err
        if warn:
            soft = [(f, cf[f], rt[f]) for f in SOFT_FIELDS if f in cf and f in rt and not _same_soft(f, cf[f], rt[f])]
            if soft:
                diffs = "; ".join(f"{f}: graph {g!r} vs runtime {r!r}" for f, g, r in soft)
                warnings.warn(
                    f"draft graph calibrated under different settings ({diffs}); decoding stays lossless, "
                    "acceptance may be lower - recalibrate with `spiffy calibrate` for the best speedup",
                    GraphCompatibilityWarning,
                    stacklevel=2,
                )

    # ------------------------------------------------------------------ JSON
    def to_json_dict(self) -> dict[str, Any]:
        """The versioned file content as a JSON-ready dict."""
        meta = copy.deepcopy(self.meta)
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        d["calibrated_for"] = meta.pop("calibrated_for", {})
        d["calibration"] = meta.pop("calibration", {})
        for k, v in meta.items():
            d[k] = v
        d["graph"] = {
            "num_nodes": len(self.nodes),
            "max_level": self.max_level(),
            "nodes": [
                {
                    "id": n.id,
                    "level": n.level,
                    "pairs": [list(p) for p in n.pairs],
                    "parents": list(n.parents),
                    "count": n.count,
                }
                for n in self.nodes
            ],
        }
        d["projected"] = copy.deepcopy(self.projected)
        return d

    @classmethod
    def from_json_dict(cls, d: Any, *, source: str | None = None) -> "DraftGraph":
        """Build (and validate) a graph from file content; raises :class:`GraphError` naming the problem."""
        where = f"graph file {source!r}" if source else "graph data"
        try:
            nodes, meta, projected = _parse(d)
            g = cls(nodes, meta, projected)
        except GraphError as exc:
            raise GraphError(f"{where}: {exc}") from None
        g.path = source
        return g

    def to_json(self) -> str:
        """The file text (indented JSON, one line per node, trailing newline)."""
        return _pretty(self.to_json_dict()) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graph file atomically (temp file in the same directory, then ``os.replace``)."""
        text = self.to_json()
        atomic_write_text(path, text)
        self.path = str(path)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_formulas(
        cls,
        formulas: Sequence[tuple[int, Iterable[Pair]]],
        meta: Mapping[str, Any] | None = None,
        counts: Sequence[int] | Mapping[tuple[int, tuple[Pair, ...]], int] | None = None,
        projected: Mapping[str, Any] | None = None,
    ) -> "DraftGraph":
        """Build a graph from ``(level, pairs)`` formulas, computing every parent link.

        ``A`` is a parent of ``B`` iff ``B.level == A.level + 1``, ``set(A.pairs) < set(B.pairs)`` and, when
        ``meta["calibrated_for"]["tokens_per_step"]`` is an int ``S``, ``|B| - |A| == S``.

        Args:
            formulas: ``(level, pairs)``; pairs in any order (they are sorted). Nodes are numbered by level, keeping
                the given order inside a level.
            meta: ``calibrated_for`` / ``calibration`` sections.
            counts: calibration frequencies, aligned with ``formulas`` or keyed by ``(level, sorted pairs)``.
            projected: projected savings.
        Raises:
            GraphError: invalid formulas, duplicates, or a formula without any parent (orphan).
        """
        items: list[tuple[int, tuple[Pair, ...], int]] = []
        for k, f in enumerate(formulas):
            try:
                level, pairs = f
                key_pairs = tuple(sorted((int(i), int(j)) for i, j in pairs))
            except (TypeError, ValueError) as exc:
                raise GraphError(f"formula {k}: expected (level, pairs) with integer (i, j) pairs, got {f!r}") from exc
            if counts is None:
                c = 0
            elif isinstance(counts, Mapping):
                c = int(counts.get((level, key_pairs), 0))
            else:
                c = int(counts[k])
            items.append((level, key_pairs, c))
        order = sorted(range(len(items)), key=lambda k: (items[k][0] if _is_int(items[k][0]) else 0, k))
        tps = _static_tps(meta or {})
        protos = [DraftNode(id=new, level=items[k][0], pairs=items[k][1], count=items[k][2]) for new, k in enumerate(order)]
        nodes: list[DraftNode] = []
        by_level: dict[int, list[DraftNode]] = {}
        for n in protos:
            parents = ()
            if _is_int(n.level) and n.level > 1:
                parents = tuple(a.id for a in by_level.get(n.level - 1, []) if is_parent(a, n, tps))
            node = DraftNode(id=n.id, level=n.level, pairs=n.pairs, parents=parents, count=n.count)
            nodes.append(node)
            if _is_int(n.level):
                by_level.setdefault(n.level, []).append(node)
        return cls(nodes, meta, projected)

    def subgraph(self, ids: Iterable[int]) -> "DraftGraph":
        """A parent-closed subset of the nodes as a new graph (renumbered; links recomputed among the kept nodes)."""
        keep = sorted(set(ids))
        return DraftGraph.from_formulas(
            [(self.node(i).level, self.node(i).pairs) for i in keep],
            meta=self.meta,
            counts=[self.node(i).count for i in keep],
        )

    # ------------------------------------------------------------------ networkx
    def to_networkx(self, *, include_root: bool = False) -> Any:
        """A ``networkx.DiGraph``: nodes keyed by id with attributes ``level``, ``pairs``, ``count``; edges
        parent -> child. ``graph.graph`` carries ``meta`` and ``projected``. ``include_root`` adds node ``"root"``
        (level 0) with edges to the level-1 nodes."""
        nx = _networkx()
        g = nx.DiGraph()
        g.graph["meta"] = copy.deepcopy(self.meta)
        g.graph["projected"] = copy.deepcopy(self.projected)
        if include_root:
            g.add_node("root", level=0, pairs=(), count=0, root=True)
        for n in self.nodes:
            g.add_node(n.id, level=n.level, pairs=n.pairs, count=n.count)
        for n in self.nodes:
            for p in n.parents:
                g.add_edge(p, n.id)
            if include_root and n.level == 1:
                g.add_edge("root", n.id)
        return g

    @classmethod
    def from_networkx(cls, g: Any, meta: Mapping[str, Any] | None = None) -> "DraftGraph":
        """Inverse of :meth:`to_networkx`. Parent links come from the edges; a ``"root"`` / level-0 node is skipped.
        Node keys that are not already ``0..D-1`` in a valid order are renumbered in topological order."""
        nx = _networkx()
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
        ident = all(_is_int(k) for k in keys) and sorted(keys) == list(range(len(keys)))
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

    # ------------------------------------------------------------------ views for people
    def summary(self) -> str:
        """Human-readable text: what it was calibrated for, levels, nodes per level, counts, projected reduction."""
        lines = [f"Spiffy draft graph: {len(self.nodes)} node(s), {self.max_level()} level(s)" + (f"  [{self.path}]" if self.path else "")]
        cf = self.calibrated_for
        if cf:
            shown = ["family", "model", "model_revision", "config_fingerprint", "mask_id", "block_length",
                     "steps_per_block", "threshold", "remasking", "alg", "strategy", "temperature", "cache", "tokens_per_step"]
            parts = [f"{k}={cf[k]}" for k in shown if k in cf]
            lines.append("calibrated for: " + ", ".join(parts))
        cal = self.meta.get("calibration")
        if isinstance(cal, dict) and cal:
            shown = ["dataset", "num_prompts", "seed", "i_max", "j_max", "max_level", "objective", "library_version", "date"]
            lines.append("calibration:    " + ", ".join(f"{k}={cal[k]}" for k in shown if k in cal))
            if cal.get("command"):
                lines.append(f"command:        {cal['command']}")
        total = sum(n.count for n in self.nodes)
        lines.append("levels:")
        for lvl, ns in self.levels().items():
            lines.append(f"  level {lvl}: {len(ns)} node(s), total count {sum(n.count for n in ns)}")
        lines.append("nodes (id  level  count  parents  pairs (i,j)):")
        for n in self.nodes:
            share = f" ({100.0 * n.count / total:.1f}%)" if total else ""
            par = ",".join(map(str, n.parents)) or "root"
            lines.append(f"  {n.id:>3}  L{n.level:<3} {n.count:>7}{share:<9} <- {par:<10} {n.label()}")
        p = self.projected
        if p:
            if "baseline_nfe" in p and "projected_nfe" in p:
                red = p.get("reduction")
                red_s = f" ({red:.3f}x fewer forwards, ceiling with all nodes kept)" if isinstance(red, (int, float)) else ""
                lines.append(f"projected:      NFE {p['baseline_nfe']} -> {p['projected_nfe']}{red_s}")
            extra = {k: v for k, v in p.items() if k not in ("baseline_nfe", "projected_nfe", "reduction")}
            if extra:
                lines.append("                " + ", ".join(f"{k}={_short(v)}" for k, v in extra.items()))
        return "\n".join(lines)

    def render(self, path: str | os.PathLike[str], *, dpi: int = 120, title: str | None = None) -> None:
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
        levels = self.levels()
        width = max([1] + [len(v) for v in levels.values()])
        pos: dict[Any, tuple[float, float]] = {"root": (0.0, 0.0)}
        for lvl, ns in levels.items():
            k = len(ns)
            for r, n in enumerate(ns):
                pos[n.id] = (float(lvl), (k - 1) / 2.0 - r)
        fig = Figure(figsize=(2.4 + 2.2 * max(1, self.max_level()), 1.2 + 0.75 * width), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.set_axis_off()
        maxc = max([1] + [n.count for n in self.nodes])
        for n in self.nodes:
            srcs = list(n.parents) if n.parents else ["root"]
            for s in srcs:
                (x0, y0), (x1, y1) = pos[s], pos[n.id]
                ax.annotate("", xy=(x1 - 0.12, y1), xytext=(x0 + 0.12, y0),
                            arrowprops=dict(arrowstyle="->", color="0.45", lw=0.8, shrinkA=2, shrinkB=2))
        ax.scatter([0.0], [0.0], s=500, c="0.2", zorder=3)
        ax.text(0.0, -0.38, "x_n (root)", ha="center", va="top", fontsize=8)
        for n in self.nodes:
            x, y = pos[n.id]
            size = 150 + 550 * (n.count / maxc)
            ax.scatter([x], [y], s=size, c=[(0.2, 0.45, 0.8)], zorder=3, edgecolors="white")
            ax.text(x, y - 0.3, f"#{n.id} {n.label()}\ncount {n.count}", ha="center", va="top", fontsize=7)
        xs = [p[0] for p in pos.values()]
        ys = [p[1] for p in pos.values()]
        ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
        ax.set_ylim(min(ys) - 0.9, max(ys) + 0.5)
        red = self.projected.get("reduction")
        head = title or f"Spiffy draft graph: {len(self.nodes)} nodes, {self.max_level()} levels" + (
            f", projected {red:.2f}x fewer NFE" if isinstance(red, (int, float)) else ""
        )
        ax.set_title(head, fontsize=10)
        for lvl in range(0, self.max_level() + 1):
            ax.text(float(lvl), max(ys) + 0.35, f"level {lvl}", ha="center", fontsize=8, color="0.35")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
        try:
            with os.fdopen(fd, "wb") as fh:
                fig.savefig(fh, format="png")
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise


# ---------------------------------------------------------------------------------------------------------- fingerprint
#: model-config fields that define the architecture (union over LLaDA / Dream / SDAR spellings); a graph's
#: ``config_fingerprint`` hashes the ones a config has, so unrelated bookkeeping (dtype, paths, transformers
#: version, generation defaults) never changes it.
ARCH_FIELDS: tuple[str, ...] = (
    "model_type", "vocab_size", "embedding_size", "d_model", "hidden_size", "n_layers", "num_hidden_layers",
    "n_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads", "multi_query_attention", "head_dim",
    "mlp_ratio", "mlp_hidden_size", "intermediate_size", "activation_type", "hidden_act", "block_type", "rope",
    "rope_theta", "alibi", "layer_norm_type", "rms_norm_eps", "include_bias", "include_qkv_bias", "attention_bias",
    "weight_tying", "tie_word_embeddings", "scale_logits", "input_emb_norm", "attention_layer_norm",
    "max_sequence_length", "max_position_embeddings", "use_sliding_window", "mask_token_id", "block_size",
)


def model_config_fingerprint(model_or_config: Any) -> str:
    """Stable 16-hex-digit hash of a model config's architecture fields (:data:`ARCH_FIELDS`).

    Args:
        model_or_config: a model (its ``.config`` is used), a transformers config object, or a plain dict.
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    if isinstance(cfg, Mapping):
        get = cfg.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(cfg, name, default)
    aliases = set(getattr(cfg, "attribute_map", {}) or {}) if not isinstance(cfg, Mapping) else set()
    values: dict[str, Any] = {}
    for name in ARCH_FIELDS:
        if name in aliases:  # e.g. LLaDA's hidden_size -> d_model: hash the stored spelling only
            continue
        v = get(name, None)
        if name == "rope_theta" and v is None:
            rp = get("rope_parameters", None)
            if isinstance(rp, Mapping):
                v = rp.get("rope_theta")
        if v is None:
            continue
        values[name] = _canon(v)
    if isinstance(values.get("model_type"), str):
        values["model_type"] = values["model_type"].lower()
    payload = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def _canon(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return float(v)  # 5e5 and 500000 hash alike
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return str(v)


# ---------------------------------------------------------------------------------------------------------- files
def load_graph(path: str | os.PathLike[str]) -> DraftGraph:
    """Read, schema-check and validate a graph file; raises :class:`GraphError` saying what is wrong and where."""
    p = Path(path)
    if not p.exists():
        raise GraphError(
            f"graph file {str(p)!r} does not exist; fix: check the path, or create one with "
            "`spiffy calibrate --model MODEL_DIR --prompts default --out graph.json`"
        )
    if p.is_dir():
        raise GraphError(f"graph path {str(p)!r} is a directory; fix: pass the .json graph file itself")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise GraphError(f"graph file {str(p)!r} is not UTF-8 text ({exc}); fix: pass a JSON graph written by `spiffy calibrate`") from None
    except OSError as exc:
        raise GraphError(f"graph file {str(p)!r} cannot be read ({exc}); fix: check its permissions") from None
    if not text.strip():
        raise GraphError(f"graph file {str(p)!r} is empty; fix: recalibrate with `spiffy calibrate ... --out {p.name}`")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        stripped = len(text.rstrip())
        if exc.pos >= stripped - 1 or "Unterminated string" in exc.msg:
            raise GraphError(
                f"graph file {str(p)!r} is truncated: the JSON ends early (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                "fix: the file was cut off - recalibrate or restore it from a copy"
            ) from None
        raise GraphError(
            f"graph file {str(p)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "fix: restore the file or recalibrate with `spiffy calibrate`"
        ) from None
    return DraftGraph.from_json_dict(data, source=str(p))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same directory, fsync, then ``os.replace``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        _unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------------------- helpers
def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _networkx() -> Any:
    try:
        import networkx as nx
    except ImportError as exc:  # pragma: no cover - networkx is a dependency
        raise ConfigError("networkx is not installed; fix: pip install networkx") from exc
    return nx


def _sorted_pairs(pairs: Any) -> tuple[Pair, ...]:
    try:
        return tuple(sorted(tuple(p) for p in pairs))
    except TypeError:
        return ()


def _static_tps(meta: Mapping[str, Any]) -> int | None:
    cf = meta.get("calibrated_for") if isinstance(meta, Mapping) else None
    if not isinstance(cf, Mapping):
        return None
    tps = cf.get("tokens_per_step")
    return tps if _is_int(tps) and tps >= 1 else None


def _find_cycle(parents: Mapping[int, Sequence[int]]) -> list[int] | None:
    """A cycle in the parent relation as ``[a, b, ..., a]`` (child -> parent direction), or ``None``."""
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    for start in parents:
        if state.get(start):
            continue
        stack: list[tuple[int, Iterator[int]]] = [(start, iter(parents.get(start, ())))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            if nxt not in parents:
                continue
            s = state.get(nxt)
            if s == 1:
                return path[path.index(nxt):] + [nxt]
            if s is None:
                state[nxt] = 1
                stack.append((nxt, iter(parents.get(nxt, ()))))
                path.append(nxt)
    return None


def _normalize(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dict(d).items():
        out.setdefault(_ALIASES.get(k, k), v)
    if isinstance(out.get("family"), str):
        out["family"] = out["family"].lower()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def model_name(path_or_id: Any) -> Any:
    """The name a graph's ``model`` field is compared by: the last component of a directory path or hub id
    (``/a/b/tiny-llada`` and ``C:\\x\\tiny-llada`` -> ``tiny-llada``; ``GSAI-ML/LLaDA-8B-Instruct``, with any
    ``@REVISION``, and its cache snapshot ``.../models--GSAI-ML--LLaDA-8B-Instruct/snapshots/COMMIT`` ->
    ``LLaDA-8B-Instruct``), so the same checkpoint in another checkout or cache directory is the same model."""
    return checkpoint_name(path_or_id)


def _with_model_revision(calibrated_for: Any) -> Any:
    """``calibrated_for`` with a Hub reference in ``model`` (``ORG/NAME@COMMIT`` or a cache snapshot path) split
    into ``model: ORG/NAME`` and ``model_revision: COMMIT`` (placed right after it); anything else unchanged."""
    if not isinstance(calibrated_for, dict) or "model_revision" in calibrated_for:
        return calibrated_for
    model, revision = split_reference(calibrated_for.get("model"))
    if revision is None:
        return calibrated_for
    out: dict[str, Any] = {}
    for key, value in calibrated_for.items():
        out[key] = model if key == "model" else value
        if key == "model":
            out["model_revision"] = revision
    return out


def _same_soft(field_name: str, a: Any, b: Any) -> bool:
    if field_name == "model":
        return model_name(a) == model_name(b)
    return _same(a, b)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _require(d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise GraphError(f"{where}: missing field {key!r}; fix: the file is incomplete - recalibrate with `spiffy calibrate`")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise GraphError(f"{where}: field {key!r} must be {names}, got {type(v).__name__} {_short(v)}")
    return v


def _parse(d: Any) -> tuple[list[DraftNode], dict[str, Any], dict[str, Any]]:
    if not isinstance(d, dict):
        raise GraphError(f"top level must be a JSON object, got {type(d).__name__}; fix: pass a graph written by `spiffy calibrate`")
    fmt = d.get("format")
    if fmt != FORMAT:
        raise GraphError(
            f"field 'format' is {fmt!r}, expected {FORMAT!r}; this is not a spiffy draft-graph file "
            "(fix: pass a file written by `spiffy calibrate`)"
        )
    if "version" not in d:
        raise GraphError("missing field 'version'; fix: the file is incomplete - recalibrate with `spiffy calibrate`")
    ver = d["version"]
    if not _is_int(ver):
        raise GraphError(f"field 'version' must be an integer, got {ver!r}")
    if ver > VERSION:
        raise GraphError(
            f"graph file version {ver} is newer than this spiffy supports (version {VERSION}); fix: upgrade spiffy, "
            "or recalibrate with this version"
        )
    if ver != VERSION:
        raise GraphError(f"graph file version {ver} is not supported (expected {VERSION}); fix: recalibrate with `spiffy calibrate`")
    cal_for = _require(d, "calibrated_for", dict, "top level")
    cal = d.get("calibration", {})
    if not isinstance(cal, dict):
        raise GraphError(f"field 'calibration' must be an object, got {type(cal).__name__}")
    projected = d.get("projected", {})
    if not isinstance(projected, dict):
        raise GraphError(f"field 'projected' must be an object, got {type(projected).__name__}")
    graph = _require(d, "graph", dict, "top level")
    raw_nodes = _require(graph, "nodes", list, "section 'graph'")
    if "num_nodes" in graph and graph["num_nodes"] != len(raw_nodes):
        raise GraphError(
            f"section 'graph': num_nodes is {graph['num_nodes']!r} but {len(raw_nodes)} node(s) are listed; "
            "fix: the file was edited or cut - recalibrate"
        )
    nodes: list[DraftNode] = []
    for k, rn in enumerate(raw_nodes):
        where = f"graph.nodes[{k}]"
        if not isinstance(rn, dict):
            raise GraphError(f"{where} must be an object, got {type(rn).__name__}")
        nid = _require(rn, "id", int, where)
        where = f"{where} (id {nid})"
        level = _require(rn, "level", int, where)
        pairs = _require(rn, "pairs", list, where)
        parents = _require(rn, "parents", list, where)
        count = rn.get("count", 0)
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2 or not all(_is_int(v) for v in pair):
                raise GraphError(f"{where}: pair {_short(pair)} must be a list of two integers [i, j]")
        for p in parents:
            if not _is_int(p):
                raise GraphError(f"{where}: parent {_short(p)} must be an integer node id")
        if not _is_int(count):
            raise GraphError(f"{where}: count {_short(count)} must be an integer")
        nodes.append(DraftNode(id=nid, level=level, pairs=tuple(tuple(p) for p in pairs), parents=tuple(parents), count=count))
    if "max_level" in graph and graph["max_level"] != max((n.level for n in nodes), default=0):
        raise GraphError(f"section 'graph': max_level {graph['max_level']!r} does not match the nodes; fix: recalibrate")
    meta: dict[str, Any] = {"calibrated_for": cal_for, "calibration": cal}
    for k, v in d.items():
        if k not in ("format", "version", "calibrated_for", "calibration", "graph", "projected"):
            meta[k] = v
    return nodes, meta, projected


def _is_compact(v: Any) -> bool:
    """Scalars, and lists/dicts of scalars or of lists of scalars, print on one line."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return True
    if isinstance(v, list):
        return all(isinstance(x, (str, int, float, bool)) or x is None or (isinstance(x, list) and all(not isinstance(y, (list, dict)) for y in x)) for x in v)
    return False


def _pretty(v: Any, indent: int = 0) -> str:
    """Indented JSON with short lists and node records on single lines."""
    pad = "  " * indent
    if isinstance(v, dict):
        if not v:
            return "{}"
        if indent >= 2 and all(_is_compact(x) for x in v.values()) and len(json.dumps(v, ensure_ascii=False)) <= 160:
            return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        items = [f'{pad}  {json.dumps(str(k), ensure_ascii=False)}: {_pretty(x, indent + 1)}' for k, x in v.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(v, list):
        if not v:
            return "[]"
        if _is_compact(v) and len(json.dumps(v, ensure_ascii=False)) <= 160:
            return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
        items = [f"{pad}  {_pretty(x, indent + 1)}" for x in v]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(v, ensure_ascii=False)


__all__ = [
    "FORMAT",
    "VERSION",
    "INCOMPATIBLE_FIELDS",
    "SOFT_FIELDS",
    "Pair",
    "DraftNode",
    "DraftGraph",
    "GraphCompatibilityWarning",
    "is_parent",
    "load_graph",
    "model_config_fingerprint",
    "ARCH_FIELDS",
    "atomic_write_text",
]
