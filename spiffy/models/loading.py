"""Load and save checkpoints of every supported family; special-token lookup.

* :func:`load_model` - dispatch on config.json ``model_type`` (``"llada"``, ``"Dream"``, ``"sdar"`` -> spiffy's
  own modules; an AR target family (``"qwen3"``, ``"qwen3_moe"``, ``"qwen2"``, ``"llama"``, ...) -> its transformers
  class through ``from_pretrained``; a drafter family (a config with ``dflash_config`` or architectures
  ``["DFlashDraftModel"]``, or a DFlash2 config) -> its ``FamilySpec.loader``). Reads ``model.safetensors``
  or a sharded ``model.safetensors.index.json`` (:mod:`spiffy.models.checkpoint`), with strict key matching.
* :func:`load_target` (from :mod:`spiffy.models.target`) - an AR target (transformers' own class) for AR speculative
  decoding.
* :func:`save_checkpoint` - config.json (with the official ``auto_map``), sharded safetensors + index, optional
  tokenizer and generation config, written to a temporary directory and renamed into place.
* :func:`load_tokenizer`, :func:`family_of`, :func:`mask_token_id`, :func:`special_token_ids`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from spiffy.errors import CheckpointError, ConfigError, MissingTokenError, QuantizationError, UnknownModelTypeError
from spiffy.io import replace_dir
from spiffy.models.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    alias_groups,
    check_keys,
    checkpoint_files,
    iter_checkpoint_keys,
    load_state_dict,
    read_config_dict,
)
from spiffy.models.hub import checkpoint_dir, resolve_checkpoint
from spiffy.models.flash import FLASH, require_flash_attn
from spiffy.models.flex import target_attention
from spiffy.models.layers import ATTN_IMPLEMENTATIONS
from spiffy.models.dflash import is_dflash_config
from spiffy.models.dflash2 import is_dflash2_config
from spiffy.models.placement import DeviceMap, dispatch_checkpoint, placement_device
from spiffy.models.quantize import checkpoint_quantization, quantize_model
from spiffy.models.registry import FAMILIES, family_of_model_type, family_spec, model_types, variant_family
from spiffy.models.target import load_native, load_target
from spiffy.torch_utils import resolve_dtype

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# --------------------------------------------------------------------------------------------------------------
# config / family
# --------------------------------------------------------------------------------------------------------------


def _config_as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (str, os.PathLike)):
        return read_config_dict(obj)
    config = getattr(obj, "config", obj)
    if hasattr(config, "to_dict"):
        data = config.to_dict()
        # to_dict() may drop class attributes such as model_type on some versions
        data.setdefault("model_type", getattr(config, "model_type", None))
        return data
    if hasattr(config, "model_type") and hasattr(config, "__dict__"):  # a plain namespace standing in for a config
        return dict(vars(config))
    raise ConfigError(f"cannot read a model config from {type(obj).__name__}; pass a path, config, dict or model")


def family_of(path_or_config: Any) -> str:
    """The spiffy family (``"llada"``, ``"dream"``, ``"sdar"``, ``"qwen3"``, ``"llama"``, ..., ``"dflash"``, ``"dflash2"``) of a checkpoint path,
    config object, config dict or model. UnknownModelTypeError for an unsupported ``model_type``."""
    model = path_or_config
    if hasattr(model, "config") and not isinstance(model, (str, os.PathLike, Mapping)):
        for name, spec in FAMILIES.items():  # spiffy's own classes say their family (a drafter shares a model type)
            if spec.own_classes and type(model).__name__ == spec.model_class_path.rpartition(".")[2]:
                return name
    cfg = _config_as_dict(path_or_config)
    if is_dflash2_config(cfg):  # a DFlash2 config is a DFlash config too: the more specific family first
        return "dflash2"
    if is_dflash_config(cfg):
        return "dflash"
    model_type = cfg.get("model_type")
    family = variant_family(cfg) or family_of_model_type(model_type)
    if family is None:
        supported = ", ".join(repr(t) for t in model_types())
        raise UnknownModelTypeError(
            f"model_type {model_type!r} is not supported; supported model types: {supported} (plus DFlash drafters: "
            "a qwen3 config with dflash_config); fix: point at a LLaDA, Dream, SDAR or AR target checkpoint"
        )
    return family


# --------------------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike, family: str | None = None) -> Any:
    """The transformers config object of a checkpoint (spiffy's class for LLaDA/Dream/SDAR)."""
    data = read_config_dict(path)
    family = family or family_of(data)
    spec = family_spec(family)
    cls = spec.config_class
    try:
        return cls.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json in {str(path)!r} is invalid for {family}: {exc}; fix the config") from exc


def load_model(
    path: str | os.PathLike,
    dtype: Any = None,
    device: Any = None,
    attn_implementation: str = "sdpa",
    revision: str | None = None,
    device_map: DeviceMap | None = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    quantization: Any = None,
) -> torch.nn.Module:
    """Load a checkpoint directory or Hub id into its model class, in eval mode.

    Args:
        path: directory with config.json and ``model.safetensors`` or ``model.safetensors.index.json`` + shards,
            or a Hub id ``ORG/NAME[@REVISION]`` (resolved by :func:`spiffy.models.hub.resolve_checkpoint`).
        dtype: ``torch.dtype``, a name (``"float64"``, ``"bf16"``, ...), ``"auto"`` (config ``torch_dtype``) or
            ``None`` (float32 on CPU, ``"auto"`` on accelerators).
        device: where the weights go (default CPU).
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flex_attention"`` (:mod:`spiffy.models.flex`:
            block masks for the tree / verification / ragged-batch masks; the Qwen3 target gets spiffy's flex kernel
            through transformers' AttentionInterface) or, for the dLLM families only, ``"flash_attention_2"``
            (:mod:`spiffy.models.flash`: flash-attn for mask-free calls, SDPA for masked ones; needs flash-attn).
        revision: branch, tag or commit of a Hub id.
        device_map: place the model across devices with accelerate (:mod:`spiffy.models.placement`): ``"auto"``
            (GPUs, then CPU, then disk, capped by ``max_memory``), one device (``"cpu"``, ``"cuda:1"``: the same as
            ``device``) or a dict ``{module name: device | "cpu" | "disk"}``. ``device`` is ignored then.
        offload_folder: where weights mapped to ``"disk"`` are written (default: a temporary directory).
        max_memory: per-device caps for the automatic maps, e.g. ``{0: "20GiB", "cpu": "64GiB"}``.
        quantization: quantize on load (:mod:`spiffy.models.quantize`): ``"int8"``, ``"int4"`` / ``"int4:G"``,
            ``"fp8"`` (CUDA), ``"bnb-int8"`` / ``"bnb-nf4"`` / ``"bnb-fp4"`` (AR targets), a torchao config or a
            transformers quantization config. An AR target goes through transformers' quantizer (its checkpoint's
            own ``quantization_config`` too); spiffy's own classes (dLLMs, drafters) through torchao's ``quantize_``
            on their linear layers (the output head stays as it is).

    ``model.name_or_path`` is the directory, or ``ORG/NAME@COMMIT`` for a Hub snapshot (what graph files record).

    Raises:
        CheckpointError: directory / config / weights missing or unreadable; CheckpointNotCachedError: a Hub id
            that is not cached while offline.
        CheckpointKeyError: strict key matching failed (names the keys).
        UnknownModelTypeError: unsupported ``model_type``.
        MissingDependencyError: ``device_map`` without accelerate, ``flash_attention_2`` without flash-attn,
            a quantization without torchao / bitsandbytes.
        QuantizationError: a quantization whose kernels do not run on ``device`` (FP8 on a CPU), a checkpoint of
            spiffy's own classes saved quantized, an ``int4:G`` group that does not divide a layer.
    """
    resolved = resolve_checkpoint(path, revision)
    path = resolved.path
    data = read_config_dict(path)
    family = family_of(data)
    spec = family_spec(family)
    native = not spec.own_classes  # transformers' own class (an AR target)
    device, device_map = placement_device(device, device_map)
    torch_dtype = resolve_dtype(dtype, data, device)
    if spec.own_classes and checkpoint_quantization(data) is not None:
        raise QuantizationError(
            f"{str(path)!r} is a {family} checkpoint saved quantized "
            f"({checkpoint_quantization(data).get('quant_method')}); spiffy's own classes load unquantized weights and "
            "quantize them on load; fix: load the unquantized checkpoint with quantization='int8' (--quantize int8)")
    if spec.drafter:
        drafter = spec.loader(path, dtype=torch_dtype, device=device, device_map=device_map,
                              offload_folder=offload_folder, max_memory=max_memory)
        return quantize_model(drafter, quantization)
    if native:  # transformers' own class: its from_pretrained maps the stored layout (e.g. per-expert MoE weights);
        # flex_attention is spiffy's kernel registered with transformers
        model = load_native(spec, path, torch_dtype, device, device_map, offload_folder, max_memory,
                            target_attention(attn_implementation), quantization=quantization)
        return _finish(model, resolved.reference, attn_implementation)
    if attn_implementation == FLASH:
        require_flash_attn()  # at load time, naming the fix, rather than at the first forward
    config = load_config(path, family)
    # built as SDPA: transformers' init-time flash check is for its own kernels; ours routes mask-free calls
    # to flash-attn itself (the config is switched after loading)
    config._attn_implementation = attn_implementation if attn_implementation in ATTN_IMPLEMENTATIONS[:3] else "sdpa"
    cls = spec.model_class
    if device_map is not None:
        model = dispatch_checkpoint(lambda: cls(config), path, device_map, torch_dtype, offload_folder, max_memory)
        return _finish(quantize_model(model, quantization), resolved.reference, attn_implementation)
    state = load_state_dict(path)
    with torch.device("meta"):
        model = cls(config)
    check_keys(model, state, path)
    converted = {k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}
    model.load_state_dict(converted, strict=True, assign=True)
    return _finish(quantize_model(model.eval(), quantization), resolved.reference, attn_implementation)


def _finish(model: torch.nn.Module, reference: str, attn_implementation: str) -> torch.nn.Module:
    """Record where the model came from; switch a dLLM to flash-attn routing once it is built."""
    model.name_or_path = reference
    if attn_implementation == FLASH and family_spec(family_of(model)).own_classes:
        model.config._attn_implementation = FLASH
    return model


def load_tokenizer(path: str | os.PathLike, revision: str | None = None):  # noqa: ANN201
    """The ``PreTrainedTokenizerFast`` saved in checkpoint directory or Hub id ``path`` (``tokenizer.json``)."""
    root = checkpoint_dir(path, revision, weights=False)
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(
            f"no tokenizer.json in {str(root)!r}; save a fast tokenizer there (tokenizer.save_pretrained) or "
            "rebuild the checkpoint with `spiffy tiny`"
        )
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:  # transformers raises several types here
        raise CheckpointError(f"cannot load the tokenizer in {str(root)!r}: {exc}; fix or regenerate it") from exc


# --------------------------------------------------------------------------------------------------------------
# special tokens
# --------------------------------------------------------------------------------------------------------------


def _token_id(tokenizer: Any, token: str | None) -> int | None:
    if tokenizer is None or not token:
        return None
    vocab = tokenizer.get_vocab()
    return int(vocab[token]) if token in vocab else None


def _maybe_tokenizer(obj: Any, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return tokenizer
    if isinstance(obj, (str, os.PathLike)) and (Path(obj) / "tokenizer.json").is_file():
        return load_tokenizer(obj)
    return None


def mask_token_id(model_or_config: Any, tokenizer: Any = None) -> int:
    """The mask token id of a diffusion model: the config's (``mask_token_id``; DFlash:
    ``dflash_config.mask_token_id``) or else the tokenizer's family mask token. MissingTokenError if neither."""
    family = family_of(model_or_config)
    spec = family_spec(family)
    cfg: Any = _config_as_dict(model_or_config)
    value = spec.mask_id_from_config(cfg)
    if value is not None:
        return value
    tok = _maybe_tokenizer(model_or_config, tokenizer)
    value = _token_id(tok, spec.mask_token)
    if value is None and tok is not None and getattr(tok, "mask_token", None):
        value = _token_id(tok, tok.mask_token)
    if value is None:
        where = f"config key {spec.mask_config_key!r}" if spec.mask_config_key else "the config"
        raise MissingTokenError(
            f"no mask token for family {family!r}: {where} is absent"
            + (f" and the tokenizer has no {spec.mask_token!r}" if spec.mask_token else "")
            + "; fix: set mask_token_id in config.json or pass the model's tokenizer (decoding: or mask_id=...)"
        )
    return value


@dataclass(frozen=True)
class SpecialTokenIds:
    """Special token ids of a model (``None`` = absent). ``ids.require("eos")`` raises MissingTokenError."""

    eos: int | None
    eot: int | None
    pad: int | None
    mask: int | None
    bos: int | None = None
    family: str = ""

    def __getitem__(self, name: str) -> int | None:
        return getattr(self, name)

    def require(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise MissingTokenError(
                f"the {self.family or 'model'} checkpoint defines no {name} token; fix: set it in config.json "
                "or pass the model's tokenizer"
            )
        return int(value)

    def stop_ids(self) -> list[int]:
        """Distinct ids that end a response (eos and end-of-turn)."""
        return sorted({i for i in (self.eos, self.eot) if i is not None})


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def special_token_ids(model_or_config: Any, tokenizer: Any = None) -> SpecialTokenIds:
    """``eos``, ``eot`` (end of turn: LLaDA ``<|eot_id|>``, others ``<|im_end|>``), ``pad``, ``mask``, ``bos`` ids
    from the config, else the tokenizer (the family's token strings from the registry). Never hard-coded. The one
    resolver of a model's token ids: decoding, calibration, the benchmarks and the CLI all read them here."""
    family = family_of(model_or_config)
    spec = family_spec(family)
    cfg = _config_as_dict(model_or_config)
    tok = _maybe_tokenizer(model_or_config, tokenizer)
    eos = _first_id(cfg.get("eos_token_id"))
    if eos is None and tok is not None:
        eos = _first_id(tok.eos_token_id)
    pad = _first_id(cfg.get("pad_token_id"))
    if pad is None and tok is not None:
        pad = _first_id(tok.pad_token_id)
    bos = _first_id(cfg.get("bos_token_id"))
    if bos is None and tok is not None:
        bos = _first_id(tok.bos_token_id)
    eot = _first_id(cfg.get("eot_token_id"))
    if eot is None:
        eot = _token_id(tok, spec.eot_token)
    try:
        mask = mask_token_id(model_or_config, tok) if spec.mask_token else None
    except MissingTokenError:
        mask = None
    return SpecialTokenIds(eos=eos, eot=eot, pad=pad, mask=mask, bos=bos, family=family)


# --------------------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------------------


def _dedupe_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop all but the first name of every tied parameter group (as transformers saves them)."""
    for group in alias_groups(model):
        for name in group[1:]:
            state.pop(name, None)
    return state


def _shard(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        t = state[key]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def save_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    min_shards: int = 1,
    tokenizer: Any = None,
    generation_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model`` as a checkpoint directory, atomically (temporary directory, then rename).

    Writes config.json (with the family's official ``auto_map`` and ``architectures``), safetensors weights -
    ``model.safetensors`` when one shard suffices, else ``model-0000i-of-0000n.safetensors`` + index - sharded at
    ``max_shard_bytes`` and into at least ``min_shards`` files, plus the tokenizer, ``generation_config.json`` and
    ``extra_files`` (name -> text) when given. An existing ``out_dir`` is replaced as a whole.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = model.config
    try:
        family: str | None = family_of(model)
    except (UnknownModelTypeError, ConfigError):
        family = None
    if family is not None and FAMILIES[family].auto_map:
        config.auto_map = dict(FAMILIES[family].auto_map)
    config.architectures = [type(model).__name__]
    if family is not None and not FAMILIES[family].own_classes:
        return _save_native(model, out, max_shard_bytes, min_shards, tokenizer, generation_config, extra_files)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    state = _dedupe_tied(model, state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    limit = max(1, int(max_shard_bytes))
    if min_shards > 1:
        limit = min(limit, max(1, math.ceil(total / min_shards)))
    shards = _shard(state, limit)
    if min_shards > 1 and len(shards) < min(min_shards, len(state)):
        # one tensor larger than the rest: split the sorted keys evenly instead
        keys = sorted(state)
        n = min(min_shards, len(keys))
        shards = [{k: state[k] for k in keys[i::n]} for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=str(out.parent)))
    try:
        config.save_pretrained(str(tmp))
        _write_extras(tmp, tokenizer, generation_config, extra_files)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            n = len(shards)
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{n:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_extras(tmp: Path, tokenizer: Any, generation_config: Mapping[str, Any] | None,
                  extra_files: Mapping[str, str] | None) -> None:
    """The tokenizer, ``generation_config.json`` and extra text files of a checkpoint being written in ``tmp``."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if generation_config is not None:
        gen = dict(generation_config)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text, encoding="utf-8")


def _save_native(model: torch.nn.Module, out: Path, max_shard_bytes: int, min_shards: int, tokenizer: Any,
                 generation_config: Mapping[str, Any] | None, extra_files: Mapping[str, str] | None) -> Path:
    """A transformers class's checkpoint through its own ``save_pretrained``: the published on-disk layout (e.g.
    per-expert MoE weights, which the class fuses in memory), sharded into at least ``min_shards`` files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = max(1, int(max_shard_bytes))
    if min_shards > 1:
        limit = min(limit, max(1, math.ceil(total / (min_shards + 1))))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=str(out.parent)))
    try:
        model.save_pretrained(str(tmp), max_shard_size=limit)
        if generation_config is not None:  # ours (the family's stop ids) replaces transformers' own
            (tmp / "generation_config.json").unlink(missing_ok=True)
        _write_extras(tmp, tokenizer, generation_config, extra_files)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SpecialTokenIds",
    "check_keys",
    "checkpoint_files",
    "family_of",
    "iter_checkpoint_keys",
    "load_config",
    "load_model",
    "load_state_dict",
    "load_target",
    "load_tokenizer",
    "mask_token_id",
    "read_config_dict",
    "resolve_dtype",
    "save_checkpoint",
    "special_token_ids",
]
