"""transformers' quantizer registry, imported once without the import-time noise of optional backends.

transformers imports every installed quantization backend when its model code loads (``transformers.quantizers.auto``
imports torchao's safetensors support whenever torchao is installed). On a machine where torchao's compiled
extensions do not apply (a CPU, another CUDA build) torchao logs one "Failed to load" warning per extension, and
torch logs a deprecation warning per enum torchao registers: lines on stderr of every spiffy command that say nothing
about the command. :func:`quiet_quantizer_import` performs that import first, with those two loggers raised to
ERROR for its duration only; real errors still print, and a later ``--quantize`` uses torchao as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["NOISY_IMPORT_LOGGERS", "quiet_quantizer_import"]

#: loggers whose warnings at transformers' quantizer import are about backends the command does not use
NOISY_IMPORT_LOGGERS: tuple[str, ...] = ("torchao", "torch.utils._pytree")


def quiet_quantizer_import() -> None:
    """Import ``transformers.quantizers.auto`` with :data:`NOISY_IMPORT_LOGGERS` at ERROR (a no-op without torchao
    or once imported)."""
    if "transformers.quantizers.auto" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    loggers = [logging.getLogger(name) for name in NOISY_IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        importlib.import_module("transformers.quantizers.auto")  # by name: only when torchao is there to be quieted
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
