"""Deprecated import path (one release): the AR checkpoint writers live in :mod:`spiffy.models.ar_checkpoints`."""

from __future__ import annotations

from spiffy.models.ar_checkpoints import make_tiny_dflash, make_tiny_target, save_drafter

__all__ = ["make_tiny_dflash", "make_tiny_target", "save_drafter"]
