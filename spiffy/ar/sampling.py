"""Deprecated import path (one release): position-keyed sampling lives in :mod:`spiffy.arspec.sampling`, logit
filtering in :func:`spiffy.sampling.filter_logits`."""

from __future__ import annotations

import torch

from spiffy.arspec.sampling import gumbel_noise, position_key, sample_tokens, tempered
from spiffy.sampling import filter_logits as _filter, validate_sampling

__all__ = ["validate_sampling", "filter_logits", "position_key", "gumbel_noise", "sample_tokens"]


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The former AR signature: ``[N, V]`` logits -> ``logits / T`` with top-k then top-p ("reaches") filtered to
    ``-inf``; use :func:`spiffy.arspec.sampling.tempered` and :func:`spiffy.sampling.filter_logits` instead."""
    return _filter(tempered(logits, temperature), int(top_k), float(top_p), nucleus="reaches")
