"""Write a compressed-tensors checkpoint of a tiny transformers model, as LLM Compressor saves its releases.

The published W4A16 / W8A16 checkpoints (e.g. RedHatAI's ``Qwen3-8B-quantized.w4a16``) are a dense model whose
linear layers carry integer weights packed by compressed-tensors, the per-group (or per-channel) scales beside them,
and a ``quantization_config`` (``quant_method: compressed-tensors``) in ``config.json``. This builds the same layout
with compressed-tensors' own API (apply the scheme, set the scales, compress, save, write the config); the scales
are the round-to-nearest symmetric ones (max |w| of a group over the largest positive level), as a calibration-free
weight-only recipe computes them, so no data and no LLM Compressor are needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from transformers import AutoModelForCausalLM

#: scheme name -> (bits, group size or None for one scale per output channel, compressed-tensors format)
SCHEMES: dict[str, tuple[int, int | None, str]] = {
    "w4a16": (4, 32, "pack-quantized"),
    "w8a16": (8, None, "int-quantized"),
}


def save_compressed_tensors(source: Path, out: Path, scheme: str) -> Path:
    """Quantize the linear layers of the checkpoint ``source`` (the output head excluded, as the releases do) by
    ``scheme`` (a key of :data:`SCHEMES`) and save it compressed to ``out`` with the tokenizer files; returns ``out``."""
    bits, group, fmt = SCHEMES[scheme]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group" if group else "channel",
                               group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    top = 2 ** (bits - 1) - 1  # the largest positive level of a symmetric signed integer
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight
            spans = w.view(w.shape[0], -1, group) if group else w.view(w.shape[0], 1, -1)
            module.weight_scale.copy_(spans.abs().amax(-1).clamp_min(1e-8).view_as(module.weight_scale) / top)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.zero_()
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in Path(source).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",) \
                and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    return out
