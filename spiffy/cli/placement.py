"""``--device-map``, ``--offload-folder``, ``--max-memory`` and ``--quantize``: the placement and memory flags of
``spiffy generate`` and ``spiffy bench`` (models larger than one device, docs/SCALING.md; quantized weights,
docs/MODELS.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from spiffy.cli.names import QUANTIZE_NAMES
from spiffy.errors import ConfigError

__all__ = ["add_placement_arguments", "placement_kwargs", "parse_device_map", "parse_max_memory",
           "quantization_kwargs"]

DEVICE_MAP_HELP = (
    "place the model across devices with accelerate (pip install 'spiffy-decoding[placement]'): 'auto' (fill the "
    "GPUs, then CPU RAM, then disk; cap each with --max-memory), 'balanced', 'sequential', one device ('cuda:1', "
    "'cpu'), or a JSON object / .json file mapping module names to a device, 'cpu' or 'disk', e.g. "
    "'{\"model.embed_tokens\": 0, \"model.layers.0\": 0, \"model.layers.1\": 1, \"model.norm\": 1, \"lm_head\": 1}' "
    "(module names: model.named_modules()). Overrides --device; speculative outputs still equal their baseline. "
    "AR mode: applies to the target; the drafter goes on the device of the target's input embedding"
)


QUANTIZE_HELP = (
    "quantize the weights on load (pip install 'spiffy-decoding[quant]'): int8 (torchao int8 weight-only), int4 or "
    "int4:G (torchao 4-bit weight-only, groups of G input columns, default 128), fp8 (torchao; CUDA GPUs of compute "
    "capability >= 8.9 only), bnb-int8 / bnb-nf4 / bnb-fp4 (bitsandbytes; AR targets). Applies to every model the "
    "command loads (a dLLM; an AR target and its drafters: bitsandbytes quantizes the target, the drafters stay as "
    "they are). A checkpoint saved quantized (its config's quantization_config: FP8, AWQ, GPTQ, compressed-tensors, "
    "torchao, bitsandbytes) loads quantized without this flag. Speculative outputs equal the quantized model's own "
    "baseline; what cannot run on the device is refused, never dequantized silently"
)


def quantization_kwargs(args: argparse.Namespace, drafter: bool = False) -> dict[str, Any]:
    """``{"quantization": NAME}`` for ``--quantize NAME`` (empty without it). ``drafter=True``: the drafters'
    share (bitsandbytes quantizes AR targets only: the drafters then load as they are)."""
    name = getattr(args, "quantize", None)
    if not name or (drafter and str(name).lower().startswith("bnb-")):
        return {}
    return {"quantization": str(name)}


def add_placement_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--device-map``, ``--offload-folder`` and ``--max-memory`` (one argument group)."""
    g = parser.add_argument_group("placement (models larger than one device)")
    g.add_argument("--device-map", default=None, metavar="auto|DEVICE|JSON|FILE", help=DEVICE_MAP_HELP)
    g.add_argument("--offload-folder", default=None, metavar="DIR",
                   help="where weights mapped to 'disk' are written (default: a temporary directory)")
    g.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                   help="caps for --device-map auto, e.g. 0=20GiB,1=20GiB,cpu=64GiB (device index or cpu)")
    g.add_argument("--quantize", default=None, metavar="|".join(QUANTIZE_NAMES),
                   help=QUANTIZE_HELP)
    return parser


def parse_device_map(value: str | None) -> Any:
    """``None``, a string (``"auto"``, ``"cuda:1"``), or the dict of a JSON object / ``.json`` file."""
    if value is None:
        return None
    text = value.strip()
    if text.endswith(".json") and not text.startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--device-map file {text!r} does not exist; fix the path or pass the JSON inline")
        text = path.read_text(encoding="utf-8")
    if not text.startswith("{"):
        return int(text) if text.isdigit() else text
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--device-map is not valid JSON ({exc}); fix: e.g. '{{\"\": \"cpu\"}}'") from exc
    if not isinstance(parsed, dict):
        raise ConfigError("--device-map JSON must be an object {module name: device}")
    return parsed


def parse_max_memory(value: str | None) -> dict[Any, str] | None:
    """``"0=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", "cpu": "64GiB"}``."""
    if not value:
        return None
    out: dict[Any, str] = {}
    for item in value.split(","):
        key, sep, size = item.partition("=")
        if not sep or not key.strip() or not size.strip():
            raise ConfigError(f"--max-memory item {item!r} is not DEV=SIZE; fix: e.g. 0=20GiB,cpu=64GiB")
        key = key.strip()
        out[int(key) if key.isdigit() else key] = size.strip()
    return out


def placement_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``device_map`` / ``offload_folder`` / ``max_memory`` keyword arguments of the loaders (empty without
    ``--device-map``)."""
    device_map = parse_device_map(getattr(args, "device_map", None))
    if device_map is None:
        if getattr(args, "offload_folder", None) or getattr(args, "max_memory", None):
            raise ConfigError("--offload-folder and --max-memory need --device-map; fix: add --device-map auto")
        return {}
    return {"device_map": device_map, "offload_folder": getattr(args, "offload_folder", None),
            "max_memory": parse_max_memory(getattr(args, "max_memory", None))}
