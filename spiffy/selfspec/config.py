"""``SpiffyConfig``: Spiffy's settings, beside the baseline's :class:`~spiffy.decoding.config.DecodeConfig`.

:class:`~spiffy.decoding.config.DecodeConfig` says how the baseline decodes (the rule Spiffy reproduces token for
token); :class:`SpiffyConfig` says how Spiffy speculates on top of it: which calibrated draft graph, how many of its
nodes are kept per step (the budget ``D*``) and which pruning score keeps them. Each value is resolved and validated
once, here, where it enters; the runtime reads the resolved values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spiffy.selfspec.pruning import resolve_budget, resolve_score


@dataclass(frozen=True)
class SpiffyConfig:
    """How Spiffy speculates.

    Attributes:
        graph: the calibrated :class:`~spiffy.selfspec.graph.DraftGraph` (anything with ``nodes`` of
            ``DraftNode``-like objects and ``child_ids`` works); ``None`` = no drafts (the baseline's model calls).
        budget: drafts kept per step. Given as ``None``, it resolves to the ``D*`` the graph was tuned for
            (``graph.tuned_budget``), else :data:`~spiffy.selfspec.pruning.DEFAULT_BUDGET`; ``0`` = no drafts.
            Always an integer ``>= 0`` after construction.
        score: the pruning score (:data:`~spiffy.selfspec.pruning.SCORES`). Given as ``None``, it resolves to the score
            the graph's calibration recorded, else :data:`~spiffy.selfspec.pruning.DEFAULT_SCORE`.
    Raises:
        ConfigError: a budget that is not an integer ``>= 0``, an unknown score.
    """

    graph: Any = None
    budget: int | None = None
    score: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", resolve_budget(self.budget, self.graph))
        object.__setattr__(self, "score", resolve_score(self.score, self.graph))

    @classmethod
    def of(cls, graph: Any, budget: int | None = None, score: str | None = None) -> "SpiffyConfig":
        """``graph`` as settings: a :class:`SpiffyConfig` is taken as it is (``budget``/``score`` given beside it
        replace its own), anything else is the draft graph."""
        if isinstance(graph, SpiffyConfig):
            if budget is None and score is None:
                return graph
            return cls(graph.graph, graph.budget if budget is None else budget, graph.score if score is None else score)
        return cls(graph, budget, score)

    @property
    def uses_drafts(self) -> bool:
        """Whether any draft is kept per step (a graph with nodes and a budget above 0)."""
        return self.budget > 0 and self.graph is not None and len(self.graph.nodes) > 0  # type: ignore[operator]


__all__ = ["SpiffyConfig"]
