"""The pieces of SDAR's denoising rule: the per-step schedule, the sampling step, the transfer strategies and the
block-causal mask (see :mod:`spiffy.decoding.sdar` for the semantics they reproduce)."""

from __future__ import annotations

from typing import Sequence

import torch

from spiffy.decoding.schedules import masked_rows
from spiffy.decoding.sdar_config import STRATEGIES
from spiffy.errors import ConfigError
from spiffy.sampling import filter_logits

_ENTROPY_EPS = 1e-12


# ---------------------------------------------------------------------------------------------------- rule pieces
def num_transfer_tokens(block_length: int, steps: int) -> list[int]:
    """The reference's ``get_num_transfer_tokens``: ``block_length // steps`` per step, plus one for the first
    ``block_length % steps`` steps."""
    base, rem = divmod(int(block_length), int(steps))
    return [base + (1 if i < rem else 0) for i in range(int(steps))]


def sdar_sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDAR's sampling step on window logits.

    Args:
        logits: ``[B, W, V]``.
        temperature: ``0`` = greedy (argmax; probabilities at temperature 1), else ``logits / T`` when ``T != 1``.
        top_k: keep the ``k`` largest logits (``0`` = off). top_p: nucleus mass (``1.0`` = off).
        generator: source of the one ``multinomial`` draw per row (``[B * W, V]`` probabilities, one sample each).
    Returns:
        tokens ``[B, W]`` long, their probabilities ``[B, W]`` and the sampling distribution ``[B, W, V]``.
    """
    shape = logits.shape[:-1]
    z = logits.reshape(-1, logits.shape[-1])
    greedy = float(temperature) == 0.0
    if not greedy and float(temperature) != 1.0:
        z = z / temperature
    # SDAR's filters: top-k then top-p, removed logits set to -inf, the crossing token kept
    filtered = filter_logits(
        z,
        top_k=int(top_k),
        top_p=float(top_p),
        fill="-inf",
        order="k_then_p",
        nucleus="exceeds",
    )
    probs = torch.softmax(filtered, dim=-1)
    if greedy:
        tokens = torch.argmax(z, dim=-1, keepdim=True)
    else:
        tokens = torch.multinomial(probs, num_samples=1, generator=generator)
    token_probs = torch.gather(probs, -1, tokens)
    return tokens.view(shape), token_probs.view(shape), probs.view(*shape, -1)


def entropy_of(probs: torch.Tensor) -> torch.Tensor:
    """Entropy per row as JetEngine computes it: ``-sum(p log p)`` with ``p`` clamped at 1e-12. ``[..., V] -> [...]``."""
    p = probs.clamp_min(_ENTROPY_EPS)
    return -(p * p.log()).sum(dim=-1)


def select_transfer(
    masked: torch.Tensor,
    token_probs: torch.Tensor,
    probs: torch.Tensor | None,
    count: int,
    strategy: str,
    threshold: float,
    eb_threshold: float,
    overwrite_quirk: bool = False,
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Which block rows take their sampled token in one step.

    Args:
        masked: ``[B, L]`` bool, rows of the block still masked.
        token_probs: ``[B, L]`` probability of each row's sampled token (the confidence).
        probs: ``[B, L, V]`` sampling distribution (needed by ``entropy_bounded`` only).
        count: the schedule's count for this step.
        strategy, threshold, eb_threshold: the rule (see module doc).
        overwrite_quirk: use ``count`` even when fewer rows are masked (the reference's behaviour).
        counts: ``[B]`` host ints, ``masked``'s row counts when known (then nothing here reads the device; the
            choices are made on the device: the same rows as the reference's host decisions); ``None``: read here.
    Returns:
        ``[B, L]`` bool transfer mask.
    """
    transfer = torch.zeros_like(masked)
    entropy = entropy_of(probs) if strategy == "entropy_bounded" else None
    length = masked.shape[1]
    cols = torch.arange(length, device=masked.device)
    for r in range(masked.shape[0]):
        m = masked[r]
        n = int(m.sum()) if counts is None else int(counts[r])
        if n == 0 and not (overwrite_quirk and strategy != "entropy_bounded"):
            continue
        k = int(count) if overwrite_quirk else min(int(count), n)
        if strategy == "sequential":
            rows = masked_rows(m, n)  # the masked rows in order (m.nonzero() with its size known here)
            if overwrite_quirk:
                if n == 0:
                    raise ValueError("No mask tokens found in the current block.")
                transfer[r] = (cols >= rows[0]) & (cols < rows[0] + k)  # transfer[r, first : first + k]
            else:
                transfer[r, rows[:k]] = True
        elif strategy in ("low_confidence_static", "low_confidence_dynamic"):
            conf = torch.where(m, token_probs[r], -torch.inf)
            top = torch.zeros_like(m)
            top[torch.topk(conf, k).indices] = True
            if strategy == "low_confidence_dynamic":
                high = conf > threshold
                top = torch.where(high.sum() >= k, high, top)  # enough above the threshold: exactly those
            transfer[r] = top
        elif strategy == "entropy_bounded":
            ent = torch.where(m, entropy[r], torch.inf)  # type: ignore[index]
            ent_sorted, order = torch.sort(ent, stable=True)
            cum = torch.cumsum(ent_sorted, dim=0)
            c = torch.searchsorted(cum, cum.new_tensor([float(eb_threshold)]), right=False)[0]
            c = c.clamp(min=max(min(int(count), n), 1)).clamp(max=n)  # min(max(c, min(count, n), 1), n)
            transfer[r, order] = cols < c  # the c lowest-entropy rows (order is a permutation of the block)
        else:
            raise ConfigError(f"strategy={strategy!r} is unknown; fix: use one of {', '.join(STRATEGIES)}")
    return transfer


__all__ = ["entropy_of", "num_transfer_tokens", "sdar_sample", "select_transfer"]
