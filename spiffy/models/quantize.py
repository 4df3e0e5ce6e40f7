"""Quantized models: quantize on load (``quantization=`` / ``--quantize``) and checkpoints saved quantized.

Speculation never changes the model: a quantized target, drafter or dLLM is decoded by the same code, and every
method equals that quantized model's own baseline. This module only decides *how* a model is quantized and
refuses what cannot run as asked (:class:`~spiffy.errors.QuantizationError`, naming the method, the device and the
fix; never a silent dequantize).

Quantize on load, by name (:data:`QUANTIZATIONS`, :func:`parse_quantization`):

* ``int8``: torchao int8 weight-only (``Int8WeightOnlyConfig``: per-row int8 weights, activations in the model
  dtype). CPU and CUDA.
* ``int4`` / ``int4:G``: torchao 4-bit weight-only in groups of ``G`` input columns (default 128;
  ``IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(G))``, which runs on a CPU and a GPU). For
  torchao's CUDA int4 kernels pass their config object itself (``quantization=Int4WeightOnlyConfig()``).
* ``fp8``: torchao FP8 weights and dynamic per-row FP8 activations (``Float8DynamicActivationFloat8WeightConfig``):
  CUDA GPUs of compute capability 8.9 or newer only.
* ``bnb-int8``, ``bnb-nf4``, ``bnb-fp4``: bitsandbytes LLM.int8() and 4-bit (NF4 / FP4) through transformers'
  quantizer: AR targets (transformers' own classes), CPU (bitsandbytes' CPU backend) and CUDA.

``quantization`` may also be a torchao config object (any ``AOBaseConfig``) or a transformers quantization config
(``TorchAoConfig``, ``BitsAndBytesConfig``, ...). An AR target (transformers' class) is quantized by its
``from_pretrained`` (``quantization_config=``, so ``save_pretrained`` writes it and the saved checkpoint loads
quantized by path or Hub id); spiffy's own classes (the dLLMs, DFlash / DFlash2 drafters) by torchao's
``quantize_`` over their ``nn.Linear`` layers. Both skip what transformers skips: the output head and tied weights
(:func:`transformers.quantizers.base.get_keys_to_not_convert`), so a DFlash drafter reads the target's embedding
as it is and calls the target's head module, quantized or not.

A checkpoint's own ``quantization_config`` (Qwen3-8B-FP8, AWQ / GPTQ, compressed-tensors, bitsandbytes, torchao)
is honoured by transformers' quantizers on load; :func:`check_checkpoint_quantization` first refuses the methods
whose kernels do not run on the chosen device (transformers would dequantize an FP8 checkpoint on a CPU to bf16
with only a warning).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from spiffy.errors import MissingDependencyError, QuantizationError

__all__ = [
    "CHECKPOINT_METHODS",
    "QUANTIZATIONS",
    "Quantization",
    "check_checkpoint_quantization",
    "decompressed",
    "check_runs_on",
    "checkpoint_quantization",
    "hf_quantization_config",
    "parse_quantization",
    "quantization_label",
    "quantize_model",
    "weight_bytes",
]

#: default group of ``int4`` (input columns sharing one scale): torchao's and AWQ/GPTQ's usual 128
DEFAULT_INT4_GROUP = 128
#: where FP8 matmul kernels run: CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell)
FP8_MIN_CAPABILITY = (8, 9)
_EXTRA = "pip install 'spiffy-decoding[quant]'"


@dataclass(frozen=True)
class Quantization:
    """One way to quantize a model on load.

    Attributes:
        name: what ``--quantize`` says (``"int8"``, ``"int4:32"``, ``"bnb-nf4"``, or a config's class name).
        library: ``"torchao"`` or ``"bitsandbytes"`` (or ``"transformers"`` for another transformers config).
        devices: device types whose kernels run it (``"cpu"``, ``"cuda"``).
        what: one line for headers and errors.
        config: the torchao ``AOBaseConfig`` or transformers quantization config behind it.
    """

    name: str
    library: str
    devices: tuple[str, ...]
    what: str
    config: Any = field(default=None, compare=False)

    @property
    def torchao(self) -> bool:
        """True when torchao's ``quantize_`` can apply it to any module tree (spiffy's own classes included)."""
        return self.library == "torchao"


def _torchao() -> Any:
    try:
        import torchao.quantization as tq  # noqa: PLC0415 - optional dependency, imported when asked for
    except ImportError as exc:
        raise MissingDependencyError(f"quantization needs torchao, which is not installed; fix: {_EXTRA}") from exc
    return tq


def _bnb_config(kind: str) -> Any:
    try:
        import bitsandbytes  # noqa: F401, PLC0415 - optional dependency
    except ImportError as exc:
        raise MissingDependencyError(f"--quantize bnb-{kind} needs bitsandbytes, which is not installed; fix: "
                                     f"{_EXTRA}") from exc
    from transformers import BitsAndBytesConfig  # noqa: PLC0415

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind)


def _int8() -> Quantization:
    return Quantization("int8", "torchao", ("cpu", "cuda"), "torchao int8 weight-only (per-row scales)",
                        _torchao().Int8WeightOnlyConfig())


def _int4(group: int) -> Quantization:
    tq = _torchao()
    from torchao.quantization.granularity import PerGroup  # noqa: PLC0415

    config = tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))
    return Quantization(f"int4:{group}", "torchao", ("cpu", "cuda"),
                        f"torchao int4 weight-only (groups of {group})", config)


def _fp8() -> Quantization:
    tq = _torchao()
    config = tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerRow())
    return Quantization("fp8", "torchao", ("cuda",), "torchao fp8 weights, dynamic per-row fp8 activations", config)


def _bnb(kind: str) -> Quantization:
    what = {"int8": "bitsandbytes LLM.int8()", "nf4": "bitsandbytes 4-bit NF4", "fp4": "bitsandbytes 4-bit FP4"}[kind]
    return Quantization(f"bnb-{kind}", "bitsandbytes", ("cpu", "cuda"), what, _bnb_config(kind))


#: ``--quantize`` names -> what they mean (``int4`` also takes ``:G``, its group size)
QUANTIZATIONS: dict[str, str] = {
    "int8": "torchao int8 weight-only; CPU and CUDA",
    "int4": f"torchao int4 weight-only, groups of {DEFAULT_INT4_GROUP} (int4:G for groups of G); CPU and CUDA",
    "fp8": "torchao fp8 weights and activations; CUDA GPUs of compute capability >= 8.9 only",
    "bnb-int8": "bitsandbytes LLM.int8(); AR targets; CPU and CUDA",
    "bnb-nf4": "bitsandbytes 4-bit NF4; AR targets; CPU and CUDA",
    "bnb-fp4": "bitsandbytes 4-bit FP4; AR targets; CPU and CUDA",
}


def parse_quantization(value: Any) -> Quantization | None:
    """A :class:`Quantization` from a ``--quantize`` name, a torchao config, a transformers quantization config or
    a :class:`Quantization`; ``None`` / ``"none"`` -> ``None``.

    Raises:
        QuantizationError: an unknown name or a bad group size (the message lists the names).
        MissingDependencyError: torchao or bitsandbytes is not installed (names the extra).
    """
    if value is None or isinstance(value, Quantization):
        return value
    if isinstance(value, str):
        return _parse_name(value.strip().lower())
    if type(value).__name__ == "TorchAoConfig":  # transformers' wrapper of a torchao config
        inner = value.quant_type
        return Quantization(type(inner).__name__, "torchao", ("cpu", "cuda"), f"torchao {type(inner).__name__}", inner)
    if type(value).__name__ == "BitsAndBytesConfig":
        kind = "int8" if value.load_in_8bit else value.bnb_4bit_quant_type
        return Quantization(f"bnb-{kind}", "bitsandbytes", ("cpu", "cuda"), f"bitsandbytes {kind}", value)
    if hasattr(value, "quant_method"):  # another transformers quantization config: its quantizer decides
        method = str(getattr(value.quant_method, "value", value.quant_method))
        return Quantization(method, "transformers", ("cuda",), f"transformers {type(value).__name__}", value)
    _torchao()
    from torchao.core.config import AOBaseConfig  # noqa: PLC0415

    if isinstance(value, AOBaseConfig):
        name = type(value).__name__
        devices = ("cuda",) if "Float8" in name or "Int4WeightOnly" in name else ("cpu", "cuda")
        return Quantization(name, "torchao", devices, f"torchao {name}", value)
    raise QuantizationError(f"quantization={value!r} is not a quantization; fix: pass one of "
                            f"{', '.join(QUANTIZATIONS)}, a torchao config or a transformers quantization config")


def _parse_name(name: str) -> Quantization | None:
    if name in ("", "none"):
        return None
    base, _, group = name.partition(":")
    if base == "int4":
        try:
            size = int(group) if group else DEFAULT_INT4_GROUP
        except ValueError:
            size = 0
        if size < 2 or size & (size - 1):
            raise QuantizationError(f"--quantize {name}: the int4 group size must be a power of two >= 2, e.g. "
                                    "int4:32 or int4:128")
        return _int4(size)
    if group:
        raise QuantizationError(f"--quantize {name}: only int4 takes a group size (int4:G)")
    makers = {"int8": _int8, "fp8": _fp8, "bnb-int8": lambda: _bnb("int8"), "bnb-nf4": lambda: _bnb("nf4"),
              "bnb-fp4": lambda: _bnb("fp4")}
    if name not in makers:
        raise QuantizationError(f"--quantize {name!r} is not a quantization; fix: use one of "
                                f"{', '.join(QUANTIZATIONS)} (or none)")
    return makers[name]()


def check_runs_on(quant: Quantization, device: Any, where: str = "the model") -> None:
    """Raise :class:`QuantizationError` unless ``quant``'s kernels run on ``device`` (FP8 needs a CUDA GPU of
    compute capability 8.9+; bitsandbytes and torchao int8/int4 run on CPU and CUDA)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type not in quant.devices:
        raise QuantizationError(
            f"{where}: {quant.what} ({quant.name}) has no kernels on {dev.type}; it runs on "
            f"{' or '.join(quant.devices)}" + (" (compute capability >= 8.9)" if quant.devices == ("cuda",) else "")
            + "; spiffy does not dequantize it silently; fix: run on such a device (--device cuda) or choose a "
            "quantization that runs here (--quantize int8 or int4 on a CPU)")
    if "fp8" in quant.name.lower() or "Float8" in quant.name:
        _check_fp8_capability(dev, where, quant.what)


def _check_fp8_capability(dev: torch.device, where: str, what: str) -> None:
    if dev.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(dev)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            raise QuantizationError(
                f"{where}: {what} needs FP8 matmul kernels (compute capability >= 8.9: 4090, L40S, H100, H200), this "
                f"GPU has {cap[0]}.{cap[1]}; fix: use --quantize int8 / int4, or a newer GPU")


def hf_quantization_config(quant: Quantization) -> Any:
    """The transformers quantization config that quantizes an AR target in its ``from_pretrained`` (so that
    ``save_pretrained`` records it): ``TorchAoConfig(quant_type=...)`` for torchao, else the config itself."""
    if quant.library != "torchao":
        return quant.config
    from transformers import TorchAoConfig  # noqa: PLC0415

    return TorchAoConfig(quant_type=quant.config)


def quantize_model(model: nn.Module, quantization: Any, device: Any = None) -> nn.Module:
    """Quantize ``model``'s ``nn.Linear`` layers in place with torchao (not the output head nor tied weights, as
    transformers' quantizers skip them) and return it; ``model._spiffy_quantization`` records what was done.

    Works on spiffy's own classes (dLLMs, DFlash / DFlash2 drafters) and on a transformers model in memory.

    Raises:
        QuantizationError: a bitsandbytes or other non-torchao quantization (it needs transformers' loader: pass it
            to ``load_target`` / ``load_model`` of an AR target), kernels that do not run on the model's device, or
            an ``int4:G`` group that does not divide a layer's input width (names the layer and a group that fits).
    """
    quant = parse_quantization(quantization)
    if quant is None:
        return model
    if not quant.torchao:
        raise QuantizationError(
            f"{quant.what} ({quant.name}) quantizes through transformers' loader, which only AR targets "
            f"(transformers' own classes) go through, not a {type(model).__name__}; fix: use --quantize int8 or "
            "int4 (torchao) for diffusion LMs and drafters")
    first = next(model.parameters(), None)
    check_runs_on(quant, device if device is not None else (first.device if first is not None else "cpu"),
                  type(model).__name__)
    skip = _keys_to_skip(model)
    group = _group_size(quant.config)
    chosen: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not _skipped(name, skip):
            if group is not None and module.in_features % group:
                raise QuantizationError(
                    f"{type(model).__name__}.{name} has {module.in_features} input columns, not a multiple of the "
                    f"int4 group size {group}; fix: --quantize int4:{_fitting_group(model, skip)}")
            chosen[name] = module
    if not chosen:
        raise QuantizationError(f"{type(model).__name__} has no linear layer to quantize")
    ao = _torchao()
    ao.quantize_(model, quant.config, filter_fn=lambda module, fqn: fqn in chosen)
    model._spiffy_quantization = quant  # what quantization_label reports
    return model


def _keys_to_skip(model: nn.Module) -> list[str]:
    from transformers.quantizers.base import get_keys_to_not_convert  # noqa: PLC0415

    try:
        return list(get_keys_to_not_convert(model))
    except AttributeError:  # not a PreTrainedModel (a bare module tree): skip nothing
        return []


def _skipped(name: str, skip: list[str]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module  # noqa: PLC0415

    return not should_convert_module(name, skip)


def _group_size(config: Any) -> int | None:
    granularity = getattr(config, "granularity", None)
    size = getattr(granularity, "group_size", None)
    return int(size) if size else getattr(config, "group_size", None)


def _fitting_group(model: nn.Module, skip: list[str]) -> int:
    widths = [m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _skipped(n, skip)]
    group = DEFAULT_INT4_GROUP
    while group > 2 and any(w % group for w in widths):
        group //= 2
    return group


# ------------------------------------------------------------------------------------ checkpoints saved quantized

#: a checkpoint's ``quantization_config.quant_method`` -> (device types its kernels run on, what it is, the fix
#: where it does not run). transformers' quantizers load them; these are refused before loading where they would not
#: run (or would be dequantized silently, as transformers does with FP8 on a CPU).
CHECKPOINT_METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "torchao": (("cpu", "cuda"), "torchao"),
    "bitsandbytes": (("cpu", "cuda"), "bitsandbytes"),
    "fp8": (("cuda",), "fine-grained FP8 (Qwen3-*-FP8; FP8 matmul kernels, compute capability >= 8.9)"),
    "awq": (("cuda",), "AWQ 4-bit (its GEMM kernels: gptqmodel or autoawq on a CUDA GPU)"),
    "gptq": (("cuda",), "GPTQ 4-bit (its kernels: gptqmodel on a CUDA GPU)"),
    "compressed-tensors": (("cpu", "cuda"), "compressed-tensors (integer schemes decompress on a CPU)"),
}


def checkpoint_quantization(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` of a raw ``config.json`` dict (a multimodal config's text part too), or None."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    return dict(q) if q else None


def _compressed_fp8(q: Mapping[str, Any]) -> bool:
    """Whether a compressed-tensors config quantizes some weights to FP8 (a ``float`` scheme of 8 bits)."""
    groups = (q.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
               for g in groups) or "float" in str(q.get("format", ""))


def check_checkpoint_quantization(raw: Mapping[str, Any], device: Any, where: str = "the checkpoint") -> None:
    """Refuse, with :class:`QuantizationError`, a checkpoint whose ``quantization_config`` cannot run on
    ``device``: FP8 (fine-grained or compressed-tensors float8) anywhere but a CUDA GPU of compute capability
    >= 8.9, AWQ / GPTQ off CUDA, an unknown ``quant_method`` (the message names it and the supported ones)."""
    q = checkpoint_quantization(raw)
    if q is None:
        return
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    dev = torch.device(device if device is not None else "cpu")
    if method not in CHECKPOINT_METHODS:
        raise QuantizationError(
            f"{where} is quantized with quant_method {method!r}, which spiffy has not verified; supported: "
            f"{', '.join(CHECKPOINT_METHODS)}; fix: use an unquantized checkpoint with --quantize int8 / int4")
    devices, what = CHECKPOINT_METHODS[method]
    fp8 = method == "fp8" or (method == "compressed-tensors" and _compressed_fp8(q))
    if fp8:
        devices, what = ("cuda",), f"{what} with FP8 weights (FP8 matmul kernels, compute capability >= 8.9)"
    if dev.type not in devices:
        raise QuantizationError(
            f"{where} is quantized with {what}; its kernels do not run on {dev.type} (they run on "
            f"{' or '.join(devices)}), and spiffy does not dequantize it silently (transformers would turn FP8 into "
            "bf16 with a warning: another model than the one you asked for); fix: run it on a CUDA GPU "
            "(--device cuda), or load the unquantized release and quantize it here with --quantize int8 or int4")
    if fp8:
        _check_fp8_capability(dev, where, what)


# -------------------------------------------------------------------------------------------- what a model holds


def decompressed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a compressed-tensors checkpoint's packed weights decompressed now, not on its first forward.

    transformers loads a compressed-tensors checkpoint (W4A16 / W8A16 releases) with its weights still packed and a
    pre-hook on the whole model's ``forward`` that decompresses them on the first call. spiffy calls the decoder
    stack (``model.model``) and the head apart, which that hook never sees: the layers would have no ``weight``.
    Decompressing at load is what the hook would do (transformers has no kernel for packed integer weights, so the
    model runs decompressed either way); the ``quantization_config`` stays on the config. Other models: unchanged."""
    compressor = getattr(getattr(model, "hf_quantizer", None), "compressor", None)
    if compressor is not None and hasattr(model, "ct_decompress_hook"):  # the attribute compressed-tensors sets
        compressor.decompress_model(model)  # removes the hook too
    return model


def quantization_label(model: Any) -> str:
    """One line saying how ``model`` is quantized (``"none"`` when it is not): spiffy's on-load quantization, or
    the checkpoint's ``quantization_config`` (method and its main fields)."""
    quant = getattr(model, "_spiffy_quantization", None)
    if quant is not None:
        return f"{quant.name} ({quant.what})"
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return "none"
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    method = data.get("quant_method", "?")
    method = str(getattr(method, "value", method))  # an enum in memory, a string in config.json
    if method == "torchao":
        kind = getattr(config, "quant_type", None) or data.get("quant_type")
        if isinstance(kind, Mapping):  # as config.json stores it: {"default": {"_type": NAME, ...}}
            kind = (kind.get("default") or {}).get("_type", kind)
        return f"torchao {kind if isinstance(kind, str) else type(kind).__name__}"
    if method == "bitsandbytes":
        return "bitsandbytes " + ("int8" if data.get("load_in_8bit") else str(data.get("bnb_4bit_quant_type")))
    if method == "compressed-tensors":
        return f"compressed-tensors {_compressed_scheme(data)}"
    return method


def _compressed_scheme(data: Mapping[str, Any]) -> str:
    """A compressed-tensors config in a few words: its format and each group's weights (``int4 group 128``)."""
    q = data.get("quantization_config", data)  # transformers' wrapper nests it; config.json does not
    words = []
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        size = f" {w.get('group_size')}" if w.get("strategy") == "group" else ""
        words.append(f"{w.get('type', '?')}{w.get('num_bits', '?')} {w.get('strategy', '?')}{size}")
    return f"{q.get('format', '?')} ({', '.join(words) or 'no weight scheme'})"


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor subclass's inner tensors (int data and scales), else its storage."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n, None), torch.Tensor))
    extra = 0
    state = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: absmax and code beside the packed data
    if state is not None:
        extra = sum(v.numel() * v.element_size() for v in vars(state).values() if isinstance(v, torch.Tensor))
    return t.numel() * t.element_size() + extra


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers as stored (quantized weights counted at their packed size)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += _tensor_bytes(t)
    return total
