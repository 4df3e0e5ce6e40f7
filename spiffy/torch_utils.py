"""Small torch facts asked everywhere: where a model lives, which dtype a name means.

One home each, so the device of a model and the spelling of a dtype are decided in one place.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from spiffy.errors import ConfigError

__all__ = ["DTYPE_NAMES", "model_device", "model_dtype", "dtype_name", "resolve_dtype"]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def model_device(model: Any) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless or non-module object)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def model_dtype(model: Any) -> torch.dtype | None:
    """Dtype of the model's first parameter (``None`` for a parameterless or non-module object)."""
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError):
        return None


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (``"unknown"`` for ``None``)."""
    return "unknown" if dtype is None else str(dtype).replace("torch.", "")


def resolve_dtype(dtype: Any, config: Mapping[str, Any] | None = None, device: Any = None) -> torch.dtype:
    """A ``torch.dtype`` from a dtype, a name (``"float64"``, ``"bf16"``, ...), ``"auto"`` or ``None``.

    ``"auto"`` is the checkpoint config's ``torch_dtype``/``dtype`` (float32 if absent); ``None`` means float32 on
    the CPU (half precision matmuls are slow there) and ``"auto"`` on an accelerator.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        dtype = "float32" if dev.type == "cpu" else "auto"
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        if key == "auto":
            stored = (config or {}).get("torch_dtype") or (config or {}).get("dtype")
            if isinstance(stored, torch.dtype):
                return stored
            if isinstance(stored, str) and stored.replace("torch.", "") in DTYPE_NAMES:
                return DTYPE_NAMES[stored.replace("torch.", "")]
            return torch.float32
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ConfigError(f"unknown dtype {dtype!r}; fix: use a torch.dtype, one of {sorted(DTYPE_NAMES)}, or 'auto'")
