"""Deprecated import path (one release): the DFlash drafter model lives in :mod:`spiffy.models.dflash`."""

from __future__ import annotations

from spiffy.models.dflash import (
    DEFAULT_BLOCK_SIZE,
    DFlashAttention,
    DFlashDecoderLayer,
    DFlashDraftModel,
    TargetFeatureHooks,
    check_compatible,
    default_target_layer_ids,
    drafter_settings,
    is_dflash_config,
    load_drafter,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DFlashAttention",
    "DFlashDecoderLayer",
    "DFlashDraftModel",
    "TargetFeatureHooks",
    "check_compatible",
    "default_target_layer_ids",
    "drafter_settings",
    "is_dflash_config",
    "load_drafter",
]
