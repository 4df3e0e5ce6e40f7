"""``attn_implementation="flex_attention"`` for the in-package dLLM families and the transformers Qwen3 target.

:func:`torch.nn.attention.flex_attention.flex_attention` takes every mask the forward contract produces
(tree masks, Spiffy verification rows, ragged left-padded batches): a bool mask becomes a block mask (its
``mask_mod`` reads the mask), and so does an additive float mask that only holds 0 and "hidden" (at most half the
dtype's minimum, as the tree compilers write it); any other additive mask becomes a ``score_mod`` bias. The block
mask of one forward is built once and reused by every layer (reused while the mask's contents are unchanged). On
CUDA the kernel is compiled once per process (``torch.compile``: fused, the mask's empty blocks skipped); on CPU it
runs unfused unless ``SPIFFY_FLEX_COMPILE=1`` (compiling on CPU works but costs about a minute per new shape, which
only pays off for long runs).

The Qwen3 target is transformers' class; its ``attn_implementation="flex_attention"`` (in
:func:`spiffy.models.loading.load_target` / ``load_model``) selects :data:`TARGET_FLEX`, this kernel registered with
transformers' ``AttentionInterface`` (and ``sdpa_mask`` as its mask builder, without the causal skip, so every
forward hands it a mask). transformers' own ``"flex_attention"`` would take our tree masks too (as a ``score_mod``
bias or a ``BlockMask``), but it always compiles, on CPU as well.
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import Any, Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from spiffy.errors import ConfigError

__all__ = ["TARGET_ATTN_IMPLEMENTATIONS", "TARGET_FLEX", "flex_attend", "target_attention", "target_flex_attention"]

#: the name spiffy's flex kernel is registered under in transformers' attention interfaces
TARGET_FLEX = "spiffy_flex"

#: attention implementations of the transformers Qwen3 target that take the tree masks of verification
TARGET_ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flex_attention")

_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}
_LAST_BLOCK_MASK: list[Any] = []  # [(dtype, shapes, device), a copy of the mask, its BlockMask]: the latest mask


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    compile_it = device.type == "cuda" or os.environ.get("SPIFFY_FLEX_COMPILE", "") == "1"
    if not compile_it:
        return flex_attention
    fn = _COMPILED.get("flex")
    if fn is None:
        fn = torch.compile(flex_attention, dynamic=True)
        _COMPILED["flex"] = fn
    return fn


def _as_visibility(mask: torch.Tensor) -> torch.Tensor | None:
    """A bool view of ``mask`` (True = visible) when it is bool, or additive holding only 0 and hidden values;
    ``None`` for a genuine additive bias. Query rows that see nothing are opened (as SDPA's uniform average)."""
    if mask.dtype == torch.bool:
        visible = mask
    else:
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((hidden | (mask == 0)).all()):
            return None
        visible = ~hidden
    dead = ~visible.any(dim=-1, keepdim=True)
    return visible | dead if bool(dead.any()) else visible


def _block_mask(mask: torch.Tensor, batch: int, length: int, span: int, device: torch.device) -> BlockMask | None:
    """The block mask of ``mask`` (``None`` for a genuine bias), built once per mask tensor and version."""
    key = (mask.dtype, tuple(mask.shape), batch, length, span, device)
    if _LAST_BLOCK_MASK and _LAST_BLOCK_MASK[0] == key and torch.equal(_LAST_BLOCK_MASK[1], mask):
        return _LAST_BLOCK_MASK[2]  # same mask contents as the previous layer's call (one compare, no rebuild)
    visible = _as_visibility(mask)
    built = None
    if visible is not None:
        m = visible.expand(batch, 1, length, span)

        def keep(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # noqa: ARG001 - flex's signature
            return m[b, 0, q_idx, kv_idx]

        built = create_block_mask(keep, batch, None, length, span, device=device)
    _LAST_BLOCK_MASK[:] = [key, mask.clone(), built]
    return built


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """``q [B, H, L, D]`` over ``k``/``v [B, H, S, D]`` with ``mask`` ``None``, bool or additive ``[B|1, 1, L, S]``.

    Returns ``[B, H, L, D]``, the SDPA result up to rounding.
    """
    batch, _heads, length, _d = q.shape
    span = k.shape[-2]
    kwargs: dict[str, Any] = {"scale": scale}
    if mask is not None:
        block = _block_mask(mask, batch, length, span, q.device)
        if block is not None:
            kwargs["block_mask"] = block
        else:
            bias = mask.expand(batch, 1, length, span).to(q.dtype)

            def add_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # noqa: ARG001
                return score + bias[b, 0, q_idx, kv_idx]

            kwargs["score_mod"] = add_bias
    with warnings.catch_warnings():  # the unfused CPU path warns on every call
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return _kernel(q.device)(q, k, v, **kwargs)


def target_attention(attn_implementation: str) -> str:
    """The transformers attention implementation of a Qwen3 target for spiffy's name: ``"flex_attention"`` is
    spiffy's flex kernel (:data:`TARGET_FLEX`), the others are transformers' own."""
    if attn_implementation not in TARGET_ATTN_IMPLEMENTATIONS + (TARGET_FLEX,):
        raise ConfigError(
            f"attn_implementation {attn_implementation!r} cannot verify draft trees (they need a custom mask); "
            f"fix: use one of {TARGET_ATTN_IMPLEMENTATIONS}"
        )
    return TARGET_FLEX if attn_implementation == "flex_attention" else attn_implementation


def target_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :func:`flex_attend`: ``query [B, H, L, D]``, ``key`` /
    ``value [B, H_kv, S, D]`` (grouped-query heads repeated here), ``attention_mask`` ``[B|1, 1, L, >=S]`` bool or
    additive, or ``None`` (causal over the last ``L`` keys when ``L > 1``). Returns ``([B, L, H, D], None)``."""
    if dropout:
        raise ValueError("spiffy's flex attention is for inference; fix: call model.eval()")
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    length, span = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.shape[-1] != span:
        mask = mask[..., :span]
    if mask is None and length > 1 and getattr(module, "is_causal", True):
        q_pos = torch.arange(length, device=query.device)[:, None] + (span - length)
        mask = (torch.arange(span, device=query.device)[None, :] <= q_pos)[None, None]
    out = flex_attend(query, key, value, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TARGET_FLEX, target_flex_attention)
AttentionMaskInterface.register(TARGET_FLEX, partial(sdpa_mask, allow_is_causal_skip=False))
