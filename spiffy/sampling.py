"""One home for sampling settings and logit filtering, shared by dLLM decoding, the AR paths, benchmarks and the CLI.

:class:`SamplingConfig` holds temperature, top-p, top-k and seed with one convention for "off" (``temperature=0``
is greedy, ``top_p=1.0`` and ``top_k=0`` disable the filters, ``seed=None`` means "no seed given").
:func:`filter_logits` is the single top-k / top-p implementation. The official generators this library reproduces
disagree in three details, and token-for-token parity needs each one, so they are named parameters rather than
copies of the function:

* ``fill``: what a removed logit becomes: ``-inf`` (SDAR, the AR paths) or the dtype's minimum (Dream's
  ``top_p_logits``/``top_k_logits``); both give probability 0 after softmax, but they differ if the caller later
  reads the filtered logits themselves.
* ``order``: top-k then top-p (SDAR, AR) or top-p then top-k (Dream's ``sample_tokens``).
* ``nucleus``: ``"exceeds"`` keeps tokens while the mass *before* them is ``<= top_p`` (Dream, SDAR: the token that
  crosses ``top_p`` is kept, and so is the next one when the mass lands exactly on ``top_p``); ``"reaches"`` keeps
  the smallest set whose mass reaches ``top_p`` (the AR paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from spiffy.errors import ConfigError

__all__ = ["SamplingConfig", "validate_sampling", "filter_logits", "top_k_filter", "top_p_filter"]

Fill = Literal["-inf", "min"]
Order = Literal["k_then_p", "p_then_k"]
Nucleus = Literal["exceeds", "reaches"]


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise :class:`ConfigError` for ``temperature < 0``, ``top_p`` outside ``(0, 1]`` or ``top_k < 0``."""
    if not temperature >= 0:  # also catches NaN
        raise ConfigError(f"temperature must be >= 0, got {temperature}; fix: use 0 for greedy or a positive value")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}; fix: use 1.0 to disable nucleus filtering")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0, got {top_k}; fix: use 0 to disable top-k filtering")


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn from logits.

    Attributes:
        temperature: ``0`` = greedy (argmax of the raw logits); otherwise logits are divided by it.
        top_p: nucleus mass in ``(0, 1]``; ``1.0`` = off.
        top_k: keep the ``k`` largest logits; ``0`` = off.
        seed: seed of the random draws; ``None`` = no seed given (each path says what it then does).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        validate_sampling(float(self.temperature), float(self.top_p), int(self.top_k))

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0): no random draw is made."""
        return float(self.temperature) == 0.0

    @classmethod
    def from_loose(
        cls,
        temperature: float | None = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> "SamplingConfig":
        """Build from the loose conventions of the reference generators (``None``, ``0`` or ``1.0`` meaning off)."""
        return cls(
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None else int(top_k),
            seed=seed,
        )

    def top_p_or_none(self) -> float | None:
        """``top_p`` in the reference generators' convention (``None`` = off)."""
        return None if self.top_p >= 1.0 else self.top_p

    def top_k_or_none(self) -> int | None:
        """``top_k`` in the reference generators' convention (``None`` = off)."""
        return None if self.top_k <= 0 else self.top_k


def _fill_value(scores: torch.Tensor, fill: Fill) -> float:
    if fill == "-inf":
        return float("-inf")
    if fill == "min":
        return float(torch.finfo(scores.dtype).min)
    raise ValueError(f"fill must be '-inf' or 'min', got {fill!r}")


def top_k_filter(scores: torch.Tensor, top_k: int, *, fill: Fill = "-inf") -> torch.Tensor:
    """Keep the ``top_k`` largest entries of each row (and every entry tied with the k-th); others become ``fill``.

    Args:
        scores: ``[..., V]``.
    Returns:
        ``[..., V]`` (``scores`` itself when ``top_k`` is 0 or at least ``V``).
    """
    vocab = scores.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return scores
    kth = torch.topk(scores, int(top_k), dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, _fill_value(scores, fill))


def top_p_filter(scores: torch.Tensor, top_p: float, *, fill: Fill = "-inf", nucleus: Nucleus = "exceeds") -> torch.Tensor:
    """Nucleus filter: keep the most probable entries of each row up to mass ``top_p`` (at least one).

    Args:
        scores: ``[..., V]`` logits (already temperature-scaled if the caller wants that).
        nucleus: ``"exceeds"`` drops an entry when the mass before it is ``> top_p``; ``"reaches"`` when it is
            ``>= top_p`` (see the module docstring).
    Returns:
        ``[..., V]`` (``scores`` itself when ``top_p >= 1``).
    """
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    if nucleus == "exceeds":
        # written as the references do (shifted cumulative sum) so the float rounding is theirs too
        cumulative = probs.cumsum(dim=-1)
        drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
        drop_sorted[..., 1:] = cumulative[..., :-1] > top_p
    elif nucleus == "reaches":
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
    else:
        raise ValueError(f"nucleus must be 'exceeds' or 'reaches', got {nucleus!r}")
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, _fill_value(scores, fill))


def filter_logits(
    scores: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    fill: Fill = "-inf",
    order: Order = "k_then_p",
    nucleus: Nucleus = "exceeds",
) -> torch.Tensor:
    """Top-k and top-p filtering of ``scores [..., V]`` in the given order (no temperature: the caller divides).

    ``top_k=0`` and ``top_p=1.0`` are off. The keyword parameters select the reference-parity variants described in
    the module docstring.
    """
    if order == "k_then_p":
        return top_p_filter(top_k_filter(scores, top_k, fill=fill), top_p, fill=fill, nucleus=nucleus)
    if order == "p_then_k":
        return top_k_filter(top_p_filter(scores, top_p, fill=fill, nucleus=nucleus), top_k, fill=fill)
    raise ValueError(f"order must be 'k_then_p' or 'p_then_k', got {order!r}")
