"""Deprecated import path (one release): AR speculative generation lives in :mod:`spiffy.arspec`."""

from __future__ import annotations

from spiffy.arspec.generate import DEFAULT_BUDGET, METHODS, STAGES, ARGenerationResult, ddtree_generate

__all__ = ["ARGenerationResult", "ddtree_generate", "METHODS", "DEFAULT_BUDGET", "STAGES"]
