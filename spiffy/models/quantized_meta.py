"""A quantized release's model at full size on the meta device: what its ``config.json`` describes, built by
transformers' own quantizer, with no weights read and no kernel run.

:func:`quantized_skeleton` answers "does spiffy build this checkpoint's layers, and how many bytes do they hold"
for FP8 (Qwen3-8B-FP8: ``FP8Linear`` with a float32 inverse scale per 128 x 128 block), compressed-tensors (packed
int4 weights with group scales) and the others transformers knows; a method whose layers need a package that is not
installed (AWQ and GPTQ need gptqmodel's kernels) is refused with :class:`~spiffy.errors.QuantizationError` naming
it. Running such a checkpoint is a separate question (:func:`spiffy.models.quantize.check_checkpoint_quantization`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from spiffy.errors import ConfigError, QuantizationError
from spiffy.models.quantize import checkpoint_quantization, weight_bytes
from spiffy.models.target import target_spec
from spiffy.torch_utils import resolve_dtype

__all__ = ["quantized_skeleton"]

#: the package each quantization method's layers come from, when transformers does not ship them itself
_LAYER_PACKAGES: dict[str, str] = {
    "awq": "gptqmodel (AWQ GEMM kernels)",
    "gptq": "gptqmodel (GPTQ kernels)",
    "compressed-tensors": "compressed-tensors",
}


def quantized_skeleton(raw: Mapping[str, Any]) -> tuple[nn.Module, int]:
    """``(model on the meta device, bytes of its parameters and buffers as stored)`` for the raw ``config.json``
    dict of a quantized AR target release: the target's transformers class at full size, its linear layers replaced
    by the checkpoint format's own (transformers' quantizer, as ``from_pretrained`` does before reading weights).

    Raises:
        ConfigError: the config carries no ``quantization_config``.
        QuantizationError: the format's layers need a package that is not installed (named), or transformers
            does not know the format.
    """
    qc = checkpoint_quantization(raw)
    if qc is None:
        raise ConfigError("the config has no quantization_config; fix: pass a quantized release's config.json")
    from transformers.quantizers import AutoHfQuantizer, AutoQuantizationConfig  # noqa: PLC0415

    method = str(qc.get("quant_method", "")).lower()
    spec = target_spec(raw, "the quantized release")
    dtype = resolve_dtype("auto", raw, "cpu")
    try:
        quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(qc)), pre_quantized=True)
        if method == "compressed-tensors":  # decides its FP8-kernel route only (fp8 on a CPU stays off, no dequantize)
            quantizer.validate_environment(device_map=None)
        config = spec.config_class.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
        config.quantization_config = qc
        with torch.device("meta"):
            model = spec.model_class(config).to(dtype)
        quantizer.preprocess_model(model, dtype=dtype, checkpoint_files=None)
    except ImportError as exc:  # transformers imports the format's layers from their package when it builds them
        package = _LAYER_PACKAGES.get(method, getattr(exc, "name", None) or str(exc))
        raise QuantizationError(
            f"a {method!r} checkpoint's layers come from {package}, which is not installed ({exc}); spiffy cannot "
            f"build or run it here; fix: install it on a machine whose GPU runs its kernels, or use the unquantized "
            "release with --quantize int8 / int4") from exc
    except ValueError as exc:  # an unknown quant_method
        raise QuantizationError(f"transformers does not know the quantization {method!r}: {exc}") from exc
    return model, weight_bytes(model)
