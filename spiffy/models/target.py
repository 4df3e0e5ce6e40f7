"""The Qwen3 target of AR speculative decoding: :func:`load_target` (transformers' class; one device, a
``device_map`` across devices, or ``tp_plan`` tensor parallel under torchrun)."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from transformers import Qwen3ForCausalLM

from spiffy.errors import CheckpointError, ConfigError
from spiffy.models.checkpoint import CONFIG_FILE, read_config_dict
from spiffy.models.flex import target_attention
from spiffy.models.hub import checkpoint_dir
from spiffy.models.placement import DeviceMap, placement_device, qwen3_from_pretrained, qwen3_tensor_parallel

__all__ = ["load_target"]


def load_target(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
    device_map: DeviceMap | None = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    attn_implementation: str = "sdpa",
    tp_plan: Any = None,
) -> torch.nn.Module:
    """Load a Qwen3 target checkpoint directory for AR speculative decoding (eval mode).

    ``device_map`` / ``offload_folder`` / ``max_memory`` place it across devices (see :func:`load_model`);
    ``tp_plan="auto"`` shards it over the ranks of a ``torchrun`` launch (tensor parallel; docs/SCALING.md);
    ``attn_implementation`` is ``"sdpa"`` (default), ``"eager"`` or ``"flex_attention"`` (the tree masks of
    verification become flex block masks); flash-attn cannot take tree masks.

    Raises:
        CheckpointError: no ``config.json`` or unreadable weights; ConfigError: not a ``qwen3`` checkpoint, or an
            attention implementation that cannot take tree masks.
    """
    root = checkpoint_dir(path)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"no config.json in {root}; fix: --target must be a Qwen3 checkpoint directory")
    raw = read_config_dict(root)
    if raw.get("model_type") != "qwen3":
        raise ConfigError(
            f"--target {root} has model_type {raw.get('model_type')!r}; AR mode needs a Qwen3 target "
            "(model_type 'qwen3'); fix: pass a Qwen3 checkpoint, or use --model for diffusion LMs"
        )
    impl = target_attention(attn_implementation)
    if tp_plan is not None:
        if device_map is not None:
            raise ConfigError("tp_plan and device_map are two different placements; fix: pass one of them")
        return qwen3_tensor_parallel(root, dtype, impl, tp_plan)
    device, device_map = placement_device(device, device_map)
    if device_map is not None:
        return qwen3_from_pretrained(root, dtype, impl, device_map, offload_folder, max_memory)
    try:
        model = Qwen3ForCausalLM.from_pretrained(str(root), dtype=dtype, attn_implementation=impl,
                                                 local_files_only=True)
    except OSError as exc:
        raise CheckpointError(f"cannot load the target from {root}: {exc}") from exc
    return model.to(device).eval()
