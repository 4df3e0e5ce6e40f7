"""Baseline dLLM decoding (LLaDA, Dream, SDAR) and the public ``generate`` API.

``generate(model, input_ids, config, graph=None)`` decodes with the family's baseline rule, or with Spiffy
self-speculation when a calibrated draft graph is given (same tokens, fewer forwards). ``make_session`` builds the
:class:`DecodeSession` both paths drive. ``llada_generate`` / ``dream_diffusion_generate`` keep the official
signatures.
"""

from __future__ import annotations

from spiffy.decoding.api import (
    DiffusionResult,
    DreamGenerateOutput,
    dream_diffusion_generate,
    family_of,
    generate,
    llada_generate,
    make_session,
    runtime_signature,
)
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.session import BaselineStats, DecodeSession, StepInfo, StepRecord, run_baseline

__all__ = [
    "BaselineStats",
    "DecodeConfig",
    "DecodeSession",
    "DiffusionResult",
    "DreamGenerateOutput",
    "StepInfo",
    "StepRecord",
    "dream_diffusion_generate",
    "family_of",
    "generate",
    "llada_generate",
    "make_session",
    "run_baseline",
    "runtime_signature",
]
