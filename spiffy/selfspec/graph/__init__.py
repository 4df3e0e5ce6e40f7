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
                      "objective": ..., ["score": ...,] "library_version": ..., "date": ..., "command": ...},
      "graph": {"num_nodes": D, "max_level": L,
                "nodes": [{"id": 0, "level": 1, "pairs": [[1, 1]], "parents": [], "count": 123}, ...]},
      "projected": {"baseline_nfe": ..., "projected_nfe": ..., "reduction": ...}
    }

``model`` is a directory path or a Hub id; for a model loaded from the Hub (or from a Hugging Face cache snapshot)
it is ``ORG/NAME`` and ``model_revision`` the snapshot's commit. ``calibration.score``, when present, names the
pruning score the graph was selected for and is run with by default (:mod:`spiffy.selfspec.pruning`).

Modules: :mod:`~spiffy.selfspec.graph.nodes` (nodes and the link rule), :mod:`~spiffy.selfspec.graph.core`
(:class:`DraftGraph`, :func:`load_graph`), :mod:`~spiffy.selfspec.graph.validation` (structural checks; networkx
for the cycle search), :mod:`~spiffy.selfspec.graph.fileformat` (reading and writing the file),
:mod:`~spiffy.selfspec.graph.compat` (runtime signature, config fingerprint, compatibility check) and
:mod:`~spiffy.selfspec.graph.views` (networkx, text summary, PNG drawing; matplotlib is optional).
"""

from __future__ import annotations

from spiffy.io import atomic_write_text
from spiffy.selfspec.graph.compat import (
    ARCH_FIELDS,
    INCOMPATIBLE_FIELDS,
    SOFT_FIELDS,
    GraphCompatibilityWarning,
    check_calibrated_for,
    model_config_fingerprint,
    model_name,
    runtime_signature,
)
from spiffy.selfspec.graph.core import DraftGraph, load_graph
from spiffy.selfspec.graph.fileformat import FORMAT, VERSION
from spiffy.selfspec.graph.nodes import DraftNode, Pair, is_parent

__all__ = [
    "FORMAT",
    "VERSION",
    "INCOMPATIBLE_FIELDS",
    "SOFT_FIELDS",
    "Pair",
    "DraftNode",
    "DraftGraph",
    "GraphCompatibilityWarning",
    "check_calibrated_for",
    "is_parent",
    "load_graph",
    "model_config_fingerprint",
    "model_name",
    "runtime_signature",
    "ARCH_FIELDS",
    "atomic_write_text",
]
