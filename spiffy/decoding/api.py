"""Deprecated module path (kept one release): the names that used to live here, imported on first use.

The front door moved above the packages it dispatches to: :mod:`spiffy.api` (``generate``, ``make_session``,
``DiffusionResult``), :mod:`spiffy.compat` (``llada_generate``, ``dream_diffusion_generate``,
``DreamGenerateOutput``) and the session factory and token lookups to :mod:`spiffy.decoding.factory`. Names are
resolved lazily (PEP 562) because :mod:`spiffy.decoding` must not import the layers above it. ``runtime_signature``
is not re-exported (the baseline decoders never reach the speculative method): import it from
``spiffy.selfspec.graph``.
"""

from __future__ import annotations

import importlib
from typing import Any

from spiffy.decoding import _MOVED as _PACKAGE_MOVED

#: the package's moved names, plus the session factory's lookups that this module also used to define
_MOVED: dict[str, str] = {
    **_PACKAGE_MOVED,
    **{
        name: "spiffy.decoding.factory"
        for name in ("make_session", "context_length", "family_of", "resolve_eos_eot", "resolve_mask_id")
    },
}

__all__ = sorted(_MOVED)


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
