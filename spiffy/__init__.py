"""spiffy: lossless speculative decoding for diffusion LLMs (Spiffy) and Qwen3 targets (DDTree).

Importing spiffy registers its model families with transformers' Auto classes, so checkpoint directories of
LLaDA (``model_type="llada"``), Dream (``"Dream"``), SDAR (``"sdar"``) and SDAR-MoE (``"sdar_moe"``) load through
``AutoModel`` without ``trust_remote_code``. Heavy submodules are imported lazily: ``import spiffy`` itself imports
neither torch nor transformers (so ``spiffy --help`` starts fast); the registration runs when transformers is
imported, or at once when it already is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

from spiffy._version import __version__
from spiffy.errors import (
    CheckpointError,
    CheckpointKeyError,
    ConfigError,
    DecodingError,
    StepLimitError,
    DrafterMismatchError,
    GraphError,
    GraphMismatchError,
    MissingTokenError,
    PromptTooLongError,
    SpiffyError,
    UnknownModelTypeError,
)
# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "load_model": "spiffy.models",
    "load_tokenizer": "spiffy.models",
    "make_tiny": "spiffy.models.tiny",
    "generate": "spiffy.api",
    "batch_invariant": "spiffy.batch_invariance",
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
    "StepLimitError",
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


def _register_families() -> None:
    """Register the families with transformers' Auto classes: importing :mod:`spiffy.models` does it (its last
    line), unless that import is under way (it is the one importing transformers) and will finish the job."""
    if "spiffy.models" not in sys.modules:
        importlib.import_module("spiffy.models")


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_families` right after ``import transformers`` completes (a post-import hook), so that
    ``import spiffy`` costs no torch / transformers import and ``AutoModel`` still knows the families."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; the finders below find the real package
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader
        exec_module = inner.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_families()

        spec.loader = _Loader(inner, exec_then_register)
        return spec


class _Loader(importlib.abc.Loader):
    """The real loader of transformers with ``exec_module`` followed by the registration; anything else (resource
    readers, ``get_data``) goes to the real loader."""

    def __init__(self, inner: Any, exec_module: Any) -> None:
        self._inner = inner
        self._exec = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._inner  # the module keeps its real loader afterwards
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._exec(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


if "transformers" in sys.modules:
    _register_families()
else:
    sys.meta_path.insert(0, _RegisterAfterTransformers())
