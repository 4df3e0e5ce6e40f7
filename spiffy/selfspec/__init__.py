"""Spiffy self-speculation for diffusion LLMs: (i, j) formulas, calibrated draft graphs, pruning, the runtime.

Modules:

* :mod:`spiffy.selfspec.formulas`: ranking of the latest distribution and instantiation of formulas (shared by
  calibration and runtime).
* :mod:`spiffy.selfspec.pruning`: per-step node scores (``gm`` default, ``reach`` for graphs with branches) and
  parent-closed top-``budget`` selection.
* :mod:`spiffy.selfspec.config`: :class:`SpiffyConfig`, Spiffy's settings (graph, budget, pruning score) beside the
  baseline's ``DecodeConfig``.
* :mod:`spiffy.selfspec.runtime`: :func:`speculative_generate_batch`, the exact one-forward verification loop over a
  batch, and :func:`speculative_generate`, its batch of one.
* :mod:`spiffy.selfspec.oracle`: oracle / random graphs for tests and benchmarks.
* :mod:`spiffy.selfspec.rivals`: the training-free rivals as draft graphs, FreeDave (:mod:`spiffy.selfspec.freedave`)
  and SSD (:mod:`spiffy.selfspec.ssd`): ``generate(model, ids, config, graph=ssd_graph(model, config, K))``.
* :mod:`spiffy.selfspec.graph`, :mod:`spiffy.selfspec.calibrate`: draft-graph objects/files and calibration
  (import ``calibrate`` from its module).
* :mod:`spiffy.selfspec.tune`: the runtime's pruning replayed on calibration trajectories, and the choice of graph
  shape and score for a budget ``D*`` (``calibrate(..., budget=D*)``).

Names are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "Ranking": "spiffy.selfspec.formulas",
    "rank_state": "spiffy.selfspec.formulas",
    "instantiate": "spiffy.selfspec.formulas",
    "instantiate_many": "spiffy.selfspec.formulas",
    "pair_probs": "spiffy.selfspec.formulas",
    "prune": "spiffy.selfspec.pruning",
    "node_scores": "spiffy.selfspec.pruning",
    "SCORES": "spiffy.selfspec.pruning",
    "SpiffyConfig": "spiffy.selfspec.config",
    "speculative_generate": "spiffy.selfspec.runtime",
    "speculative_generate_batch": "spiffy.selfspec.runtime",
    "SpeculativeStats": "spiffy.selfspec.runtime",
    "oracle_graph": "spiffy.selfspec.oracle",
    "random_graph": "spiffy.selfspec.oracle",
    "freedave_graph": "spiffy.selfspec.freedave",
    "ssd_graph": "spiffy.selfspec.ssd",
    "rival_graph": "spiffy.selfspec.rivals",
    "RIVALS": "spiffy.selfspec.rivals",
    "DraftGraph": "spiffy.selfspec.graph",
    "DraftNode": "spiffy.selfspec.graph",
    "load_graph": "spiffy.selfspec.graph",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spiffy.selfspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
