"""The DFlash model family: the block-diffusion drafter (SPEC §3, §7), its strict loader, and target-feature hooks.

A DFlash drafter is a small stack of Qwen3-style decoder layers that predicts a whole block of future tokens in
one pass. It has **no embedding and no head**: the block ``[bonus, MASK x (b-1)]`` is embedded with the target's
``embed_tokens`` and its outputs go through the target's ``lm_head``. What it conditions on are *target features*:
the outputs of a few chosen target decoder layers (``hidden_states[layer_id + 1]``), concatenated and projected by
``fc`` to the hidden size, then normalised by ``hidden_norm``: the *context* rows.

In every drafter layer the queries come from the block rows only; keys and values come from
``[context ; block]`` (the layer applies its own ``k_proj`` / ``v_proj`` to the context rows, ``k_norm`` to all
keys); RoPE is applied over ``[context positions ; block positions]``; by default there is no mask (the block is
bidirectional and sees the full context); ``is_causal``, ``layer_types`` + ``sliding_window``,
``input_embedding_scale``, ``output_multiplier`` and ``final_logit_softcapping`` are honoured as the official package
reads them (:mod:`spiffy.models.dflash_fields`). Context K/V are cached across rounds (:class:`spiffy.models.cache.KVCache`
of committed context only); block K/V are never stored, which is the same as appending them and cropping the
cache back to the committed length after each draft.

Checkpoint parameter names (``fc.weight [H, nT*H]``, ``hidden_norm.weight``, ``norm.weight``,
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q_norm,k_norm}.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``) match the public
``z-lab/Qwen3-*-DFlash-b16`` checkpoints, so real weights load unchanged through :func:`load_drafter`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from spiffy.errors import CheckpointError, DrafterMismatchError, MissingTokenError
from spiffy.models.cache import KVCache
from spiffy.models.checkpoint import CONFIG_FILE, check_keys, load_state_dict, read_config_dict, stored_dtype
from spiffy.models.dflash_fields import draft_value, input_embedding_scale, layer_attention, layer_visibility, output_logits
from spiffy.models.hub import checkpoint_dir
from spiffy.models.placement import dispatch_checkpoint, placement_device
from spiffy.torch_utils import execution_device, resolve_dtype

__all__ = [
    "DFlashDraftModel",
    "TargetFeatureHooks",
    "default_target_layer_ids",
    "drafter_settings",
    "load_drafter",
    "check_compatible",
    "fill_drafter",
    "is_dflash_config",
]

DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers a DFlash drafter reads when its config names none (SPEC §3).

    One drafter layer -> ``[T // 2]``; otherwise ``round(1 + i * (T - 4) / (D - 1))`` for ``i in 0..D-1``
    (for Qwen3-8B, T = 36, D = 5: ``[1, 9, 17, 25, 33]``).
    """
    t, d = int(num_target_layers), int(num_draft_layers)
    if t <= 0 or d <= 0:
        raise DrafterMismatchError(
            f"cannot derive target layer ids from num_target_layers={t}, num_hidden_layers={d}; "
            "fix: set dflash_config.target_layer_ids in the drafter's config.json"
        )
    if d == 1:
        return [t // 2]
    return [int(math.floor(1 + i * (t - 4) / (d - 1) + 0.5)) for i in range(d)]


def drafter_settings(config: Any) -> dict[str, Any]:
    """Resolve ``block_size``, ``target_layer_ids``, ``mask_token_id`` and ``num_target_layers`` of a drafter config.

    Raises:
        MissingTokenError: the config names no mask token id.
    """
    num_layers = int(config.num_hidden_layers)
    num_target = draft_value(config, "num_target_layers")
    layer_ids = draft_value(config, "target_layer_ids")
    if layer_ids is None:
        if num_target is None:
            raise DrafterMismatchError(
                "the drafter config has neither dflash_config.target_layer_ids nor num_target_layers; "
                "fix: add dflash_config.target_layer_ids (the target layers it was trained on) to config.json"
            )
        layer_ids = default_target_layer_ids(int(num_target), num_layers)
    layer_ids = [int(i) for i in layer_ids]
    mask_id = draft_value(config, "mask_token_id")
    if mask_id is None:
        raise MissingTokenError(
            "the drafter config has no dflash_config.mask_token_id; fix: add the mask token id the drafter was "
            "trained with (151669 for the z-lab Qwen3 drafters) to dflash_config in config.json"
        )
    return {
        "block_size": int(draft_value(config, "block_size", DEFAULT_BLOCK_SIZE)),
        "target_layer_ids": layer_ids,
        "mask_token_id": int(mask_id),
        "num_target_layers": None if num_target is None else int(num_target),
    }


def is_dflash_config(cfg: dict[str, Any]) -> bool:
    """Whether a raw ``config.json`` dict describes a DFlash drafter."""
    archs = cfg.get("architectures") or []
    return "DFlashDraftModel" in archs or "dflash_config" in cfg


class DFlashAttention(nn.Module):
    """Block queries attending to ``[cached context ; new context ; block]`` keys (no mask by default)."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        bias = bool(getattr(config, "attention_bias", False))
        h = int(config.hidden_size)
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        store_context: bool,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x [B, L, H]`` block rows, ``ctx [B, N, H]`` new context rows, ``cos/sin [B, N+L, hd]`` -> ``[B, L, H]``."""
        b, q_len, _ = x.shape
        n_ctx = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = q * cos[:, n_ctx:].unsqueeze(1) + rotate_half(q) * sin[:, n_ctx:].unsqueeze(1)
        k_ctx, v_ctx = self._kv(ctx, cos[:, :n_ctx], sin[:, :n_ctx])
        k_blk, v_blk = self._kv(x, cos[:, n_ctx:], sin[:, n_ctx:])
        k_old, v_old = (None, None) if cache is None else cache.layer(self.layer_idx)
        if cache is not None and store_context and n_ctx:
            cache.append(self.layer_idx, k_ctx, v_ctx)
        keys = [t for t in (k_old, k_ctx, k_blk) if t is not None and t.shape[-2] > 0]
        vals = [t for t in (v_old, v_ctx, v_blk) if t is not None and t.shape[-2] > 0]
        if k_old is not None and k_old.shape[0] != b:
            keys[0] = keys[0].expand(b, -1, -1, -1)
            vals[0] = vals[0].expand(b, -1, -1, -1)
        k = torch.cat(keys, dim=-2)
        v = torch.cat(vals, dim=-2)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x), ctx)`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache, store_context, attention_mask):  # noqa: ANN001, D102
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache, store_context, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter: ``fc``, ``hidden_norm``, ``layers.{i}``, ``norm`` (no embedding, no head).

    Args:
        config: a transformers ``Qwen3Config`` carrying the DFlash extras ``block_size``,
            ``dflash_config.target_layer_ids``, ``dflash_config.mask_token_id`` and ``num_target_layers``
            (defaults per SPEC §3 via :func:`drafter_settings`).

    Attributes:
        block_size: drafted block length ``b`` (bonus + ``b - 1`` masks).
        target_layer_ids: the target decoder layers whose outputs form the features.
        mask_token_id: id of the mask token filling the block.
        num_target_layers: number of layers of the target it was built for (``None`` if unknown).
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        settings = drafter_settings(config)
        self.block_size: int = settings["block_size"]
        self.target_layer_ids: list[int] = settings["target_layer_ids"]
        self.mask_token_id: int = settings["mask_token_id"]
        self.num_target_layers: int | None = settings["num_target_layers"]
        h = int(config.hidden_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(int(config.num_hidden_layers))])
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        # is_causal / layer_types / sliding_window, per layer (spiffy.models.dflash_fields)
        self.layer_attention = layer_attention(config, len(self.layers))
        self.input_embedding_scale = input_embedding_scale(config)
        output_logits(torch.zeros(1), config)  # a bad output_multiplier / final_logit_softcapping fails here

    @property
    def sliding_layers(self) -> list[bool]:
        """Per layer: whether it has a sliding window."""
        return [layer.window is not None for layer in self.layer_attention]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the drafter computes (its accelerate execution device when placed with a ``device_map``)."""
        return execution_device(self)

    def new_cache(self) -> KVCache:
        """An empty context K/V cache for :meth:`forward` (one entry per drafter layer)."""
        return KVCache(self.num_layers)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, N, nT*H]`` concatenated target features -> ``[B, N, H]`` context rows (``hidden_norm(fc(.))``)."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        target_hidden: torch.Tensor,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache | None = None,
        store_context: bool = True,
        attention_mask: torch.Tensor | None = None,
        cached_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the drafter on one block.

        Args:
            target_hidden: ``[B, N, nT*H]`` features of the *new* context rows (``N`` may be 0), i.e. the rows not
                yet in ``past_key_values``.
            noise_embedding: ``[B, L, H]`` the embedded block ``[bonus, MASK, ...]`` (target's ``embed_tokens``, unscaled:
                the drafter applies its config's ``input_embedding_scale``).
            position_ids: ``[B, N + L]`` (or ``[N + L]``) positions of ``[new context ; block]``.
            past_key_values: optional context cache; with ``store_context`` the new context K/V are appended to
                it (block K/V never are), so after the call it holds exactly the committed context.
            attention_mask: optional ``[B|1, 1, L, C + N + L]`` bool (True = visible) or additive float mask over
                ``[cached ; new context ; block]`` keys (training with several blocks); ``None`` = all visible.
            cached_positions: ``[B|1, C]`` the position of every cached key, read by masked layers (causal, sliding
                windows); ``None``: the ``C`` positions just before the first new row (a contiguous cache of the
                committed prefix). A static cache of slots passes its own (slot ``j`` holds position ``j``).
        Returns:
            ``[B, L, H]`` final-normed hidden states of the block rows (apply :meth:`compute_logits`).
        """
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        b = noise_embedding.shape[0]
        if position_ids.shape[0] != b:
            position_ids = position_ids.expand(b, -1)
        n_ctx = target_hidden.shape[1]
        if position_ids.shape[1] != n_ctx + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids cover {position_ids.shape[1]} rows but context + block = "
                f"{n_ctx} + {noise_embedding.shape[1]}"
            )
        # target features come from the target's layers, which may sit on other devices (device_map)
        x = noise_embedding.to(self.device, self.dtype)
        if self.input_embedding_scale != 1.0:
            x = x * self.input_embedding_scale
        ctx = self.project_context(target_hidden.to(x.device, self.dtype)) if n_ctx else x.new_zeros(b, 0, x.shape[-1])
        if ctx.shape[0] != b:
            ctx = ctx.expand(b, -1, -1)
        cos, sin = self.rotary_emb(x, position_ids.to(x.device))
        masks: dict[Any, torch.Tensor | None] = {}
        query_pos = key_pos = position_ids  # read by masked layers only (is_causal, sliding windows)
        if any(layer.masked for layer in self.layer_attention):
            if cached_positions is None:  # a contiguous cache: the positions just before the new rows
                cached = 0 if past_key_values is None else past_key_values.get_seq_length(0)
                cached_positions = position_ids[:, :1] - cached + torch.arange(cached, device=position_ids.device)
            cached_positions = cached_positions.to(position_ids.device).expand(b, -1)
            key_pos = torch.cat([cached_positions, position_ids], dim=1)  # [B, C + N + L]
            query_pos = position_ids[:, n_ctx:]
        for layer, kind in zip(self.layers, self.layer_attention):
            if kind not in masks:
                masks[kind] = layer_visibility(kind, query_pos, key_pos, attention_mask)
            x = layer(x, ctx, cos, sin, past_key_values, store_context, masks[kind])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """``[..., H]`` drafter hidden states -> ``[..., V]`` logits through the target's ``lm_head``, then the
        config's ``output_multiplier`` and ``final_logit_softcapping`` (:func:`~spiffy.models.dflash_fields.output_logits`)."""
        w = getattr(lm_head, "weight", None)
        if w is not None and w.dtype != hidden.dtype:
            hidden = hidden.to(w.dtype)
        return output_logits(lm_head(hidden), self.config)


class TargetFeatureHooks:
    """Capture the outputs of chosen target decoder layers with forward hooks (no ``output_hidden_states``).

    ``features()`` returns ``[B, R, len(layer_ids) * H]``: for each id in ``layer_ids`` (in that order)
    transformers' ``hidden_states[layer_id + 1]`` of the latest forward, i.e. the output of decoder layer
    ``layer_id``. (transformers reports the *last* layer's entry after the final norm; the hooks do the same, so a
    drafter trained on ``output_hidden_states`` sees identical features for any layer id.) Use as a context manager
    (hooks are removed on exit).
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]) -> None:
        layers = _decoder_layers(target)
        self.layer_ids = [int(i) for i in layer_ids]
        for i in self.layer_ids:
            if not 0 <= i < len(layers):
                raise DrafterMismatchError(
                    f"target layer id {i} is out of range: the target has {len(layers)} decoder layers; "
                    "fix: use a drafter trained for this target (dflash_config.target_layer_ids)"
                )
        self._out: dict[int, torch.Tensor] = {}
        self._last = len(layers) - 1
        self._final_norm = getattr(getattr(target, "model", target), "norm", None)
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, idx: int):  # noqa: ANN202
        def fn(module, args, output):  # noqa: ANN001, ANN202
            out = output[0] if isinstance(output, (tuple, list)) else output
            if idx == self._last and self._final_norm is not None:
                out = self._final_norm(out)
            self._out[idx] = out

        return fn

    def features(self, batch_row: int | None = None) -> torch.Tensor:
        """``[B, R, nT*H]`` concatenated captured outputs of the latest forward (``batch_row``: that batch row
        only, ``[1, R, nT*H]``, sliced before concatenating)."""
        missing = [i for i in self.layer_ids if i not in self._out]
        if missing:
            raise RuntimeError(f"no features captured for target layers {missing}: run a target forward first")
        first = self._out[self.layer_ids[0]].device  # layers may sit on several devices (device_map)
        rows = slice(None) if batch_row is None else slice(int(batch_row), int(batch_row) + 1)
        return torch.cat([self._out[i][rows].to(first) for i in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self._out.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._out.clear()

    def __enter__(self) -> "TargetFeatureHooks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _decoder_layers(target: nn.Module) -> nn.ModuleList:
    inner = getattr(target, "model", target)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise DrafterMismatchError(
            f"cannot find decoder layers on {type(target).__name__} (expected target.model.layers); "
            "fix: pass a transformers causal LM target (load_target)"
        )
    return layers


def check_compatible(drafter: DFlashDraftModel, target: nn.Module) -> None:
    """Raise :class:`DrafterMismatchError` unless ``drafter`` fits ``target`` (hidden size, vocab, layer ids)."""
    tcfg = target.config
    dcfg = drafter.config
    if int(tcfg.hidden_size) != int(dcfg.hidden_size):
        raise DrafterMismatchError(
            f"drafter hidden_size {dcfg.hidden_size} != target hidden_size {tcfg.hidden_size}; "
            "fix: use the drafter trained for this target"
        )
    emb = target.get_input_embeddings().weight
    t_vocab = int(emb.shape[0])
    d_vocab = getattr(dcfg, "vocab_size", None)
    if d_vocab is not None and int(d_vocab) != int(tcfg.vocab_size):
        raise DrafterMismatchError(
            f"drafter vocab_size {d_vocab} != target vocab_size {tcfg.vocab_size}; "
            "fix: use the drafter trained for this target (it borrows the target's embeddings and head)"
        )
    if not 0 <= drafter.mask_token_id < t_vocab:
        raise DrafterMismatchError(
            f"drafter mask_token_id {drafter.mask_token_id} is outside the target's vocabulary of {t_vocab}; "
            "fix: use the drafter trained for this target"
        )
    n_layers = int(tcfg.num_hidden_layers)
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DrafterMismatchError(
            f"drafter target_layer_ids {drafter.target_layer_ids} reach beyond the target's {n_layers} layers "
            f"(bad: {bad}); fix: use the drafter trained for this target"
        )
    if drafter.num_target_layers is not None and drafter.num_target_layers != n_layers:
        raise DrafterMismatchError(
            f"drafter was built for a {drafter.num_target_layers}-layer target, this target has {n_layers}; "
            "fix: use the drafter trained for this target"
        )
    if drafter.fc.weight.shape[1] != len(drafter.target_layer_ids) * int(tcfg.hidden_size):
        raise DrafterMismatchError(
            f"drafter fc takes {drafter.fc.weight.shape[1]} features, expected "
            f"{len(drafter.target_layer_ids)} x {tcfg.hidden_size}; fix: check dflash_config.target_layer_ids"
        )


# ----------------------------------------------------------------------------------------------------- loading


def load_drafter(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: Any = None,
    offload_folder: str | os.PathLike | None = None,
    max_memory: Mapping[Any, Any] | None = None,
) -> DFlashDraftModel:
    """Load a DFlash drafter checkpoint directory with strict key matching.

    Reads files through the loader every family shares (:mod:`spiffy.models.checkpoint`).

    Args:
        path: directory holding ``config.json`` (Qwen3Config + DFlash extras) and ``model.safetensors`` or a
            sharded ``model.safetensors.index.json``.
        dtype: parameter dtype (``torch.dtype`` or a name like ``"float64"``/``"bf16"``); ``None``/``"auto"`` keeps
            the stored tensors' dtype.
        device: where to put the model.
        device_map, offload_folder, max_memory: accelerate placement, as for
            :func:`spiffy.models.loading.load_model` (module names ``fc``, ``layers.{i}``, ``norm``, ...).
    Raises:
        CheckpointError: directory/config/weights missing or not a DFlash drafter.
        CheckpointKeyError: missing, unexpected or shape-mismatched keys (named).
    """
    root = checkpoint_dir(path)  # a directory, or a Hub id such as z-lab/Qwen3-8B-DFlash-b16
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"no config.json in {root}; fix: point at a DFlash drafter checkpoint directory")
    raw = read_config_dict(root)
    if not (is_dflash_config(raw) or "target_layer_ids" in raw or "num_target_layers" in raw):
        raise CheckpointError(
            f"{root} is not a DFlash drafter (config.json has no dflash_config and architectures "
            f"{raw.get('architectures')}); fix: pass the drafter directory, not the target's"
        )
    cfg = dict(raw)
    cfg.pop("model_type", None)
    cfg.pop("auto_map", None)
    config = Qwen3Config(**cfg)
    drafter_settings(config)  # config problems (no mask id, no layer ids) first, before reading any weights
    device, device_map = placement_device(device, device_map)
    if device_map is not None:
        keep = dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto")
        want = stored_dtype(root) if keep else resolve_dtype(dtype)
        model = dispatch_checkpoint(lambda: DFlashDraftModel(config), root, device_map, want, offload_folder,
                                    max_memory, no_split=["DFlashDecoderLayer"])
        return model.eval()
    state = load_state_dict(root)
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        want = next(iter(state.values())).dtype if state else torch.float32
    else:
        want = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    dflash2 = any(k.startswith("candidate_selector.") for k in state)  # spiffy.models.dflash2's weights
    check_keys(model, state, root, fix="fix: this is a DFlash2 drafter (candidate_selector.*, *_conv.*): load it with "
               "spiffy.models.load_ar_drafter, its config.json naming conv_kernel_size, conv_group_size, selector_rank "
               "and selector_top_k" if dflash2 else None)
    return fill_drafter(model, state, want, device)


def fill_drafter(model: DFlashDraftModel, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str | None) -> DFlashDraftModel:
    """A drafter built on the meta device, filled with ``state`` (keys already checked) in ``dtype`` on ``device``
    (default CPU), in eval mode; its RoPE buffers, which no checkpoint holds, rebuilt in float32 on that device."""
    model = model.to_empty(device=device or "cpu")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model = model.to(dtype=dtype)
    model.rotary_emb = Qwen3RotaryEmbedding(config=model.config).to(device or "cpu")
    return model.eval()
