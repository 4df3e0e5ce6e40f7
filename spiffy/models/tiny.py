"""Tiny random checkpoints of every family, in the real file layout, for tests, demos and CI.

:func:`make_tiny` writes config.json (with the official ``auto_map``; none for native Qwen3), at least two
safetensors shards + ``model.safetensors.index.json``, ``generation_config.json`` and the tokenizer files of an
offline byte-level BPE tokenizer with the family's special tokens. Same family + seed + overrides -> byte-identical
tensors. Default shape: hidden 64, 2 layers, 4 heads (Dream/SDAR/Qwen3: 2 KV heads), vocabulary = the
tokenizer's size (512).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from spiffy.errors import ConfigError
from spiffy.models.loading import save_checkpoint, special_token_ids
from spiffy.models.registry import FAMILIES, family_spec
from spiffy.models.tokenizer import build_tokenizer

TINY_FAMILIES: tuple[str, ...] = ("llada", "dream", "sdar", "qwen3", "dflash")

#: initializer std of tiny models: larger than the 0.02 of real models so a random model's distributions are
#: not flat (logit spread ~ std * sqrt(hidden)), which gives decoding tests distinct confidences.
TINY_INIT_STD = 0.1


def _tiny_config(family: str, tokenizer: Any, overrides: dict[str, Any]) -> Any:
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    bos = tokenizer.bos_token_id
    mask = tokenizer.mask_token_id if getattr(tokenizer, "mask_token", None) else None
    spec = family_spec(family)
    if family == "llada":
        kw: dict[str, Any] = dict(
            d_model=64,
            n_heads=4,
            n_kv_heads=4,
            n_layers=2,
            mlp_ratio=2,
            mlp_hidden_size=128,
            vocab_size=vocab,
            embedding_size=vocab,
            max_sequence_length=512,
            rope_theta=500000.0,
            mask_token_id=mask,
            eos_token_id=eos,
            pad_token_id=pad,
            bos_token_id=bos,
            init_std=TINY_INIT_STD,
            init_device=None,
            precision=None,
        )
    elif family in ("dream", "sdar", "qwen3"):
        kw = dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=TINY_INIT_STD,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            eos_token_id=eos,
            pad_token_id=pad,
            bos_token_id=bos,
        )
        if family == "dream":
            kw.update(mask_token_id=mask, rope_theta=1000000.0)
        elif family == "sdar":
            kw.update(head_dim=16, mask_token_id=mask, rope_theta=1000000.0, max_window_layers=2)
        else:
            kw.update(head_dim=16, max_window_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:  # pragma: no cover - guarded by make_tiny
        raise ConfigError(f"no tiny config for {family!r}")
    kw.update(overrides)
    cls = spec.config_class
    config = cls(**kw)
    if spec.auto_map:
        config.auto_map = dict(spec.auto_map)
    return config


def _generation_config(family: str, config: Any, tokenizer: Any) -> dict[str, Any]:
    ids = special_token_ids(config, tokenizer)
    gen: dict[str, Any] = {"bos_token_id": ids.bos, "eos_token_id": ids.eos, "pad_token_id": ids.pad}
    if family == "qwen3":
        gen["eos_token_id"] = ids.stop_ids() or ids.eos
    if ids.mask is not None:
        gen["mask_token_id"] = ids.mask
    return {k: v for k, v in gen.items() if v is not None}


def make_tiny(family: str, out_dir: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``family`` to ``out_dir`` and return its path.

    Args:
        family: ``"llada"``, ``"dream"``, ``"sdar"``, ``"qwen3"`` or ``"dflash"`` (the latter needs
            ``target=PATH`` of a Qwen3 checkpoint and delegates to ``spiffy.ar.checkpoints.make_tiny_dflash``).
        out_dir: directory to write (replaced atomically if it exists).
        seed: weight-initialisation seed (the global torch RNG is left untouched).
        **overrides: config keys to override (e.g. ``n_layers=3`` for LLaDA, ``num_hidden_layers=3`` for the
            others); ``vocab_size`` sets the tokenizer's vocabulary size; ``min_shards`` (default 2) the number
            of safetensors shards.
    """
    fam = family.lower() if isinstance(family, str) else family
    if fam not in TINY_FAMILIES:
        raise ConfigError(f"unknown family {family!r} for a tiny checkpoint; choose one of {', '.join(TINY_FAMILIES)}")
    if fam == "dflash":
        target = overrides.pop("target", None)
        if target is None:
            raise ConfigError("a tiny DFlash drafter needs target=PATH of a Qwen3 checkpoint (e.g. from make_tiny('qwen3', ...))")
        from spiffy.ar.checkpoints import make_tiny_dflash  # the drafter writer is imported on use (it lives above models)

        return Path(make_tiny_dflash(out_dir, target, seed, **overrides))
    overrides.pop("target", None)
    vocab_size = int(overrides.pop("vocab_size", 512))
    min_shards = int(overrides.pop("min_shards", 2))
    tokenizer = build_tokenizer(fam, vocab_size=vocab_size)
    config = _tiny_config(fam, tokenizer, overrides)
    spec = FAMILIES[fam]
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
        generation_config=_generation_config(fam, config, tokenizer),
    )
