"""Token proposal rules of the dLLM baselines, with every random draw taken from an explicit generator.

* :func:`add_gumbel_noise` - LLaDA's float64 "Gumbel" perturbation ``exp(logits) / (-log u) ** T`` (``T = 0``:
  logits returned unchanged, nothing drawn).
* :func:`dream_sample_tokens` - Dream's proposal: temperature, top-p, top-k, then the argmax (``T = 0``) or one
  categorical draw per row; confidence = the chosen token's probability, or the top-1/top-2 margin, or the negative
  entropy.
"""

from __future__ import annotations

import torch

from spiffy.sampling import filter_logits


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.rand(shape)`` from ``generator`` (``dtype=None``: the default float dtype, as ``torch.rand``)."""
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def add_gumbel_noise(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """LLaDA's sampling perturbation (argmax of the result samples ``softmax(logits / T)``).

    Args:
        logits: ``[..., V]``.
        temperature: ``T >= 0``; ``T == 0`` returns ``logits`` itself (same object, nothing drawn).
        generator: source of the uniform draws (``noise`` not given).
        noise: optional pre-drawn float64 uniforms shaped like ``logits`` (used to slice a draw made over a
            larger shape so the generator is consumed exactly as the reference consumes the global RNG).
    Returns:
        float64 ``exp(logits) / (-log u) ** T`` shaped like ``logits``.
    """
    if temperature == 0:
        return logits
    logits64 = logits.to(torch.float64)
    if noise is None:
        noise = torch.rand(logits64.shape, generator=generator, device=logits64.device, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits64.exp() / gumbel_noise


def dream_sample_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    margin_confidence: bool = False,
    neg_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's ``sample_tokens`` (named for the family: the AR side's :func:`spiffy.arspec.sampling.sample_tokens` has
    another contract).

    Args:
        logits: ``[n, V]`` (rows = masked positions).
        temperature: ``0`` = argmax; otherwise logits are divided by it and one token per row is drawn with
            ``torch.multinomial`` from ``generator`` (as ``Categorical(probs).sample()`` does).
        top_p, top_k: the filters (``1.0`` / ``0`` = off, :class:`~spiffy.sampling.SamplingConfig`'s convention).
        margin_confidence: confidence = top-1 minus top-2 probability.
        neg_entropy: confidence = ``sum p log(p + 1e-10)`` (negative entropy).
    Returns:
        ``(confidence [n], x0 [n])``.
    """
    if temperature > 0:
        logits = logits / temperature
    # Dream's filters: top-p then top-k, removed logits set to the dtype's minimum, the crossing token kept
    logits = filter_logits(
        logits,
        top_k=int(top_k),
        top_p=float(top_p),
        fill="min",
        order="p_then_k",
        nucleus="exceeds",
    )
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0 and probs.shape[0] > 0:
        try:
            normed = probs / probs.sum(-1, keepdim=True)
            x0 = torch.multinomial(normed, 1, True, generator=generator).squeeze(-1)
            confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        except RuntimeError:  # invalid distribution (inf/nan): the reference falls back to the argmax
            confidence, x0 = probs.max(dim=-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        if sorted_probs.shape[-1] > 1:
            confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
        else:
            confidence = sorted_probs[:, 0]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


__all__ = ["add_gumbel_noise", "dream_sample_tokens", "uniform"]
