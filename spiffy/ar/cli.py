"""Deprecated import path (one release): the AR command line lives in :mod:`spiffy.cli.generate_ar`.

Resolved lazily (PEP 562) so that importing :mod:`spiffy.ar` never imports the command-line layer.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["add_ar_arguments", "run_generate", "main", "load_target"]

_HOME = "spiffy.cli.generate_ar"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_HOME), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover - python -m spiffy.ar.cli
    sys.exit(importlib.import_module(_HOME).main())
