"""Baseline dLLM decoding (LLaDA, Dream, SDAR): the session contract, each family's rule, the session factory.

:func:`make_session` builds the :class:`DecodeSession` that both the baseline loop (:func:`run_baseline`) and
Spiffy's speculative runtime drive. The public front door, ``generate(model, input_ids, config, graph=None)``,
lives in :mod:`spiffy.api` and the official-signature wrappers (``llada_generate``, ``dream_diffusion_generate``,
``sdar_block_diffusion_generate``) in :mod:`spiffy.compat`; their names are still importable from here
(deprecated, resolved on first use since this package sits below them).
"""

from __future__ import annotations

import importlib
from typing import Any

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.factory import family_of, make_session
from spiffy.decoding.session import BaselineStats, DecodeSession, StepInfo, StepRecord, TransitionProbs, run_baseline

#: names that moved above this package (deprecated here for one release) -> their module
_MOVED: dict[str, str] = {
    "DiffusionResult": "spiffy.api",
    "generate": "spiffy.api",
    "DreamGenerateOutput": "spiffy.compat",
    "dream_diffusion_generate": "spiffy.compat",
    "llada_generate": "spiffy.compat",
}

__all__ = [
    "BaselineStats",
    "DecodeConfig",
    "DecodeSession",
    "DiffusionResult",
    "DreamGenerateOutput",
    "StepInfo",
    "StepRecord",
    "TransitionProbs",
    "dream_diffusion_generate",
    "family_of",
    "generate",
    "llada_generate",
    "make_session",
    "run_baseline",
]


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
