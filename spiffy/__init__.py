"""spiffy: lossless speculative decoding for diffusion LLMs (Spiffy) and Qwen3 targets (DDTree).

Importing spiffy registers its model families with transformers' Auto classes, so checkpoint directories of
LLaDA (``model_type="llada"``), Dream (``"Dream"``) and SDAR (``"sdar"``) load through ``AutoModel`` without
``trust_remote_code``. Heavy submodules are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

from spiffy._version import __version__
from spiffy.errors import (
    CheckpointError,
    CheckpointKeyError,
    ConfigError,
    DecodingError,
    DrafterMismatchError,
    GraphError,
    GraphMismatchError,
    MissingTokenError,
    PromptTooLongError,
    SpiffyError,
    UnknownModelTypeError,
)
from spiffy.models.registry import register_with_transformers

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "load_model": "spiffy.models",
    "load_tokenizer": "spiffy.models",
    "make_tiny": "spiffy.models.tiny",
    "generate": "spiffy.api",
    "DecodeConfig": "spiffy.decoding",
    "SpiffyConfig": "spiffy.selfspec.config",
    "ddtree_generate": "spiffy.arspec",
    "DraftGraph": "spiffy.selfspec.graph",
    "load_graph": "spiffy.selfspec.graph",
    "calibrate": "spiffy.selfspec.calibrate",
}

__all__ = [
    "__version__",
    "CheckpointError",
    "CheckpointKeyError",
    "ConfigError",
    "DecodingError",
    "DrafterMismatchError",
    "GraphError",
    "GraphMismatchError",
    "MissingTokenError",
    "PromptTooLongError",
    "SpiffyError",
    "UnknownModelTypeError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spiffy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


register_with_transformers()
