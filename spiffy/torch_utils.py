"""Small torch facts asked everywhere: where a model lives, which dtype a name means.

One home each, so the device of a model and the spelling of a dtype are decided in one place.
"""

from __future__ import annotations

import types
from array import array
from typing import Any, Callable, Mapping

import torch

from spiffy.errors import ConfigError

__all__ = ["DTYPE_NAMES", "code_copy", "device_tensor", "dtype_name", "execution_device", "host_tensor", "model_device",
           "model_dtype", "on_device", "resolve_dtype"]

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


def _hook_device(module: Any) -> torch.device | None:
    """The execution device of an accelerate hook on ``module`` (``None`` when it has none)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])  # SequentialHook holds several
    for h in hooks:
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
    return None


def execution_device(module: Any) -> torch.device:
    """Where ``module`` computes: for a model placed with a ``device_map`` (accelerate hooks) the execution device
    of its first weight-holding submodule (the hook may sit on that submodule or on an enclosing block), whose
    weights may be offloaded (then they sit on ``meta``); otherwise the device of its first parameter. For a whole
    model this is where its inputs go (the embedding's device). CPU for a parameterless or non-module object."""
    if not hasattr(module, "named_modules"):
        return torch.device("cpu")
    hooked: dict[str, torch.device] = {}  # module name -> its hook's execution device
    for name, sub in module.named_modules():
        dev = _hook_device(sub)
        if dev is not None:
            hooked[name] = dev
        own = next(iter(sub.parameters(recurse=False)), None)
        if own is None:
            continue
        parts = name.split(".") if name else []
        for cut in range(len(parts), -1, -1):  # nearest hooked ancestor (or the module itself)
            found = hooked.get(".".join(parts[:cut]))
            if found is not None:
                return found
        return own.device
    return torch.device("cpu")


def model_device(model: Any) -> torch.device:
    """Where the model's inputs go: :func:`execution_device` (the first parameter's device, or its accelerate
    execution device when the model was placed with a ``device_map``). CPU for a parameterless object."""
    return execution_device(model)


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


def on_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``, with no call at all when it is there already (a sync counter sees no move).

    A host tensor bound for a GPU is copied with ``non_blocking=True``: a blocking copy (``.to(device)``,
    ``torch.tensor(values, device=...)``) waits for every kernel queued before it (PyTorch synchronises the stream
    after the copy), a host synchronisation no counter of reads sees. From pageable host memory the asynchronous
    copy stages the values before it returns, so ``t`` may be dropped at once."""
    device = torch.device(device)
    if t.device == device:
        return t
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu")


def device_tensor(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` through :func:`on_device` (no stream synchronisation: see
    there), for the small index tensors a step builds from host lists."""
    return on_device(torch.tensor(values, dtype=dtype), device)


#: array typecodes of the dtypes :func:`host_tensor` packs
_TYPECODES = {torch.long: "q", torch.float64: "d", torch.float32: "f"}


def host_tensor(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """``[n]`` CPU tensor (long, float64 or float32) of a list of Python numbers, read from one packed buffer: several
    times faster than ``torch.tensor`` on a list (floats are rounded to nearest; the tensor keeps the buffer alive)."""
    if not values:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def code_copy(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own, named ``name``: TorchDynamo keeps compiled graphs, guards and its
    recompile limit per code object, so copies compiled for different uses never evaluate or count one another's."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
