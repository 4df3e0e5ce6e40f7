"""The targets of AR speculative decoding: :func:`load_target` (transformers' own classes; one device, a
``device_map`` across devices, or ``tp_plan`` tensor parallel under torchrun), and what a target must be.

A target is a transformers decoder-only causal LM whose attention layers attend through the 4-D additive mask they
are given (explicit ``position_ids``) and keep their state in a K/V cache that can be cut back to a length.
Verification then computes each tree node exactly as the same path decoded alone. Its linear-attention (recurrent)
layers, if any (hybrids: Qwen3.5, Qwen3-Next), are run branch by branch and advanced over the accepted path by
:class:`~spiffy.models.recurrent.RecurrentMixers`, which makes them exact too. The architectures with a registry
entry (:func:`target_families`: Qwen3, Qwen3-MoE, Qwen2/Qwen2.5, Llama, Mistral, Qwen3.5, Qwen3-Next) are proved so
by the target tests. Refused, with :class:`~spiffy.errors.UnsupportedTargetError` naming the architecture and why
(:func:`check_target_config`):

* sliding-window or chunked layers (Gemma 3, gpt-oss, Mistral with ``sliding_window``): a 4-D mask replaces
  transformers' window mask and the sliding cache layers cannot be cut back to an earlier length;
* any other layer kind that is neither full attention nor a recurrent kind spiffy runs branch by branch.

Any other ``model_type`` raises :class:`~spiffy.errors.UnknownModelTypeError` listing the supported ones.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from spiffy.errors import (
    CheckpointError,
    ConfigError,
    QuantizationError,
    UnknownModelTypeError,
    UnsupportedTargetError,
)
from spiffy.models.checkpoint import CONFIG_FILE, check_loading_info, load_failure, loading_report, read_config_dict
from spiffy.models.flex import target_attention
from spiffy.models.hub import checkpoint_dir
from spiffy.models.placement import DeviceMap, native_from_pretrained, native_tensor_parallel, placement_device
from spiffy.models.quantize import (
    check_checkpoint_quantization,
    decompressed,
    check_runs_on,
    checkpoint_quantization,
    hf_quantization_config,
    parse_quantization,
)
from spiffy.models.recurrent import RECURRENT_KINDS
from spiffy.models.registry import FAMILIES, FamilySpec

__all__ = [
    "check_target_config",
    "experts_implementation",
    "load_native",
    "load_target",
    "target_families",
    "target_spec",
]

#: the layer kind every layer of a target must have (transformers' ``config.layer_types`` spelling)
FULL_ATTENTION = "full_attention"
#: why a layer kind cannot be verified exactly, by transformers' ``layer_types`` spelling
_REFUSED_LAYERS: dict[str, str] = {
    "sliding_attention": (
        "its sliding-window layers take transformers' window mask, which a 4-D tree mask replaces, and their cache "
        "layers cannot be cut back to an earlier length"
    ),
    "chunked_attention": (
        "its chunked-attention layers take transformers' chunk mask, which a 4-D tree mask replaces, and their cache "
        "layers cannot be cut back to an earlier length"
    ),
}


def target_families() -> dict[str, FamilySpec]:
    """The registry's AR target families (transformers' own causal-LM classes whose layers verify exactly), by name."""
    return {name: spec for name, spec in FAMILIES.items()
            if spec.verifiable and not (spec.diffusion or spec.drafter or spec.own_classes)}


def _supported() -> str:
    return ", ".join(repr(spec.model_type) for spec in target_families().values())


def _layer_kinds(config: Any) -> list[str]:
    """Each layer's kind (``layer_types`` spelling) of a config object or dict (a multimodal config's text part)."""
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    text = get("text_config")
    if text is not None:
        return _layer_kinds(text)
    kinds = list(get("layer_types") or [])
    if kinds:
        return [str(k) for k in kinds]
    window = get("sliding_window")
    sliding = window is not None and bool(get("use_sliding_window", True))
    return ["sliding_attention" if sliding else FULL_ATTENTION] * int(get("num_hidden_layers") or 1)


def check_target_config(config: Any, where: str = "the target") -> None:
    """Raise :class:`UnsupportedTargetError` unless every layer of ``config`` (object or dict) is full attention or a
    recurrent kind of :data:`~spiffy.models.recurrent.RECURRENT_KINDS` (run branch by branch).

    The message is one line naming the ``model_type``, the first refused layer kind and why it cannot be exact.
    """
    kinds = _layer_kinds(config)
    refused = next((k for k in kinds if k != FULL_ATTENTION and k not in RECURRENT_KINDS), None)
    if refused is None:
        return
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    why = _REFUSED_LAYERS.get(refused, f"its {refused!r} layers are not plain masked attention over a K/V cache")
    count = sum(k == refused for k in kinds)
    raise UnsupportedTargetError(
        f"{where} is a {model_type!r} model with {count} of {len(kinds)} layers of kind {refused!r}: {why}; "
        f"fix: use a target whose layers are full or linear attention (model types {_supported()})"
    )


def target_spec(raw: Mapping[str, Any], where: str = "the target") -> FamilySpec:
    """The target family of a raw ``config.json`` dict, after :func:`check_target_config`.

    Raises:
        UnsupportedTargetError: an architecture with layers that cannot be verified exactly (named, with why);
        UnknownModelTypeError: any other architecture without a target registry entry.
    """
    model_type = raw.get("model_type")
    text = raw.get("text_config")
    # a multimodal checkpoint (Qwen3.5's Qwen3_5ForConditionalGeneration) is verified through its text model, which
    # the family's causal-LM class loads from the same files (transformers maps the keys, skips the vision tower)
    text_type = text.get("model_type") if isinstance(text, Mapping) else None
    spec = next((s for s in target_families().values() if s.model_type in (model_type, text_type)), None)
    check_target_config(raw, where)
    if spec is None:
        raise UnknownModelTypeError(
            f"{where} has model_type {model_type!r}, which is not a supported AR target; supported model types: "
            f"{_supported()}; fix: pass such a checkpoint, or use --model for diffusion LMs"
        )
    return spec


def experts_implementation(dtype: torch.dtype) -> dict[str, str]:
    """``{"experts_implementation": "eager"}`` in float64 (transformers' default mixture-of-experts kernel,
    ``grouped_mm``, takes no float64; a dense model ignores it), else ``{}`` (transformers' choice). Every
    implementation routes each token on its own (top-k of its router logits, no capacity limit), so a row never
    depends on the others."""
    return {"experts_implementation": "eager"} if dtype == torch.float64 else {}


def load_target(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
    device_map: DeviceMap | None = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    attn_implementation: str = "sdpa",
    tp_plan: Any = None,
    quantization: Any = None,
) -> torch.nn.Module:
    """Load an AR target checkpoint directory (or Hub id) with its transformers class, in eval mode.

    ``device_map`` / ``offload_folder`` / ``max_memory`` place it across devices (see :func:`load_model`);
    ``tp_plan="auto"`` shards it over the ranks of a ``torchrun`` launch (tensor parallel; docs/SCALING.md);
    ``attn_implementation`` is ``"sdpa"`` (default), ``"eager"`` or ``"flex_attention"`` (the tree masks of
    verification become flex block masks); flash-attn cannot take tree masks. ``quantization`` quantizes it on load
    (``"int8"``, ``"int4:G"``, ``"bnb-nf4"``, a torchao or transformers config: :mod:`spiffy.models.quantize`); a
    checkpoint saved quantized (its ``quantization_config``) loads quantized by itself.

    Raises:
        CheckpointError: no ``config.json`` or unreadable weights; UnsupportedTargetError: an architecture whose
            layers cannot be verified exactly (sliding windows); UnknownModelTypeError: an
            architecture without a target entry; ConfigError: an attention implementation that cannot take tree masks;
        QuantizationError: a quantization whose kernels do not run on ``device`` (FP8 on a CPU), given twice.
    """
    root = checkpoint_dir(path)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"no config.json in {root}; fix: --target must be a checkpoint directory")
    spec = target_spec(read_config_dict(root), f"--target {root}")
    impl = target_attention(attn_implementation)
    return load_native(spec, root, dtype, device, device_map, offload_folder, max_memory, impl, tp_plan,
                       quantization)


def load_native(
    spec: FamilySpec,
    root: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
    device_map: DeviceMap | None = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    attn_implementation: str = "sdpa",
    tp_plan: Any = None,
    quantization: Any = None,
) -> torch.nn.Module:
    """A checkpoint of a family with transformers' own class (``spec.model_class``) through its ``from_pretrained``
    (which maps the stored layout, e.g. per-expert MoE weights, onto the class), in eval mode, with strict keys
    (CheckpointKeyError names missing, unexpected and shape-mismatched ones); no target checks. A checkpoint's own
    ``quantization_config`` and ``quantization`` (on load) go through transformers' quantizers, after
    :func:`~spiffy.models.quantize.check_checkpoint_quantization` / ``check_runs_on`` refuse what would not run."""
    cls = spec.model_class
    extra: dict[str, Any] = dict(experts_implementation(dtype))
    where = f"the checkpoint {root}"
    raw = read_config_dict(root)
    # with a device_map the weights go to the GPUs when there are any (accelerate's choice), else the CPU
    runs_on = device if device_map is None else ("cuda" if torch.cuda.is_available() else "cpu")
    check_checkpoint_quantization(raw, runs_on, where)
    quant = parse_quantization(quantization)
    if quant is not None:
        if checkpoint_quantization(raw) is not None:
            raise QuantizationError(f"{where} is saved quantized ({checkpoint_quantization(raw).get('quant_method')})"
                                    f"; fix: drop quantization={quant.name!r} (--quantize) or load its unquantized "
                                    "release")
        check_runs_on(quant, runs_on, where)
        extra["quantization_config"] = hf_quantization_config(quant)
        if quant.library == "bitsandbytes" and device_map is None and tp_plan is None:
            # bitsandbytes weights are placed by the loader (transformers refuses to move them after)
            device_map = {"": str(torch.device(device if device is not None else "cpu"))}
    if tp_plan is not None:
        if device_map is not None:
            raise ConfigError("tp_plan and device_map are two different placements; fix: pass one of them")
        return decompressed(native_tensor_parallel(cls, root, dtype, attn_implementation, tp_plan, **extra))
    device, device_map = placement_device(device, device_map)
    if device_map is not None:
        return decompressed(native_from_pretrained(cls, root, dtype, attn_implementation, device_map, offload_folder,
                                                   max_memory, **extra))
    with loading_report() as report:
        try:
            model, info = cls.from_pretrained(str(root), dtype=dtype, attn_implementation=attn_implementation,
                                              local_files_only=True, output_loading_info=True, **extra)
        except OSError as exc:
            raise CheckpointError(f"cannot load {root}: {exc}") from exc
        except RuntimeError as exc:  # transformers' weight conversion (e.g. fusing per-expert weights) failed
            raise load_failure(exc, root, report) from exc
    check_loading_info(info, root)
    return decompressed(model).to(device).eval()
