"""Position-keyed sampling: the same token for the same position on every decoding path (SPEC §7).

A tree verifies many nodes per round, so a sequential random generator would hand the draws to the nodes in a
different order than plain AR decoding. Instead the noise of the token drawn at absolute position ``p`` is a
function of ``(seed, p)`` only: Gumbel noise from a generator seeded with a hash of ``(seed, p)``, added to the
temperature-scaled, top-k / top-p filtered logits, followed by an argmax (the Gumbel-max trick: an exact sample from
``softmax(filtered / T)``). AR, the DFlash chain and DDTree therefore draw identical tokens on their common
positions, and the accepted path reproduces AR decoding exactly. Each position's noise enters the output once,
so the result is a valid sample. ``temperature == 0`` is greedy (argmax of the raw logits).
"""

from __future__ import annotations

from typing import Sequence

import torch

from spiffy.errors import ConfigError

__all__ = ["validate_sampling", "filter_logits", "position_key", "gumbel_noise", "sample_tokens"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """A 63-bit generator seed derived from ``(seed, position)`` (stable across runs and platforms)."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(position) & _MASK64)) >> 1


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise :class:`ConfigError` for ``temperature < 0``, ``top_p`` outside ``(0, 1]`` or ``top_k < 0``."""
    if not temperature >= 0:  # also catches NaN
        raise ConfigError(f"temperature must be >= 0, got {temperature}; fix: use 0 for greedy or a positive value")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}; fix: use 1.0 to disable nucleus filtering")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0, got {top_k}; fix: use 0 to disable top-k filtering")


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Temperature, then top-k, then top-p filtering.

    Args:
        logits: ``[N, V]`` raw logits.
    Returns:
        ``[N, V]`` scores ``logits / T`` with filtered-out entries set to ``-inf`` (float64 for float64 input,
        float32 otherwise). Top-k keeps every token tied with the k-th best; top-p keeps the smallest set of most
        probable tokens whose mass reaches ``top_p`` (always at least one).
    """
    work = logits if logits.dtype == torch.float64 else logits.float()
    scores = work / float(temperature)
    vocab = scores.shape[-1]
    neg = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = torch.where(scores >= kth, scores, neg)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = torch.where(drop, neg, scores)
    return scores


def gumbel_noise(
    seed: int, position: int, vocab: int, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[V]`` standard Gumbel noise drawn from a generator seeded by ``(seed, position)`` on ``device``."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(position_key(seed, position))
    u = torch.rand(vocab, generator=gen, device=dev, dtype=dtype)
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor,
    positions: Sequence[int],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """Draw one token per row, keyed by the absolute position of the token being drawn.

    Args:
        logits: ``[N, V]`` logits; row ``i`` predicts the token at absolute position ``positions[i]``.
        positions: ``N`` absolute positions (rows sharing a position share the noise).
    Returns:
        ``[N]`` long token ids on ``logits.device`` (greedy argmax when ``temperature == 0``).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    if len(positions) != logits.shape[0]:
        raise ValueError(f"{len(positions)} positions for {logits.shape[0]} rows")
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = filter_logits(logits, temperature, top_p, top_k)
    vocab = scores.shape[-1]
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    by_pos: dict[int, list[int]] = {}
    for row, pos in enumerate(positions):
        by_pos.setdefault(int(pos), []).append(row)
    for pos, rows in by_pos.items():
        noise = gumbel_noise(seed, pos, vocab, scores.device, scores.dtype)
        idx = torch.tensor(rows, device=scores.device)
        out[idx] = (scores[idx] + noise).argmax(dim=-1)
    return out
