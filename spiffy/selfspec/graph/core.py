"""The :class:`DraftGraph`: calibrated (i, j) draft formulas in topological order, with one children index."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from spiffy.errors import GraphError
from spiffy.io import atomic_write_text
from spiffy.selfspec.graph.compat import check_calibrated_for, with_model_revision
from spiffy.selfspec.graph.fileformat import parse, pretty, read_graph_file, to_json_dict
from spiffy.selfspec.graph.nodes import DraftNode, Pair, is_int, is_parent, static_tps
from spiffy.selfspec.graph.validation import validate_nodes
from spiffy.selfspec.graph.views import from_networkx, render, summary, to_networkx


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
        self.meta["calibrated_for"] = with_model_revision(self.meta["calibrated_for"])
        self.meta.setdefault("calibration", {})
        self.projected: dict[str, Any] = dict(projected or {})
        self.path: str | None = None  # file the graph was loaded from / saved to (informational)
        if validate:
            self.validate()
        self._index()

    # ------------------------------------------------------------------ lookups
    def _index(self) -> None:
        """Build the id and children indexes once per graph (the pruning and the runtime read them every step)."""
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
        self._child_ids: dict[int | None, tuple[int, ...]] = {
            key: tuple(c.id for c in kids) for key, kids in self._children.items()
        }

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

    def child_ids(self, id: int | None) -> tuple[int, ...]:
        """Ids of the children of node ``id`` in id order (``None`` = the root); ``()`` for an unknown id."""
        return self._child_ids.get(id, ())

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
    def pruning_score(self) -> str | None:
        """The pruning score the graph was calibrated for (``calibration.score``; ``None``: not recorded, the runtime
        uses ``"gm"``). See :mod:`spiffy.selfspec.pruning`."""
        cal = self.meta.get("calibration")
        score = cal.get("score") if isinstance(cal, dict) else None
        return score if isinstance(score, str) else None

    @property
    def tuned_budget(self) -> int | None:
        """The drafts per step (``D*``) the graph was tuned for (``calibration.budget``, ``spiffy calibrate
        --budget``), which the runtime keeps when not told otherwise; ``None`` when it was not tuned."""
        cal = self.meta.get("calibration")
        budget = cal.get("budget") if isinstance(cal, dict) else None
        return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None

    @property
    def tokens_per_step(self) -> int | None:
        """Uniform tokens per step of a static schedule, or ``None`` (dynamic / non-uniform / unknown)."""
        return static_tps(self.meta)

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
        validate_nodes(self.nodes, self.meta)
    # ------------------------------------------------------------------ compatibility
    def check_compatible(self, runtime: Mapping[str, Any], *, warn: bool = True) -> None:
        """Compare the graph's ``calibrated_for`` with the runtime configuration (:func:`runtime_signature`).

        Fields absent on either side are not compared; ``warn`` emits a :class:`GraphCompatibilityWarning` when a
        soft field differs (the model, compared by :func:`model_name`; the temperature).
        Raises:
            GraphMismatchError: an incompatible field differs; ``.field``, ``.graph_value``, ``.runtime_value`` name
                the first, ``.mismatches`` lists all ``(field, graph value, runtime value)``.
        """
        check_calibrated_for(self.calibrated_for, runtime, path=self.path, warn=warn)
    # ------------------------------------------------------------------ JSON
    def to_json_dict(self) -> dict[str, Any]:
        """The versioned file content as a JSON-ready dict."""
        return to_json_dict(self)
    @classmethod
    def from_json_dict(cls, d: Any, *, source: str | None = None) -> "DraftGraph":
        """Build (and validate) a graph from file content; raises :class:`GraphError` naming the problem."""
        where = f"graph file {source!r}" if source else "graph data"
        try:
            nodes, meta, projected = parse(d)
            g = cls(nodes, meta, projected)
        except GraphError as exc:
            raise GraphError(f"{where}: {exc}") from None
        g.path = source
        return g

    def to_json(self) -> str:
        """The file text (indented JSON, one line per node, trailing newline)."""
        return pretty(self.to_json_dict()) + "\n"

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
        order = sorted(range(len(items)), key=lambda k: (items[k][0] if is_int(items[k][0]) else 0, k))
        tps = static_tps(meta or {})
        protos = [DraftNode(id=new, level=items[k][0], pairs=items[k][1], count=items[k][2]) for new, k in enumerate(order)]
        nodes: list[DraftNode] = []
        by_level: dict[int, list[DraftNode]] = {}
        for n in protos:
            parents = ()
            if is_int(n.level) and n.level > 1:
                parents = tuple(a.id for a in by_level.get(n.level - 1, []) if is_parent(a, n, tps))
            node = DraftNode(id=n.id, level=n.level, pairs=n.pairs, parents=parents, count=n.count)
            nodes.append(node)
            if is_int(n.level):
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
        return to_networkx(self, include_root=include_root)
    @classmethod
    def from_networkx(cls, g: Any, meta: Mapping[str, Any] | None = None) -> "DraftGraph":
        """Inverse of :meth:`to_networkx`. Parent links come from the edges; a ``"root"`` / level-0 node is skipped.
        Node keys that are not already ``0..D-1`` in a valid order are renumbered in topological order."""
        return from_networkx(cls, g, meta)
    # ------------------------------------------------------------------ views for people
    def summary(self) -> str:
        """Human-readable text: what it was calibrated for, levels, nodes per level, counts, projected reduction."""
        return summary(self)
    def render(self, path: str | os.PathLike[str], *, dpi: int = 120, title: str | None = None) -> None:
        """Draw the DAG (layered by level, root at the left) to a PNG file, written atomically.

        Raises:
            ConfigError: matplotlib is not installed.
        """
        render(self, path, dpi=dpi, title=title)


def load_graph(path: str | os.PathLike[str]) -> DraftGraph:
    """Read, schema-check and validate a graph file; raises :class:`GraphError` saying what is wrong and where."""
    return DraftGraph.from_json_dict(read_graph_file(path), source=str(Path(path)))


__all__ = ["DraftGraph", "load_graph"]
