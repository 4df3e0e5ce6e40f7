"""Tiny random checkpoints of every family, in the real file layout, for tests, demos and CI.

:func:`make_tiny` writes config.json (with the official ``auto_map``; none for transformers' own classes, whose
checkpoints go through their ``save_pretrained``), at least two safetensors shards + ``model.safetensors.index.json``, ``generation_config.json`` and the tokenizer files of an
offline byte-level BPE tokenizer with the family's special tokens. Same family + seed + overrides -> byte-identical
tensors. Default shape: hidden 64, 2 layers, 4 heads (Dream/SDAR/Qwen3: 2 KV heads), vocabulary = the
tokenizer's size (512).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from spiffy.errors import ConfigError
from spiffy.models.ar_checkpoints import make_tiny_dflash, make_tiny_dflash2
from spiffy.models.loading import save_checkpoint, special_token_ids
from spiffy.models.registry import FAMILIES, FamilySpec
from spiffy.models.tokenizer import build_tokenizer

#: the families with a tiny checkpoint: every family of the registry (``spiffy tiny``'s choices)
TINY_FAMILIES: tuple[str, ...] = tuple(FAMILIES)
#: the tiny checkpoint writer of each drafter family (``(out_dir, target, seed, **overrides) -> Path``)
DRAFTER_WRITERS: dict[str, Callable[..., Any]] = {"dflash": make_tiny_dflash, "dflash2": make_tiny_dflash2}


def _tiny_config(spec: FamilySpec, tokenizer: Any, overrides: dict[str, Any]) -> Any:
    """The family's tiny config (:attr:`FamilySpec.tiny_config`) with the tokenizer's vocabulary size and token ids."""
    vocab = len(tokenizer)
    kw: dict[str, Any] = {name: vocab for name in spec.vocab_fields}
    kw.update(spec.tiny_config)
    if spec.mask_config_key is not None:  # a diffusion family keeps its mask id in the config
        kw[spec.mask_config_key] = tokenizer.mask_token_id if getattr(tokenizer, "mask_token", None) else None
    kw.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    kw.update(overrides)
    config = spec.config_class(**kw)
    if spec.auto_map:
        config.auto_map = dict(spec.auto_map)
    return config


def _generation_config(spec: FamilySpec, config: Any, tokenizer: Any) -> dict[str, Any]:
    ids = special_token_ids(config, tokenizer)
    gen: dict[str, Any] = {"bos_token_id": ids.bos, "eos_token_id": ids.eos, "pad_token_id": ids.pad}
    if spec.generation_stops:
        gen["eos_token_id"] = ids.stop_ids() or ids.eos
    if ids.mask is not None:
        gen["mask_token_id"] = ids.mask
    return {k: v for k, v in gen.items() if v is not None}


def make_tiny(family: str, out_dir: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``family`` to ``out_dir`` and return its path.

    Args:
        family: a name of :data:`TINY_FAMILIES` (``"llada"``, ``"dream"``, ``"sdar"``, the AR targets ``"qwen3"``,
            ``"qwen3_moe"``, ``"qwen2"``, ``"llama"``, ``"mistral"``, the hybrids ``"qwen3_5"``, ``"qwen3_next"``), or a drafter
            family (``"dflash"``, ``"dflash2"``: needs ``target=PATH`` of a target checkpoint and delegates to the
            family's writer in :data:`DRAFTER_WRITERS`).
        out_dir: directory to write (replaced atomically if it exists).
        seed: weight-initialisation seed (the global torch RNG is left untouched).
        **overrides: config keys to override (e.g. ``n_layers=3`` for LLaDA, ``num_hidden_layers=3`` for the
            others); ``vocab_size`` sets the tokenizer's vocabulary size; ``min_shards`` (default 2) the number
            of safetensors shards.
    """
    fam = family.lower() if isinstance(family, str) else family
    if fam not in FAMILIES:
        raise ConfigError(f"unknown family {family!r} for a tiny checkpoint; choose one of {', '.join(FAMILIES)}")
    spec = FAMILIES[fam]
    if spec.drafter:
        target = overrides.pop("target", None)
        if target is None:
            raise ConfigError(f"a tiny {spec.name} drafter needs target=PATH of a target checkpoint (e.g. from "
                              "make_tiny('llama', ...))")
        return Path(DRAFTER_WRITERS[fam](out_dir, target, seed, **overrides))
    overrides.pop("target", None)
    vocab_size = int(overrides.pop("vocab_size", 512))
    min_shards = int(overrides.pop("min_shards", 2))
    tokenizer = build_tokenizer(fam, vocab_size=vocab_size)
    config = _tiny_config(spec, tokenizer, overrides)
    cls = spec.model_class
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = cls(config)
        finally:
            torch.set_default_dtype(previous)
    model.eval()
    return save_checkpoint(
        model,
        out_dir,
        min_shards=min_shards,
        tokenizer=tokenizer,
        generation_config=_generation_config(spec, config, tokenizer),
    )
