"""What the commands share once they run (this module imports torch; the parsers never import it).

* :func:`set_threads`: ``--threads``, one rule for every command.
* :func:`decode_config`: the :class:`~spiffy.decoding.DecodeConfig` of the decoding flags the user set, on top of
  defaults (a graph's calibrated configuration, or the class defaults).
* :func:`check_output_path`: an output location is refused before any work starts, not after it.
* :func:`default_device`, :func:`quiet_loading`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from spiffy.cli.flags import DLLM_DECODING_FLAGS
from spiffy.decoding import DecodeConfig
from spiffy.errors import ConfigError

__all__ = ["SMALL_MODEL_PARAMETERS", "check_output_path", "decode_config", "default_device", "quiet_loading",
           "set_threads"]

#: models below this many parameters run on one thread by default (see flags.THREADS_HELP)
SMALL_MODEL_PARAMETERS = 50_000_000

#: DecodeConfig fields that are sampling flags (shared by every mode) rather than decoding-rule flags
_SAMPLING_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "seed")


def set_threads(requested: int | None, *models: Any) -> int:
    """Apply ``--threads``: ``N >= 1`` exactly, ``0`` torch's default (left as is), ``None`` one thread when every
    model given is small (under :data:`SMALL_MODEL_PARAMETERS`), else torch's default. Returns the thread count."""
    if requested is None:
        sizes = [sum(p.numel() for p in m.parameters()) for m in models if m is not None]
        if sizes and max(sizes) < SMALL_MODEL_PARAMETERS:
            requested = 1
    if requested:
        torch.set_num_threads(int(requested))
    return torch.get_num_threads()


def quiet_loading() -> None:
    """No "Loading weights" bar from transformers' loaders: a command's own progress bar is the one that counts."""
    hf_logging.disable_progress_bar()


def default_device(requested: str | None) -> str:
    """``--device``, else ``cuda`` when available, else ``cpu``."""
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def decode_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """``(DecodeConfig, family overrides)`` from the decoding and sampling flags.

    Unset flags (``None``) keep the value of ``base`` (a recorded ``DecodeConfig.to_dict()``, e.g. the one a graph
    was calibrated for; its seed is not inherited), else the class default. The overrides are the family-specific
    options ``generate`` takes as keywords (SDAR's ``strategy``, Fast-dLLM v2's ``small_block_size``).
    """
    values: dict[str, Any] = {}
    if base:
        fields = DecodeConfig.__dataclass_fields__
        values = {k: v for k, v in base.items() if k in fields and k not in ("seed", "mask_id")}
    for name in (*DLLM_DECODING_FLAGS, *_SAMPLING_FIELDS):
        if name in _FAMILY_OPTIONS:
            continue
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if base and getattr(args, "steps", None) is None and base.get("steps") is not None:
        values["steps"] = _steps_keeping_the_rate(base, values)
    if values.get("top_k") == 0:  # the flag's documented "0 = off"
        values["top_k"] = None
    values["temperature"] = float(values.get("temperature") or 0.0)
    extra: dict[str, Any] = {}
    for name in _FAMILY_OPTIONS:
        value = getattr(args, name, None)
        if value is None and base:
            value = base.get(name)
        if value is not None:
            extra[name] = value
    return DecodeConfig(**values), extra


#: decoding options of one family's configuration class, passed to ``generate`` as keywords (SDAR's ``strategy``,
#: Fast-dLLM v2's ``small_block_size``)
_FAMILY_OPTIONS: tuple[str, ...] = ("strategy", "small_block_size")


def _steps_keeping_the_rate(base: dict[str, Any], values: dict[str, Any]) -> int | None:
    """Total steps for the gen length / block length in ``values`` that unmask as many tokens per step as ``base``
    (a graph's recorded configuration) did: a graph is calibrated for a rate, not for a total, so ``--gen-length
    128`` on a graph calibrated at 64 positions in 64 steps takes 128 steps. ``None`` (one token per step) when the
    rate does not divide the new length."""
    base_gen = int(base["gen_length"])
    base_block = int(base.get("block_length") or base_gen)
    per_block = int(base["steps"]) // max(1, base_gen // base_block)
    gen = int(values.get("gen_length", base_gen))
    steps, rest = divmod(gen * per_block, base_block)
    return steps if rest == 0 and steps > 0 else None


def check_output_path(path: str | os.PathLike[str], flag: str = "--out", *, directory: bool = False) -> Path:
    """Refuse, before any work, an output location that cannot be written: ConfigError naming ``flag`` and the fix.

    ``directory=True``: ``path`` is a directory the command creates files in; otherwise a file it writes (its
    parent directory must be writable). Nothing is created.
    """
    out = Path(path).expanduser()
    folder = out if directory else out.parent
    if not directory and out.is_dir():
        raise ConfigError(f"{flag} {out} is a directory; fix: name a file, e.g. {out / 'graph.json'}")
    if directory and out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a directory; fix: name a directory for the results")
    existing = folder
    while not existing.exists():  # the nearest existing ancestor is the one that must be writable
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {out}: {existing} is not a directory; fix: choose another location")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: {existing} is not writable; fix: choose a writable location")
    if not directory and out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{flag} {out} exists and is read-only; fix: choose another file or make it writable")
    return out
