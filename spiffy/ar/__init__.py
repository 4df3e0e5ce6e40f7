"""Deprecated package (kept one release): its contents moved.

* the DFlash drafter model and its loader: :mod:`spiffy.models.dflash` (``spiffy.models.load_drafter``);
* checkpoint writers (``make_tiny_dflash``, ``make_tiny_target``, ``save_drafter``): :mod:`spiffy.models.ar_checkpoints`;
* generation, sampling and the tree builder: :mod:`spiffy.arspec` (the command line: `spiffy generate --method ...`).

Every name below is the same object as in its new home.
"""

from __future__ import annotations

from spiffy.ar.sampling import filter_logits
from spiffy.arspec.generate import DEFAULT_BUDGET, METHODS, ARGenerationResult, ddtree_generate
from spiffy.arspec.sampling import sample_tokens
from spiffy.arspec.tree import DraftTree, build_chain, build_ddtree
from spiffy.models.ar_checkpoints import make_tiny_dflash, save_drafter
from spiffy.models.dflash import (
    DFlashDraftModel,
    TargetFeatureHooks,
    check_compatible,
    default_target_layer_ids,
    load_drafter,
)

__all__ = [
    "ARGenerationResult",
    "DEFAULT_BUDGET",
    "DFlashDraftModel",
    "DraftTree",
    "METHODS",
    "TargetFeatureHooks",
    "build_chain",
    "build_ddtree",
    "check_compatible",
    "ddtree_generate",
    "default_target_layer_ids",
    "filter_logits",
    "load_drafter",
    "make_tiny_dflash",
    "sample_tokens",
    "save_drafter",
]
