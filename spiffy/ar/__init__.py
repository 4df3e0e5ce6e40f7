"""AR mode: a DFlash block-diffusion drafter and DDTree tree verification for Qwen3 targets (SPEC §7).

Public API::

    from spiffy.ar import ddtree_generate, load_drafter
    drafter = load_drafter("path/to/Qwen3-8B-DFlash-b16", dtype="bf16", device="cuda")
    res = ddtree_generate(target, drafter, input_ids, method="ddtree", budget=256, max_new_tokens=512)
    res.tokens, res.tau, res.stage_times

``method="dflash"`` is the vanilla DFlash chain and ``method="ar"`` plain AR decoding, on the same code path.
"""

from __future__ import annotations

from spiffy.ar.checkpoints import make_tiny_dflash, save_drafter
from spiffy.ar.drafter import (
    DFlashDraftModel,
    TargetFeatureHooks,
    check_compatible,
    default_target_layer_ids,
    load_drafter,
)
from spiffy.ar.generate import DEFAULT_BUDGET, METHODS, ARGenerationResult, ddtree_generate
from spiffy.ar.sampling import filter_logits, sample_tokens
from spiffy.ar.tree import DraftTree, build_chain, build_ddtree

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
