"""Unmasking schedules of the dLLM baselines: how many (and which) masked positions a step unmasks.

* :func:`get_num_transfer_tokens` - LLaDA's static schedule (``floor(M / steps)`` per step, one more for the first
  ``M mod steps`` steps).
* :func:`dream_timesteps` / :func:`dream_num_transfer` - Dream's ``int(n_masked * (1 - s / t))`` schedule over
  ``linspace(1, eps, steps + 1)`` (everything at the last step).
* :func:`topk_transfer` / :func:`threshold_transfer` - choose positions from a confidence row with
  ``torch.topk`` (the references' tie-breaking) or Fast-dLLM's dynamic threshold rule.
"""

from __future__ import annotations

import numpy as np
import torch


def get_num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to unmask at each of ``steps`` steps, per batch row.

    Args:
        mask_index: ``[B, L]`` bool, the masked positions of the block at its start.
        steps: steps of the block (``>= 1``).
    Returns:
        ``[B, steps]`` int64; row ``b`` sums to ``mask_index[b].sum()``: every step gets ``M // steps`` and the
        first ``M % steps`` steps one more.
    """
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    cols = torch.arange(steps, device=mask_index.device)[None, :]
    return out + (cols < remainder).to(torch.int64)


def dream_timesteps(steps: int, eps: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Dream's timesteps ``linspace(1, eps, steps + 1)`` (``[steps + 1]``, default float dtype, as the reference)."""
    return torch.linspace(1, eps, steps + 1, device=device)


def dream_num_transfer(num_mask: torch.Tensor | float, timesteps: torch.Tensor, step: int, steps: int) -> int:
    """Tokens Dream unmasks at ``step`` (0-based) of ``steps``: ``int(num_mask * (1 - s / t))`` with
    ``t = timesteps[step]``, ``s = timesteps[step + 1]``; all remaining (``int(num_mask)``) at the last step.

    ``num_mask`` is the (batch-averaged, as in the reference) number of masked positions in the block.
    """
    if step >= steps - 1:
        return int(num_mask)
    t = timesteps[step]
    s = timesteps[step + 1]
    return int(num_mask * (1 - s / t))


def dream_num_transfer_host(num_masked: int, batch: int, timesteps: list[float], step: int, steps: int,
                            dtype: torch.dtype | None = None) -> int:
    """:func:`dream_num_transfer` of ``num_masked / batch`` (the reference's batch-averaged count, a tensor division in
    the default float dtype) from a host copy of the timesteps, with no device read: the same IEEE operations
    (divide, subtract, multiply, each rounded to ``dtype``, the timesteps' dtype; default: torch's default) in
    numpy scalars, so the count is the tensor computation's bit for bit."""
    real = np.float64 if (dtype or torch.get_default_dtype()) == torch.float64 else np.float32
    num_mask = real(num_masked) / real(batch)
    if step >= steps - 1:
        return int(num_mask)
    t, s = real(timesteps[step]), real(timesteps[step + 1])
    return int(num_mask * (real(1) - s / t))


def masked_rows(mask: torch.Tensor, count: int) -> torch.Tensor:
    """``[count]`` long: the indices of ``mask``'s ``count`` true entries in the flattened ``[numel]`` order (what
    ``mask.reshape(-1).nonzero()`` gives) when the count is known on the host: a stable sort puts them first, so the
    device is never asked for the data-dependent size."""
    return torch.sort((~mask).reshape(-1).to(torch.uint8), stable=True).indices[:count]


def topk_transfer(confidence: torch.Tensor, k: torch.Tensor | list[int]) -> torch.Tensor:
    """Select the ``k[b]`` most confident entries of each row with ``torch.topk`` (the references' rule).

    Args:
        confidence: ``[B, F]`` (``-inf`` = not eligible).
        k: ``[B]`` counts.
    Returns:
        ``[B, F]`` bool transfer mask.
    """
    transfer = torch.zeros_like(confidence, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        kj = int(k[j])
        if kj <= 0:
            continue
        _, idx = torch.topk(confidence[j], k=kj)
        transfer[j, idx] = True
    return transfer


def threshold_transfer(confidence: torch.Tensor, num_masked: torch.Tensor | list[int], threshold: float) -> torch.Tensor:
    """Fast-dLLM dynamic unmasking: the ``num_masked[b]`` eligible entries ranked by ``torch.topk``; the first is
    always taken, every other one only when its confidence is ``>= threshold``.

    Args:
        confidence: ``[B, F]`` (``-inf`` = not eligible).
        num_masked: ``[B]`` eligible (masked, in-block) counts.
        threshold: ``0 < tau <= 1``.
    Returns:
        ``[B, F]`` bool transfer mask (at least one entry per row that has an eligible entry).
    """
    transfer = torch.zeros_like(confidence, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        kj = int(num_masked[j])
        if kj <= 0:
            continue
        vals, idx = torch.topk(confidence[j], k=kj)
        keep = vals >= threshold
        keep[0] = True
        transfer[j, idx] = keep  # idx distinct: the same set as transfer[j, idx[keep]] = True, with no host read
    return transfer


__all__ = ["get_num_transfer_tokens", "dream_timesteps", "dream_num_transfer", "dream_num_transfer_host", "masked_rows",
           "topk_transfer", "threshold_transfer"]
