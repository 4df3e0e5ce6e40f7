"""Deprecated module path (kept one release): the names that used to live here, imported on first use.

The front door moved above the packages it dispatches to: :mod:`spiffy.api` (``generate``, ``make_session``,
``DiffusionResult``), :mod:`spiffy.compat` (``llada_generate``, ``dream_diffusion_generate``,
``DreamGenerateOutput``), the session factory and token lookups to :mod:`spiffy.decoding.factory`, and the
graph/runtime signature to :mod:`spiffy.selfspec.graph`. Names are resolved lazily (PEP 562) because
:mod:`spiffy.decoding` must not import the layers above it.
"""

from __future__ import annotations

import importlib
from typing import Any

_MOVED: dict[str, str] = {
    "DiffusionResult": "spiffy.api",
    "generate": "spiffy.api",
    "DreamGenerateOutput": "spiffy.compat",
    "dream_diffusion_generate": "spiffy.compat",
    "llada_generate": "spiffy.compat",
    "make_session": "spiffy.decoding.factory",
    "context_length": "spiffy.decoding.factory",
    "family_of": "spiffy.decoding.factory",
    "resolve_eos_eot": "spiffy.decoding.factory",
    "resolve_mask_id": "spiffy.decoding.factory",
    "runtime_signature": "spiffy.selfspec.graph",
}

__all__ = sorted(_MOVED)


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
