"""``attn_implementation="flex_attention"`` for the in-package dLLM families (beside SDPA / eager).

:func:`torch.nn.attention.flex_attention.flex_attention` takes every mask the forward contract produces
(tree masks, Spiffy verification rows, ragged left-padded batches): a bool mask becomes a block mask (its
``mask_mod`` reads the mask), an additive float mask a ``score_mod`` bias. On CUDA the kernel is compiled once per
process (``torch.compile``: fused, the mask's empty blocks skipped); on CPU it runs unfused unless
``SPIFFY_FLEX_COMPILE=1`` (compiling on CPU works but costs about a minute per new shape, which only pays off for
long runs).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

__all__ = ["flex_attend"]

_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    compile_it = device.type == "cuda" or os.environ.get("SPIFFY_FLEX_COMPILE", "") == "1"
    if not compile_it:
        return flex_attention
    fn = _COMPILED.get("flex")
    if fn is None:
        fn = torch.compile(flex_attention, dynamic=True)
        _COMPILED["flex"] = fn
    return fn


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
        m = mask.expand(batch, 1, length, span)
        if m.dtype == torch.bool:
            def keep(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # noqa: ARG001 - flex's signature
                return m[b, 0, q_idx, kv_idx]

            kwargs["block_mask"] = create_block_mask(keep, batch, None, length, span, device=q.device)
        else:
            bias = m.to(q.dtype)

            def add_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # noqa: ARG001
                return score + bias[b, 0, q_idx, kv_idx]

            kwargs["score_mod"] = add_bias
    with warnings.catch_warnings():  # the unfused CPU path warns on every call
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return _kernel(q.device)(q, k, v, **kwargs)
