"""``attn_implementation="flash_attention_2"`` for the in-package dLLM families: flash-attn where no mask is needed.

flash-attn takes no custom masks, so only mask-free calls go to it: the no-cache bidirectional forward of
LLaDA/Dream (and the prefix-cache forwards whose queries see every key), and SDAR's plain causal forward (its
prefill). Every masked call (tree / Spiffy verification rows, block-causal masks, ragged padded batches) goes to
SDPA, so outputs keep the SDPA semantics everywhere; flash-attn's kernel also needs a CUDA tensor in float16 or
bfloat16, and other calls (CPU, float32/float64) go to SDPA as well.

flash-attn is optional (``pip install 'spiffy-decoding[flash]'``) and imported lazily: loading a model with
``flash_attention_2`` without it raises :class:`~spiffy.errors.MissingDependencyError`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from spiffy.errors import MissingDependencyError

__all__ = ["FLASH", "flash_applicable", "flash_attend", "require_flash_attn"]

#: the attention implementation name (transformers' spelling)
FLASH = "flash_attention_2"

_KERNEL: list[Callable[..., torch.Tensor]] = []  # flash_attn.flash_attn_func once imported


def require_flash_attn() -> Callable[..., torch.Tensor]:
    """``flash_attn.flash_attn_func``, or :class:`~spiffy.errors.MissingDependencyError` naming the fix."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        from flash_attn import flash_attn_func  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise MissingDependencyError(
            "attn_implementation='flash_attention_2' needs the flash-attn package, which is not installed; fix: "
            "pip install 'spiffy-decoding[flash]' (CUDA GPUs only), or use attn_implementation='sdpa' (the default)"
        ) from exc
    _KERNEL.append(flash_attn_func)
    return flash_attn_func


def flash_applicable(q: torch.Tensor) -> bool:
    """flash-attn runs on CUDA tensors in float16 / bfloat16 only."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool) -> torch.Tensor:
    """``q [B, H, L, D]`` over ``k``/``v [B, H_kv, S, D]`` (grouped-query heads handled by the kernel), no mask;
    ``causal``: query ``i`` sees keys ``<= i + S - L`` (the last ``L`` keys are the queries).

    Returns ``[B, L, H * D]``.
    """
    kernel = require_flash_attn()
    kwargs: dict[str, Any] = {"softmax_scale": scale, "causal": causal}
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)  # [B, L, H, D]
    b, length, h, d = out.shape
    return out.reshape(b, length, h * d)
