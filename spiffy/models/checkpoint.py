"""Checkpoint files on disk: ``config.json``, single-file or sharded safetensors, strict key matching.

The file layer every family's loader shares (:func:`spiffy.models.loading.load_model`, the DFlash drafter's
:func:`spiffy.models.dflash.load_drafter`): :func:`read_config_dict`, :func:`checkpoint_files`,
:func:`load_state_dict` and :func:`check_keys`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spiffy.errors import CheckpointError, CheckpointKeyError
from spiffy.models.hub import checkpoint_dir

__all__ = [
    "SINGLE_FILE",
    "INDEX_FILE",
    "CONFIG_FILE",
    "read_config_dict",
    "checkpoint_files",
    "load_state_dict",
    "check_keys",
    "stored_dtype",
    "iter_checkpoint_keys",
    "alias_groups",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def read_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of checkpoint directory or Hub id ``path`` (CheckpointError if missing or invalid)."""
    root = checkpoint_dir(path, weights=False)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist; fix the path or create one with `spiffy tiny`")
    if not root.is_dir():
        raise CheckpointError(f"{str(root)!r} is not a directory; point at a checkpoint directory holding config.json")
    cfg = root / CONFIG_FILE
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {str(root)!r}; a checkpoint directory needs config.json + safetensors")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {str(cfg)!r}: {exc}; fix or regenerate the file") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(cfg)!r} does not hold a JSON object; fix or regenerate the file")
    return data



def checkpoint_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, for a sharded one, its ``weight_map`` (key -> file name)."""
    root = Path(path)
    index = root / INDEX_FILE
    single = root / SINGLE_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = dict(data["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read {str(index)!r}: {exc}; fix or regenerate the index") from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(
                f"shard files listed in {INDEX_FILE} are missing in {str(root)!r}: {', '.join(missing)}; "
                "re-download or regenerate the checkpoint"
            )
        return [root / n for n in names], weight_map
    if single.is_file():
        return [single], None
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r}; spiffy reads safetensors checkpoints only "
        "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
    )


def load_state_dict(path: str | os.PathLike, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a (single-file or sharded) safetensors checkpoint, keyed by parameter name."""
    files, weight_map = checkpoint_files(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device=str(device) if device is not None else "cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {str(f)!r}: {exc}; the file is corrupt or not safetensors") from exc
        for key, tensor in part.items():
            if weight_map is not None and weight_map.get(key) != f.name:
                if key not in weight_map:
                    state[key] = tensor  # reported as unexpected by the strict check
                continue
            state[key] = tensor
    if weight_map is not None:
        absent = sorted(k for k in weight_map if k not in state)
        if absent:
            raise CheckpointError(
                f"{INDEX_FILE} in {str(path)!r} lists keys absent from their shard files: {', '.join(absent[:8])}; "
                "regenerate the checkpoint"
            )
    return state


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype of the first tensor stored in a checkpoint (read from its header, no weights loaded)."""
    files, _ = checkpoint_files(path)
    with safe_open(str(files[0]), framework="pt") as handle:
        keys = list(handle.keys())
        name = handle.get_slice(keys[0]).get_dtype() if keys else "F32"
    return _SAFETENSORS_DTYPES.get(name, torch.float32)


def alias_groups(model: torch.nn.Module) -> list[list[str]]:
    """State-dict names grouped by shared tensor (tied weights): groups of size > 1 only."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def check_keys(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], path: str | os.PathLike, fix: str | None = None
) -> None:
    """Strict key matching: raise CheckpointKeyError naming missing, unexpected and shape-mismatched keys (``fix``:
    the error's fix when the caller knows a better one than the generic).

    Tied parameters (several names, one tensor) need only one of their names in the checkpoint.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    optional: set[str] = set()
    for group in alias_groups(model):
        present = [n for n in group if n in state]
        optional.update(group if present else group[1:])
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unexpected = sorted(k for k in state if k not in expected)
    mismatch = sorted(
        f"{k} (checkpoint {tuple(state[k].shape)} vs model {expected[k]})"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    )
    if missing or unexpected or mismatch:
        raise CheckpointKeyError(str(path), missing, unexpected, mismatch, fix)


def check_loading_info(info: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Strict keys for a checkpoint read by transformers' ``from_pretrained(..., output_loading_info=True)``: raise
    :class:`CheckpointKeyError` naming its ``missing_keys``, ``unexpected_keys`` and ``mismatched_keys`` (transformers
    would otherwise initialise missing weights at random and drop unexpected ones with a warning)."""
    missing = sorted(str(k) for k in info.get("missing_keys") or ())
    unexpected = sorted(str(k) for k in info.get("unexpected_keys") or ())
    mismatched = [f"{item[0]}: checkpoint {tuple(item[1])} vs model {tuple(item[2])}"
                  if isinstance(item, (tuple, list)) and len(item) == 3 else str(item)
                  for item in info.get("mismatched_keys") or ()]
    if missing or unexpected or mismatched:
        raise CheckpointKeyError(str(path), missing, unexpected, mismatched)


class _ReportLines(logging.Handler):
    """Collects the lines of transformers' weight-loading report (logged as a warning before it raises)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()).splitlines())


@contextmanager
def loading_report() -> Iterator[list[str]]:
    """The lines transformers' ``from_pretrained`` logs about the weights it could not load, while in the block."""
    handler = _ReportLines()
    log = logging.getLogger("transformers")  # the report is logged by modeling_utils; records reach the library root
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


def load_failure(exc: BaseException, path: str | os.PathLike, report: Iterable[str] = ()) -> CheckpointError:
    """A one-line :class:`CheckpointError` for a ``from_pretrained`` that failed while reading the weights (e.g.
    transformers cannot fuse per-expert MoE weights when one expert's tensor is missing): the error's first line and
    the ``Error:`` lines of transformers' loading ``report`` (:func:`loading_report`)."""
    details = [line.strip() for line in report if line.strip().startswith("Error:")]
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return CheckpointError(f"cannot load the weights in {str(path)!r}: {' | '.join(details[:3] or [first])}; fix: "
                           "point at a complete checkpoint of the architecture its config.json names")


def iter_checkpoint_keys(path: str | os.PathLike) -> Iterable[str]:
    """Parameter names stored in a checkpoint (without loading tensors)."""
    files, weight_map = checkpoint_files(path)
    if weight_map is not None:
        return sorted(weight_map)
    keys: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys.extend(handle.keys())
    return sorted(keys)
