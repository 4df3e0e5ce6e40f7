"""Models larger than one device: ``device_map`` placement through accelerate (optional dependency).

:func:`dispatch_checkpoint` is what :func:`spiffy.models.loading.load_model`, ``load_target``,
:func:`spiffy.models.dflash.load_drafter` and ``load_ar_drafter`` call when given ``device_map``:

* ``device_map`` is ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"`` (accelerate's
  :func:`~accelerate.infer_auto_device_map` over the visible GPUs, then CPU RAM, then disk; ``max_memory`` caps
  each), a single device (``"cpu"``, ``"cuda:1"``, ``0``) or a dict ``{module name: device}`` whose values are a
  device, ``"cpu"`` or ``"disk"`` (e.g. ``{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
  ..., "lm_head": "disk"}``). Every parameter must be covered by one entry (``""`` covers the whole model).
* weights are read shard by shard into their devices (never the whole checkpoint in CPU memory); those mapped to
  ``"disk"`` are written to ``offload_folder`` and read back, layer by layer, at each forward;
* accelerate's hooks move each block's inputs to its execution device, so activations flow across devices and
  disk-offloaded layers run on the CPU (or the first GPU) with their weights loaded for the call.

accelerate is imported lazily: without it a ``device_map`` raises :class:`~spiffy.errors.MissingDependencyError`
naming ``pip install spiffy-decoding[placement]``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from spiffy.errors import CheckpointError, ConfigError, MissingDependencyError
from spiffy.models.checkpoint import check_keys, check_loading_info, checkpoint_files, load_failure, loading_report
from spiffy.torch_utils import execution_device

__all__ = [
    "AUTO_DEVICE_MAPS",
    "DeviceMap",
    "dispatch_checkpoint",
    "is_dispatched",
    "placement_device",
    "native_from_pretrained",
    "native_tensor_parallel",
    "require_accelerate",
    "resolve_device_map",
    "tied_linear",
]

#: ``device_map`` strings that let accelerate choose the placement
AUTO_DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "balanced_low_0", "sequential")

DeviceMap = str | int | torch.device | Mapping[str, Any]


def require_accelerate() -> Any:
    """The ``accelerate`` module, or :class:`~spiffy.errors.MissingDependencyError` naming the extra to install."""
    try:
        import accelerate  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise MissingDependencyError(
            "device_map placement needs the accelerate package, which is not installed; "
            "fix: pip install 'spiffy-decoding[placement]' (or pip install accelerate)"
        ) from exc
    return accelerate


def is_dispatched(model: nn.Module) -> bool:
    """True when ``model`` was placed with a ``device_map`` (it carries accelerate hooks / ``hf_device_map``)."""
    return getattr(model, "hf_device_map", None) is not None


def _checkpoint_shapes(path: Path) -> dict[str, torch.Tensor]:
    """``{key: meta tensor of the stored shape}`` for strict key matching without reading any weights."""
    files, weight_map = checkpoint_files(path)
    shapes: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key, f.name) != f.name:
                    continue
                shapes[key] = torch.empty(handle.get_slice(key).get_shape(), device="meta")
    return shapes


def _single_device(device_map: Any) -> torch.device | None:
    """``device_map`` as one device when it names one (``"cpu"``, ``"cuda:1"``, ``0``), else ``None``."""
    if isinstance(device_map, torch.device):
        return device_map
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device("cuda", device_map)
    if isinstance(device_map, str) and device_map not in AUTO_DEVICE_MAPS:
        if device_map == "disk":
            raise ConfigError("device_map='disk' offloads everything; fix: map at least the embedding to a device "
                              "(a dict device_map) or use device_map='auto' with max_memory")
        try:
            return torch.device(device_map)
        except RuntimeError as exc:
            raise ConfigError(
                f"device_map {device_map!r} is neither a device nor one of {AUTO_DEVICE_MAPS}; fix: pass 'auto', "
                "a device such as 'cpu' or 'cuda:0', or a dict {module name: device | 'cpu' | 'disk'}"
            ) from exc
    return None


def resolve_device_map(
    model: nn.Module,
    device_map: DeviceMap,
    dtype: torch.dtype,
    no_split: list[str],
    max_memory: Mapping[Any, Any] | None = None,
) -> dict[str, Any]:
    """A complete ``{module name: device | "cpu" | "disk"}`` for the (meta-device) ``model``.

    Raises:
        ConfigError: an unknown device_map string, a dict that leaves parameters unplaced or names modules the
            model does not have.
    """
    accelerate = require_accelerate()
    single = _single_device(device_map)
    if single is not None:
        return {"": single}
    if isinstance(device_map, str):
        from accelerate.utils import get_balanced_memory  # noqa: PLC0415 - optional dependency

        memory = dict(max_memory) if max_memory is not None else None
        if device_map != "sequential":
            memory = get_balanced_memory(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")
        placed = dict(accelerate.infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split,
                                                       dtype=dtype))
        if set(placed.values()) == {"disk"}:
            raise ConfigError(
                f"device_map={device_map!r} with max_memory={dict(max_memory or {})} leaves room for nothing but disk; "
                "fix: raise max_memory so that at least the input embedding fits on a device"
            )
        return placed
    if not isinstance(device_map, Mapping):
        raise ConfigError(f"device_map must be a string, a device or a dict, got {type(device_map).__name__}")
    placed = {str(k): v for k, v in device_map.items()}
    modules = dict(model.named_modules())
    unknown = sorted(k for k in placed if k not in modules)
    if unknown:
        raise ConfigError(
            f"device_map names modules this model does not have: {', '.join(unknown[:6])}; fix: use names from "
            f"model.named_modules() (e.g. {', '.join(n for n in list(modules)[1:5])})"
        )
    uncovered = [
        name for name, _ in model.named_parameters()
        if not any(k == "" or name == k or name.startswith(k + ".") for k in placed)
    ]
    if uncovered:
        raise ConfigError(
            f"device_map leaves {len(uncovered)} parameters unplaced ({', '.join(uncovered[:4])}); fix: add an entry "
            "for their module (or '' for everything else)"
        )
    return placed


def placement_device(device: Any, device_map: DeviceMap | None) -> tuple[torch.device, DeviceMap | None]:
    """``(device, device_map)`` for a loader: a ``device_map`` naming one device becomes ``device`` (no accelerate
    needed); otherwise the device is the map's first accelerator (what ``dtype=None`` resolves against) and
    accelerate must be installed."""
    if device_map is None:
        return (torch.device(device) if device is not None else torch.device("cpu")), None
    single = _single_device(device_map)
    if single is not None:
        return single, None
    require_accelerate()
    values = list(device_map.values()) if isinstance(device_map, Mapping) else []
    for value in values:
        if value not in ("cpu", "disk"):
            return (torch.device("cuda", value) if isinstance(value, int) else torch.device(value)), device_map
    if values or not torch.cuda.is_available():
        return torch.device("cpu"), device_map
    return torch.device("cuda"), device_map


def native_from_pretrained(
    model_class: type,
    root: str | os.PathLike,
    dtype: torch.dtype,
    attn_implementation: str,
    device_map: DeviceMap,
    offload_folder: str | os.PathLike | None,
    max_memory: Mapping[Any, Any] | None,
    **load_kwargs: Any,
) -> nn.Module:
    """A transformers causal LM (``model_class``, e.g. ``Qwen3MoeForCausalLM``) loaded by its ``from_pretrained``
    with a ``device_map`` (it drives accelerate: shard-wise reads, hooks, disk offload into ``offload_folder``);
    ``load_kwargs`` go to ``from_pretrained`` (e.g. ``experts_implementation``). Strict keys
    (:func:`~spiffy.models.checkpoint.check_loading_info`)."""
    require_accelerate()
    if isinstance(device_map, str) and device_map not in AUTO_DEVICE_MAPS:
        raise ConfigError(f"unknown device_map {device_map!r}; fix: use one of {AUTO_DEVICE_MAPS}, a device or a dict")
    with loading_report() as report:
        try:
            model, info = model_class.from_pretrained(
                str(root), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
                device_map=dict(device_map) if isinstance(device_map, Mapping) else device_map,
                offload_folder=str(offload_folder) if offload_folder is not None else None, max_memory=max_memory,
                output_loading_info=True, **load_kwargs,
            )
        except OSError as exc:
            raise CheckpointError(f"cannot load the target from {root}: {exc}") from exc
        except (KeyError, ValueError) as exc:  # transformers' own complaints about the map
            raise ConfigError(f"device_map {device_map!r} cannot place {root}: {exc}; fix the map") from exc
        except RuntimeError as exc:  # transformers' weight conversion failed
            raise load_failure(exc, root, report) from exc
    check_loading_info(info, root)
    return model.eval()


def native_tensor_parallel(
    model_class: type, root: str | os.PathLike, dtype: torch.dtype, attn_implementation: str, tp_plan: Any,
    **load_kwargs: Any,
) -> nn.Module:
    """A transformers causal LM (``model_class``) sharded over the ranks of a ``torchrun`` launch (``tp_plan="auto"``:
    the model's own plan; weights become DTensors, each rank holding its slice of every projection).

    Raises:
        ConfigError: not launched by torchrun (no ``WORLD_SIZE``), or a transformers without ``DistributedConfig``.
    """
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError("tp_plan needs a torch.distributed launch; fix: run under torchrun --nproc-per-node N "
                          "(every rank runs the same generation) or drop tp_plan")
    try:
        from transformers import DistributedConfig  # noqa: PLC0415 - newer transformers only
    except ImportError as exc:
        raise ConfigError("this transformers has no DistributedConfig; fix: pip install -U transformers") from exc
    with loading_report() as report:
        try:
            model, info = model_class.from_pretrained(
                str(root), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
                distributed_config=DistributedConfig(tp_plan=tp_plan), output_loading_info=True, **load_kwargs,
            )
        except OSError as exc:
            raise CheckpointError(f"cannot load the target from {root}: {exc}") from exc
        except RuntimeError as exc:  # transformers' weight conversion failed
            raise load_failure(exc, root, report) from exc
    check_loading_info(info, root)
    return model.eval()


def tied_linear(hidden: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``F.linear(hidden, module.weight)`` on the weight's execution device (a tied LM head: the embedding's weight
    used outside the embedding's own forward).

    For a model placed with a ``device_map`` the embedding may sit on another device than ``hidden`` (moved there) or
    be offloaded (accelerate leaves ``meta`` in its place: its weight is loaded for the call). ``hidden [..., H]``
    -> ``[..., V]``.
    """
    weight = module.weight
    if getattr(module, "_hf_hook", None) is None:
        if weight.is_meta:
            raise ConfigError(
                "the tied LM head's embedding is offloaded inside a larger block of the device_map; fix: give the "
                "input embedding its own device_map entry (e.g. 'model.embed_tokens': 'cpu')"
            )
        return F.linear(hidden.to(weight.device), weight)  # a no-op move when already there
    from accelerate.utils import align_module_device  # noqa: PLC0415 - only reached for accelerate-placed models

    device = execution_device(module)
    with align_module_device(module, device):
        return F.linear(hidden.to(device), module.weight)


def dispatch_checkpoint(
    build: Callable[[], nn.Module],
    path: str | os.PathLike,
    device_map: DeviceMap,
    dtype: torch.dtype,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    no_split: list[str] | None = None,
) -> nn.Module:
    """Build a model with empty weights, check its keys against the checkpoint at ``path``, read the weights into
    their devices per ``device_map`` (in ``dtype``) and attach accelerate's hooks.

    Args:
        build: ``() -> nn.Module`` constructing the model (called under ``accelerate.init_empty_weights``: weights
            on ``meta``, buffers real).
        path: checkpoint directory (``model.safetensors`` or a sharded index).
        device_map: see the module docstring.
        dtype: dtype of the floating-point weights.
        offload_folder: where ``"disk"`` weights are written (default: a new temporary directory).
        max_memory: caps for the automatic maps, e.g. ``{0: "20GiB", 1: "20GiB", "cpu": "64GiB"}``.
        no_split: module class names accelerate must keep on one device (decoder layers).
    Returns:
        The model in eval mode with ``hf_device_map`` set.
    Raises:
        MissingDependencyError: accelerate is not installed; ConfigError: a bad ``device_map``;
        CheckpointKeyError: strict key matching failed.
    """
    accelerate = require_accelerate()
    from accelerate.utils import load_checkpoint_in_model  # noqa: PLC0415 - optional dependency

    root = Path(path)
    with accelerate.init_empty_weights(include_buffers=False):
        model = build()
    check_keys(model, _checkpoint_shapes(root), root)
    no_split = list(no_split if no_split is not None else getattr(model, "_no_split_modules", None) or [])
    placed = resolve_device_map(model, device_map, dtype, no_split, max_memory)
    if "disk" in placed.values() and offload_folder is None:
        offload_folder = tempfile.mkdtemp(prefix="spiffy-offload-")
    files, weight_map = checkpoint_files(root)
    checkpoint = root / "model.safetensors.index.json" if weight_map is not None else files[0]
    load_checkpoint_in_model(model, str(checkpoint), device_map=placed, offload_folder=offload_folder, dtype=dtype,
                             strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model = accelerate.dispatch_model(model, device_map=placed, offload_dir=offload_folder)
    model.hf_device_map = placed
    return model.eval()
