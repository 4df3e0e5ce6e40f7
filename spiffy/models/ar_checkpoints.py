"""Checkpoint writers of the AR side: DFlash / DFlash2 drafters (:func:`save_drafter`) and tiny random DFlash and
DFlash2 drafters and Qwen3 targets in the real file layout (for tests and demos; ``spiffy tiny dflash`` and ``spiffy
tiny dflash2`` go through :func:`spiffy.models.tiny.make_tiny`).

:func:`make_tiny_dflash` writes ``config.json`` (a Qwen3Config with ``architectures ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers`` and ``dflash_config`` {``target_layer_ids``, ``mask_token_id``,
``block_size``}) and sharded safetensors with a ``model.safetensors.index.json``, sized to a target checkpoint's
config (hidden size, heads, head dim, vocabulary). :func:`make_tiny_dflash2` adds the DFlash2 fields
(``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``) to ``dflash_config``, names the
architecture ``DFlash2DraftModel`` and stores the selector's codebooks without a ``.weight`` suffix, as released
DFlash2 checkpoints do (z-lab's ``dflash`` package loads it strictly). Files are written atomically (:mod:`spiffy.io`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save
from transformers import Qwen3Config, Qwen3ForCausalLM

from spiffy.errors import CheckpointError, ConfigError
from spiffy.io import atomic_write_bytes, atomic_write_json, replace_dir
from spiffy.models.dflash import DFlashDraftModel, default_target_layer_ids
from spiffy.models.dflash2 import DFlash2DraftModel
from spiffy.models.tokenizer import build_tokenizer

__all__ = ["dflash_config_for_target", "make_tiny_dflash", "make_tiny_dflash2", "make_tiny_target", "random_weights",
           "save_drafter", "target_config_dict", "tiny_mask_token_id", "tiny_target_layer_ids"]

#: the tokens a target's DFlash drafter fills its blocks with, in order of preference (Qwen's added ``<|MASK|>``,
#: generic mask spellings, Llama 3's first reserved special token, Mistral's first reserved control token)
MASK_TOKEN_NAMES = ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]", "<|reserved_special_token_0|>", "[control_8]")


def target_config_dict(target: Any) -> dict[str, Any]:
    """The target's config as a dict, from a checkpoint dir, a config object or a loaded model."""
    if isinstance(target, (str, Path)):
        f = Path(target) / "config.json"
        if not f.is_file():
            raise CheckpointError(f"no config.json in {target}; fix: pass the target checkpoint directory")
        return json.loads(f.read_text())
    cfg = getattr(target, "config", target)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    if isinstance(cfg, dict):
        return dict(cfg)
    raise ConfigError(f"cannot read a config from {type(target).__name__}; fix: pass the target directory")


def tiny_mask_token_id(target: Any, vocab_size: int) -> int:
    """The mask id for a tiny drafter: the target tokenizer's mask-like special token, else the last vocab id."""
    if isinstance(target, (str, Path)):
        tok_file = Path(target) / "tokenizer.json"
        if tok_file.is_file():
            try:
                added = json.loads(tok_file.read_text()).get("added_tokens", [])
            except ValueError:
                added = []
            by_name = {t.get("content"): int(t.get("id")) for t in added if "content" in t and "id" in t}
            for name in MASK_TOKEN_NAMES:
                if name in by_name and by_name[name] < vocab_size:
                    return by_name[name]
    return vocab_size - 1


def random_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter, in name order, from a generator seeded with ``seed``: norm weights
    ``1 + N(0, 0.1)``, the rest ``N(0, std)`` (a deterministic function of the seed, independent of global RNG)."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def save_drafter(model: torch.nn.Module, out_dir: str | Path, num_shards: int = 2) -> Path:
    """Write a :class:`~spiffy.models.dflash.DFlashDraftModel` (or a DFlash2 one) as ``config.json`` + sharded
    safetensors + index; ``architectures`` names the model's class.

    Every file is written atomically. ``num_shards`` >= 1 (1 = a single ``model.safetensors``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["model_type"] = "qwen3"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    n = max(1, min(int(num_shards), len(keys)))
    if n == 1:
        atomic_write_bytes(out / "model.safetensors", save(state, metadata={"format": "pt"}))
    else:
        groups = [keys[i::n] for i in range(n)]
        weight_map: dict[str, str] = {}
        total = 0
        for i, group in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part = {k: state[k] for k in group}
            atomic_write_bytes(out / name, save(part, metadata={"format": "pt"}))
            for k in group:
                weight_map[k] = name
                total += state[k].numel() * state[k].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_json(out / "model.safetensors.index.json", index, sort_keys=False)
    atomic_write_bytes(out / "config.json", (json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n").encode())
    return out


def tiny_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a tiny drafter reads: the SPEC §3 default when every id it gives is a layer of the target,
    else (targets of fewer than 3 layers under a multi-layer drafter: the default reaches below layer 0)
    ``num_draft_layers`` ids spread evenly over ``0 .. num_target_layers - 1``, written into the config so the
    loader never derives the invalid default."""
    t, d = int(num_target_layers), int(num_draft_layers)
    ids = default_target_layer_ids(t, d)
    if all(0 <= i < t for i in ids):
        return ids
    return [int(math.floor(i * (t - 1) / (d - 1) + 0.5)) for i in range(d)]  # d >= 2 here: one layer is [t // 2]


def dflash_config_for_target(
    target: Any,
    num_layers: int,
    block_size: int,
    target_layer_ids: Sequence[int] | None,
    mask_token_id: int,
    intermediate_size: int | None = None,
) -> Qwen3Config:
    """The config of a DFlash drafter for ``target`` (a checkpoint directory, config or model of any target
    architecture): a ``Qwen3Config`` with the target's hidden size, heads, K/V heads, head dim, intermediate size
    (``intermediate_size`` overrides it), vocabulary, RoPE parameters, norm epsilon and activation, plus the DFlash
    extras ``block_size``, ``num_target_layers`` and ``dflash_config`` {``target_layer_ids`` (default: the SPEC §3
    rule), ``mask_token_id``, ``block_size``}. The one builder of drafter configs (``spiffy tiny dflash``,
    ``spiffy train-drafter``).

    Layer ids are written as given (a drafter that does not fit its target is refused when loaded against it).

    Raises:
        ConfigError: ``num_layers < 1`` or ``block_size < 2``.
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}; fix: pass num_layers=1 or more")
    if block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {block_size}; fix: use e.g. 16")
    tcfg = target_config_dict(target)
    tcfg = tcfg.get("text_config") or tcfg  # a multimodal checkpoint's language model
    n_target = int(tcfg["num_hidden_layers"])
    ids = [int(i) for i in target_layer_ids] if target_layer_ids else default_target_layer_ids(n_target, num_layers)
    hidden, heads = int(tcfg["hidden_size"]), int(tcfg["num_attention_heads"])
    rope = tcfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": tcfg.get("rope_theta", 1e6)}
    cfg = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=int(intermediate_size or tcfg.get("intermediate_size") or 4 * hidden),
        num_hidden_layers=int(num_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(tcfg.get("num_key_value_heads") or heads),
        head_dim=int(tcfg.get("head_dim") or hidden // heads),
        vocab_size=int(tcfg["vocab_size"]),
        max_position_embeddings=int(tcfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        hidden_act=tcfg.get("hidden_act", "silu"),
        tie_word_embeddings=False,
    )
    cfg.block_size = int(block_size)
    cfg.num_target_layers = n_target
    cfg.dflash_config = {"target_layer_ids": ids, "mask_token_id": int(mask_token_id), "block_size": int(block_size)}
    cfg.architectures = ["DFlashDraftModel"]
    return cfg


def make_tiny_dflash(
    out_dir: str | Path,
    target: Any,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny random DFlash drafter for ``target`` and return its directory.

    Args:
        out_dir: output directory (created).
        target: the target checkpoint directory (or its config / a loaded model) of any target architecture: its
            config gives the drafter's (:func:`dflash_config_for_target`).
        seed: weights are a deterministic function of the seed.
        num_layers: drafter decoder layers.
        block_size: drafted block length (bonus + ``block_size - 1`` masks).
        target_layer_ids: target layers to read (default: :func:`tiny_target_layer_ids`, the SPEC §3 rule
            from the target's layer count when it names layers of the target).
        mask_token_id: default: the target tokenizer's ``<|MASK|>``-like token, else ``vocab_size - 1``.
        dtype: stored parameter dtype.
    """
    cfg = _tiny_drafter_config(target, num_layers, block_size, target_layer_ids, mask_token_id, "DFlashDraftModel")
    return save_drafter(_random_drafter(DFlashDraftModel(cfg), seed).to(dtype), out_dir, num_shards=2)


def make_tiny_dflash2(
    out_dir: str | Path,
    target: Any,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    conv_kernel_size: int = 4,
    conv_group_size: int | None = None,
    selector_rank: int = 16,
    selector_top_k: int = 8,
) -> Path:
    """Write a tiny random DFlash2 drafter for ``target`` in the released layout and return its directory.

    Args: as :func:`make_tiny_dflash`, plus the DFlash2 fields (``conv_group_size`` default: a quarter of the hidden
    size). Weights as :func:`random_weights`, except that each convolution's base kernel gets 1 added to its first
    tap, so a fresh drafter starts near the DFlash drafter it extends (the convolutions near the identity).
    """
    cfg = _tiny_drafter_config(target, num_layers, block_size, target_layer_ids, mask_token_id, "DFlash2DraftModel")
    group = int(conv_group_size) if conv_group_size is not None else max(1, int(cfg.hidden_size) // 4)
    cfg.dflash_config.update(conv_kernel_size=int(conv_kernel_size), conv_group_size=group,
                             selector_rank=int(selector_rank), selector_top_k=int(selector_top_k))
    model = _random_drafter(DFlash2DraftModel(cfg), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_conv.base_kernel"):
                p[:, 0] += 1.0
    return save_drafter(model.to(dtype), out_dir, num_shards=2)


def _random_drafter(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with :func:`random_weights` at five times its config's ``initializer_range``."""
    random_weights(model, seed, float(getattr(model.config, "initializer_range", 0.02)) * 5)
    return model


def _tiny_drafter_config(target: Any, num_layers: int, block_size: int, target_layer_ids: list[int] | None,
                         mask_token_id: int | None, architecture: str) -> Qwen3Config:
    """The config of a tiny (DFlash or DFlash2) drafter sized to ``target`` (see :func:`make_tiny_dflash`)."""
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}; fix: pass num_layers=1 or more")
    if block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {block_size}; fix: use e.g. 16")
    tcfg = target_config_dict(target)
    vocab = int(tcfg["vocab_size"])
    n_target = int((tcfg.get("text_config") or tcfg)["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else tiny_target_layer_ids(n_target, num_layers)
    bad = [i for i in ids if not 0 <= int(i) < n_target]
    if not ids or bad:
        raise ConfigError(
            f"target_layer_ids {ids} must be non-empty layers of the {n_target}-layer target (bad: {bad}); fix: pick "
            f"ids in 0..{n_target - 1}, or leave them out for {tiny_target_layer_ids(n_target, num_layers)}"
        )
    mask_id = int(mask_token_id) if mask_token_id is not None else tiny_mask_token_id(target, vocab)
    cfg = dflash_config_for_target(tcfg, num_layers, block_size, [int(i) for i in ids], mask_id)
    cfg.architectures = [architecture]
    return cfg


_TINY_CORPUS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    if name.endswith('.py'):\n        print(name)\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } : ; , .\n",
]


def make_tiny_target(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 300,
    weight_std: float = 0.3,
    with_tokenizer: bool = True,
) -> Path:
    """Write a tiny random transformers ``Qwen3ForCausalLM`` target (sharded safetensors, + tokenizer if possible).

    A stand-in for ``spiffy.models.tiny.make_tiny("qwen3", ...)`` used by AR tests and benchmarks. With
    ``with_tokenizer`` a byte-level BPE (:func:`spiffy.models.tokenizer.build_tokenizer`) with the Qwen3 special tokens is trained on a few built-in lines and the vocabulary is the tokenizer's size. Weights are
    ``N(0, weight_std)`` (larger than the usual 0.02 so the tiny target's distributions are peaked) and a
    deterministic function of ``seed``.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    special: dict[str, int] = {}
    if with_tokenizer:
        tokenizer = build_tokenizer("qwen3", vocab_size=vocab_size, corpus=_TINY_CORPUS)
        vocab_size = len(tokenizer)
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            val = getattr(tokenizer, key, None)
            if val is not None:
                special[key] = int(val)
    cfg = Qwen3Config(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **special,
    )
    model = Qwen3ForCausalLM(cfg)
    random_weights(model, seed, weight_std)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        model.save_pretrained(str(tmp), max_shard_size="100KB")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out)  # readers see the whole checkpoint or none of it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
