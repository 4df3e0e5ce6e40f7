"""Baseline dLLM decoding (LLaDA, Dream, SDAR): the session contract, each family's rule, the session factory, the loop.

:func:`make_session` builds the :class:`DecodeSession` of a model's family; :func:`run_baseline` (a single prompt, or
a batch by its own rule) and :func:`run_baseline_batch` (rows equal to their prompts alone) decode with the plain
loop, the one loop (:mod:`spiffy.decoding.batch`) that Spiffy's speculative runtime also runs. The public front
door, ``generate(model, input_ids, config, graph=None)``, lives in :mod:`spiffy.api` and the official-signature
wrappers in :mod:`spiffy.compat`.
"""

from __future__ import annotations

from spiffy.decoding.batch import run_baseline, run_baseline_batch
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.factory import make_session
from spiffy.decoding.session import BaselineStats, DecodeSession, StepInfo, StepRecord, TransitionProbs

__all__ = [
    "BaselineStats",
    "DecodeConfig",
    "DecodeSession",
    "StepInfo",
    "StepRecord",
    "TransitionProbs",
    "make_session",
    "run_baseline",
    "run_baseline_batch",
]
