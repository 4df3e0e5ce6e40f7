"""Drafters of AR speculative decoding as checkpoints: which kind a directory holds, loading either kind, and the
tiny random dLLM drafter writer (``spiffy tiny dllm-drafter DIR --target TARGET``).

Three kinds, read from ``config.json``:

* ``"dflash"``: a DFlash drafter (a qwen3 config with ``dflash_config``; :mod:`spiffy.models.dflash`), conditioned on
  target features.
* ``"dflash2"``: a DFlash2 drafter (a DFlash config with the DFlash2 fields ``conv_kernel_size``, ``conv_group_size``,
  ``selector_rank``, ``selector_top_k`` or the architecture ``DFlash2DraftModel``; :mod:`spiffy.models.dflash2`).
* ``"dllm"``: a standalone diffusion LM of a spiffy family (SDAR, LLaDA or Dream) that shares the target's
  tokenizer and vocabulary, conditioned on the committed tokens only (DEER / SpecDiff-2). Its config may carry
  ``drafter_config = {"kind": "dllm", "block_size": B, "mask_token_id": M, "layout": "root" | "aligned",
  "attention_block": A, "shifted": bool}``; without it any dLLM checkpoint is a drafter with block size :data:`DEFAULT_DLLM_BLOCK`,
  the family's mask token and the ``"aligned"`` layout for SDAR (its own block-causal attention over blocks of
  ``A = B`` positions aligned to absolute positions, as SDAR is trained), ``"root"`` otherwise (see
  :mod:`spiffy.arspec.dllm_drafter`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spiffy.errors import CheckpointError, ConfigError, DrafterMismatchError
from spiffy.models.ar_checkpoints import tiny_mask_token_id, random_weights, target_config_dict
from spiffy.models.checkpoint import read_config_dict
from spiffy.models.dflash import is_dflash_config, load_drafter
from spiffy.models.dflash2 import is_dflash2_config, load_dflash2_drafter
from spiffy.models.hub import checkpoint_dir
from spiffy.models.loading import family_of, load_model, load_tokenizer, mask_token_id, save_checkpoint
from spiffy.models.quantize import quantize_model
from spiffy.models.registry import family_spec
from spiffy.models.sdar import SDARConfig, SDARForCausalLM

__all__ = [
    "DEFAULT_DLLM_BLOCK",
    "DLLM_LAYOUTS",
    "DRAFTER_KINDS",
    "DLLMDrafterSettings",
    "drafter_kind",
    "dllm_drafter_settings",
    "check_dllm_compatible",
    "load_ar_drafter",
    "make_tiny_dllm_drafter",
]

DRAFTER_KINDS: tuple[str, ...] = ("dflash", "dflash2", "dllm")
#: how a dLLM drafter attends (see spiffy.arspec.dllm_drafter): ``root``: causal prefix + one bidirectional block
#: starting at the root; ``aligned``: SDAR's block-causal attention over absolute-position-aligned blocks
DLLM_LAYOUTS: tuple[str, ...] = ("root", "aligned")
#: drafted block length (root included) of a dLLM drafter whose config does not say
DEFAULT_DLLM_BLOCK = 16


def _config_dict(path_or_config: Any) -> dict[str, Any]:
    if isinstance(path_or_config, (str, os.PathLike)):
        return read_config_dict(path_or_config)
    if isinstance(path_or_config, dict):
        return dict(path_or_config)
    cfg = getattr(path_or_config, "config", path_or_config)
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    data.setdefault("model_type", getattr(cfg, "model_type", None))
    return data


def drafter_kind(path_or_config: Any) -> str:
    """``"dflash"``, ``"dflash2"`` or ``"dllm"`` for a drafter checkpoint directory, config (object or dict) or loaded
    model.

    Raises:
        ConfigError: the checkpoint is neither (e.g. a plain Qwen3 model).
    """
    cfg = _config_dict(path_or_config)
    if is_dflash2_config(cfg):
        return "dflash2"
    if is_dflash_config(cfg):
        return "dflash"
    family = family_of(cfg)
    if family_spec(family).diffusion:
        return "dllm"
    raise ConfigError(
        f"a {family} checkpoint is not a drafter; fix: pass a DFlash / DFlash2 drafter or a diffusion LM (SDAR, LLaDA, Dream) "
        "that shares the target's tokenizer (e.g. `spiffy tiny dllm-drafter DIR --target TARGET`)"
    )


class DLLMDrafterSettings:
    """What a dLLM drafter's config says about drafting.

    Attributes:
        block_size: drafted block length including the root token.
        mask_token_id: the id the drafted positions are filled with.
        shifted: token ``i`` is read from logits row ``i - 1`` (Dream's convention; ``drafter_config.shifted``
            overrides the family's, e.g. for a drafter adapted from an AR target that keeps the AR reading).
        family: the dLLM family.
        layout: one of :data:`DLLM_LAYOUTS`.
        attention_block: the aligned block length of the ``aligned`` layout.
    """

    def __init__(self, block_size: int, mask_token_id: int, shifted: bool, family: str, layout: str = "root",
                 attention_block: int | None = None) -> None:
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self.shifted = bool(shifted)
        self.family = family
        self.layout = layout
        self.attention_block = int(attention_block if attention_block is not None else block_size)


def dllm_drafter_settings(model: nn.Module) -> DLLMDrafterSettings:
    """The drafting settings of a loaded dLLM drafter (``drafter_config`` first, then the family's facts)."""
    cfg = model.config
    extra = getattr(cfg, "drafter_config", None) or {}
    family = family_of(model)
    spec = family_spec(family)
    block = int(extra.get("block_size", DEFAULT_DLLM_BLOCK))
    if block < 2:
        raise ConfigError(f"drafter_config.block_size must be >= 2, got {block}; fix the drafter's config.json")
    mask = extra.get("mask_token_id")
    if mask is None:
        mask = mask_token_id(model)
    layout = extra.get("layout", "aligned" if spec.block_causal and not extra else "root")
    if layout not in DLLM_LAYOUTS or (layout == "aligned" and not spec.block_causal):
        raise ConfigError(f"drafter_config.layout {layout!r} does not fit a {family} drafter; fix: use 'root'"
                          + (" or 'aligned' (block-causal families only)" if spec.block_causal else ""))
    attention_block = int(extra.get("attention_block", block))
    if attention_block < 1:
        raise ConfigError(f"drafter_config.attention_block must be >= 1, got {attention_block}")
    shifted = bool(extra.get("shifted", spec.shifted_logits))
    return DLLMDrafterSettings(block, int(mask), shifted, family, layout, attention_block)


def check_dllm_compatible(drafter: nn.Module, target: nn.Module) -> None:
    """Raise :class:`~spiffy.errors.DrafterMismatchError` unless the dLLM drafter can draft for ``target``: the
    same vocabulary size (so its logits index the target's tokens), and a mask id inside it."""
    v_draft = int(drafter.config.vocab_size)
    v_target = int(target.config.vocab_size)
    if v_draft != v_target:
        raise DrafterMismatchError(
            f"the dLLM drafter's vocabulary ({v_draft}) differs from the target's ({v_target}); fix: use a drafter "
            "that shares the target's tokenizer (e.g. `spiffy tiny dllm-drafter DIR --target TARGET`)"
        )
    mask = dllm_drafter_settings(drafter).mask_token_id
    if not 0 <= mask < v_draft:
        raise DrafterMismatchError(f"the drafter's mask id {mask} is outside its vocabulary of {v_draft}")


def load_ar_drafter(path: str | os.PathLike, dtype: Any = None, device: Any = None, quantization: Any = None,
                    **placement: Any) -> nn.Module:
    """Load a drafter checkpoint of any kind (a directory or a Hub id): a
    :class:`~spiffy.models.dflash.DFlashDraftModel`, a :class:`~spiffy.models.dflash2.DFlash2DraftModel` or a dLLM
    (eval mode). The kind comes from ``config.json``
    (:func:`drafter_kind`). ``placement``: ``device_map`` / ``offload_folder`` / ``max_memory`` (accelerate
    placement, see :func:`spiffy.models.loading.load_model`). ``quantization``: its linear layers quantized on load
    (``"int8"``, ``"int4:G"``, a torchao config; :func:`spiffy.models.quantize.quantize_model`); the target's
    embedding and head it borrows stay as the target holds them."""
    root = checkpoint_dir(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"no config.json in {root}; fix: --drafter must be a drafter checkpoint directory")
    kind = drafter_kind(root)
    if kind == "dflash2":
        return quantize_model(load_dflash2_drafter(root, dtype=dtype, device=device, **placement), quantization)
    if kind == "dflash":
        return quantize_model(load_drafter(root, dtype=dtype, device=device, **placement), quantization)
    return load_model(root, dtype=dtype, device=device, quantization=quantization, **placement)


def make_tiny_dllm_drafter(
    out_dir: str | os.PathLike,
    target: str | os.PathLike,
    seed: int = 0,
    block_size: int = DEFAULT_DLLM_BLOCK,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    weight_std: float = 0.3,
    mask_token_id: int | None = None,
) -> Path:
    """Write a tiny random SDAR drafter for the Qwen3 ``target`` checkpoint directory and return its path.

    The drafter has the target's vocabulary and copies its tokenizer files; its mask id is the target tokenizer's
    ``<|MASK|>``-like token (else the last id); ``drafter_config`` records kind, block size and mask id. Weights
    are ``N(0, weight_std)`` (norms ``1 + N(0, 0.1)``), a deterministic function of ``seed``.
    """
    if block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {block_size}; fix: use e.g. 16")
    tcfg = target_config_dict(target)
    vocab = int(tcfg["vocab_size"])
    mask = int(mask_token_id) if mask_token_id is not None else tiny_mask_token_id(target, vocab)
    rope = tcfg.get("rope_parameters") or {}
    cfg = SDARConfig(
        vocab_size=vocab,
        hidden_size=int(hidden_size),
        intermediate_size=2 * int(hidden_size),
        num_hidden_layers=int(num_layers),
        num_attention_heads=int(num_heads),
        num_key_value_heads=int(num_kv_heads),
        head_dim=int(hidden_size) // int(num_heads),
        max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
        rope_theta=float(rope.get("rope_theta", tcfg.get("rope_theta", 1e6))),
        max_window_layers=int(num_layers),
        tie_word_embeddings=False,
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
        pad_token_id=tcfg.get("pad_token_id"),
        mask_token_id=mask,
    )
    cfg.drafter_config = {"kind": "dllm", "block_size": int(block_size), "mask_token_id": mask, "layout": "root"}
    with torch.device("cpu"):
        model = SDARForCausalLM(cfg)
    random_weights(model, seed, weight_std)
    src = Path(target) if isinstance(target, (str, os.PathLike)) else None
    tokenizer = load_tokenizer(src) if src is not None and (src / "tokenizer.json").is_file() else None
    return save_checkpoint(model.eval(), out_dir, min_shards=2, tokenizer=tokenizer)  # shares the target's tokenizer
