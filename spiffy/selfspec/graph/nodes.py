"""Draft-graph nodes: a :class:`DraftNode` is one (i, j) formula at one level; :func:`is_parent` is the link rule."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from spiffy.errors import GraphError

Pair = tuple[int, int]


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



def is_int(v: Any) -> bool:
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



def static_tps(meta: Mapping[str, Any]) -> int | None:
    """Uniform tokens per step of a static schedule from ``meta["calibrated_for"]``, or ``None``."""
    cf = meta.get("calibrated_for") if isinstance(meta, Mapping) else None
    if not isinstance(cf, Mapping):
        return None
    tps = cf.get("tokens_per_step")
    return tps if is_int(tps) and tps >= 1 else None



__all__ = ["DraftNode", "Pair", "is_int", "is_parent", "static_tps"]
