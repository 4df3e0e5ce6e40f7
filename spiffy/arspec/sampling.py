"""Position-keyed sampling: the same token for the same position on every decoding path (SPEC §7).

A tree verifies many nodes per round, so a sequential random generator would hand the draws to the nodes in a
different order than plain AR decoding. Instead the noise of the token drawn at absolute position ``p`` is a
function of ``(seed, p)`` only: Gumbel noise from a generator seeded with a hash of ``(seed, p)``, added to the
temperature-scaled, top-k / top-p filtered logits (:func:`spiffy.sampling.filter_logits`, ``nucleus="reaches"``),
followed by an argmax (the Gumbel-max trick: an exact sample from ``softmax(filtered / T)``). AR, the DFlash chain
and DDTree therefore draw identical tokens on their common positions, and the accepted path reproduces AR decoding
exactly. Each position's noise enters the output once, so the result is a valid sample. ``temperature == 0`` is
greedy (argmax of the raw logits).

Temperature is applied in one place, :func:`tempered`, for the target's logits (here) and the drafter's (the tree
builder), so both are scaled the same way.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spiffy.sampling import SamplingConfig, filter_logits
from spiffy.torch_utils import device_tensor

__all__ = ["position_key", "gumbel_noise", "tempered", "sample_tokens", "sample_keyed", "keyed_seed", "inverse_cdf",
           "keyed_uniforms"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """A 63-bit generator seed derived from ``(seed, position)`` (stable across runs and platforms)."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(position) & _MASK64)) >> 1


def keyed_seed(sampling: SamplingConfig) -> int:
    """The seed position keys are derived from: ``sampling.seed``, or 0 when none was given."""
    return 0 if sampling.seed is None else int(sampling.seed)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[..., V]`` logits as float64 (float64 input) or float32 (otherwise), divided by ``temperature`` when > 0."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    return work / float(temperature) if temperature > 0 else work


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
    scores = filter_logits(tempered(logits, temperature), int(top_k), float(top_p), nucleus="reaches")
    vocab = scores.shape[-1]
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    by_pos: dict[int, list[int]] = {}
    for row, pos in enumerate(positions):
        by_pos.setdefault(int(pos), []).append(row)
    for pos, rows in by_pos.items():
        noise = gumbel_noise(seed, pos, vocab, scores.device, scores.dtype)
        idx = device_tensor(rows, torch.long, scores.device)
        out[idx] = (scores[idx] + noise).argmax(dim=-1)
    return out


def sample_keyed(logits: torch.Tensor, positions: Sequence[int], sampling: SamplingConfig) -> torch.Tensor:
    """:func:`sample_tokens` with the settings of a :class:`~spiffy.sampling.SamplingConfig` (``[N, V]`` -> ``[N]``)."""
    return sample_tokens(
        logits,
        positions,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        seed=keyed_seed(sampling),
    )


def keyed_uniforms(key: int, count: int) -> torch.Tensor:
    """``[count]`` float64 uniforms in ``[0, 1)`` on the host from a generator seeded by ``key`` (a
    :func:`position_key`). The first ``n`` of them do not depend on ``count``, so a walk that pads its draws to a
    static count reads the same coins as one that does not. Host-made: building them reads nothing from a device."""
    gen = torch.Generator().manual_seed(int(key))
    return torch.rand(int(count), generator=gen, dtype=torch.float64)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[...]`` long: the inverse-CDF draw of each row of ``probs`` ``[..., V]`` (nonnegative, not necessarily
    normalised) with the uniform of ``u`` ``[...]`` (on the same device) in ``[0, 1)``: the first token whose
    cumulative mass exceeds ``u * total``. A ``u * total`` that rounds onto the total takes the last token with mass,
    so a token without mass is never drawn; a row without any mass gives ``-1``. A tensor program: nothing is read
    to the host."""
    cdf = torch.cumsum(probs, dim=-1)
    target = u.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]  # u on the device of probs
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    ramp = torch.arange(int(probs.shape[-1]), device=probs.device)
    last = torch.where(probs > 0, ramp, -1).amax(dim=-1)
    return torch.minimum(idx, last)
