"""The pieces of Fast-dLLM v2's sub-block threshold rule as tensor programs over the rows of a batch (see
:mod:`spiffy.decoding.fast_dllm_v2` for the semantics they reproduce).

The official loop works row by row on the host (``nonzero`` of the block's masks for the current sub-block, ``bool``
of the stop test); here every piece is one program over ``[B, L]`` block columns, so a step reads nothing back:
what the host must know (whether a row still decodes, for the random draws) travels on the reads Spiffy makes anyway
(:meth:`~spiffy.decoding.session.DecodeSession.count_tensor`). Every value a row gets is the one its own official
computation gives (the same per-position softmax, argmax, gather and comparisons; only the rows are batched).
"""

from __future__ import annotations

import torch

__all__ = ["first_masked", "stop_hits", "sub_block_index", "sub_block_step", "top_p_sample"]


def top_p_sample(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The official sampler on sub-block logits ``[..., S, V]``: ``(tokens [..., S], probabilities [..., S, V])``.

    Temperature 0: ``softmax`` then its argmax (any leading dims). Else (``[S, V]`` only: one row's draws)
    ``softmax(logits / T)``, the smallest set of most probable tokens whose cumulative mass exceeds ``top_p`` kept
    (the crossing token included), renormalised by its sum, and one ``multinomial`` draw per position (in the logits'
    dtype, as officially).
    """
    if float(temperature) <= 0.0:
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(dim=-1), probs
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0)  # the official ``probs[drop] = 0`` without a boolean index (no host read)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0], probs


def first_masked(masked: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: the first ``True`` column of each row of ``masked`` ``[B, L]`` (``L`` when none)."""
    length = int(masked.shape[1])
    cols = torch.arange(length, device=masked.device)
    return torch.where(masked, cols, length).amin(dim=1)


def sub_block_index(masked: torch.Tensor, small: int) -> torch.Tensor:
    """``[B, S]`` block-relative columns of each row's current sub-block (the first one holding a mask: the official
    ``nonzero()[0] // S * S``), ``masked`` ``[B, L]``; a row without a mask gets the last sub-block (its step is
    dropped, the columns only keep the gather in range)."""
    length = int(masked.shape[1])
    start = (first_masked(masked) // small * small).clamp(max=length - small)
    return start[:, None] + torch.arange(small, device=masked.device)


def stop_hits(region: torch.Tensor, masked: torch.Tensor, generated: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether each row's first stop token among its generated block columns has no mask before it.

    Args:
        region: ``[B, L]`` the block's tokens; masked: ``[B, L]`` its masks; generated: ``[B, L]`` the columns past
            the row's prompt (the official test starts there: the head of a block is generated, the prompt is not).
        stops: ``[K]`` the stop ids.
    """
    hit = torch.isin(region, stops) & generated
    first = first_masked(hit)
    cols = torch.arange(int(region.shape[1]), device=region.device)
    mask_before = (masked & generated & (cols[None, :] < first[:, None])).any(dim=1)
    return hit.any(dim=1) & ~mask_before


def sub_block_step(cur: torch.Tensor, logits: torch.Tensor, mask_id: int, active: torch.Tensor, small: int,
                   threshold: float, temperature: float, top_p: float, generator: torch.Generator | None,
                   sampled_rows: list[int]) -> torch.Tensor:
    """One denoising step on every row's current sub-block: returns the block ``cur`` ``[B, L]`` after it.

    Args:
        cur: ``[B, L]`` the block's tokens (``mask_id`` where masked).
        logits: ``[B, L, V]`` shifted block logits (index ``i`` predicts block column ``i``).
        active: ``[B]`` bool, the rows that step (a mask left, not stopped, no stop reached); the others keep
            their tokens.
        small: the sub-block length ``S``; threshold: a masked position whose probability is ``> threshold`` is
            unmasked, and the most probable masked one always is.
        temperature, top_p, generator: the official sampler (:func:`top_p_sample`).
        sampled_rows: at ``temperature > 0``, the active rows on the host in row order: each draws from
            ``generator`` on its own sub-block, as officially (one ``multinomial`` per row, so the draws are the
            row's own); at temperature 0 nothing is drawn and the step is one program over the rows.
    """
    masked = cur == mask_id
    index = sub_block_index(masked, small)  # [B, S]
    vocab = int(logits.shape[-1])
    # each row's sub-block logits [B, S, V] by a device gather: the values the official slice logits[a:c] holds
    sub_logits = logits.gather(1, index[:, :, None].expand(-1, -1, vocab))
    if float(temperature) <= 0.0:
        tokens, probs = top_p_sample(sub_logits, 0.0, top_p, None)
        conf = torch.gather(probs, -1, tokens[..., None])[..., 0]
    else:
        tokens = torch.zeros(index.shape, dtype=torch.long, device=cur.device)
        conf = torch.zeros(index.shape, dtype=logits.dtype, device=cur.device)
        for r in sampled_rows:
            row_tokens, row_probs = top_p_sample(sub_logits[r], temperature, top_p, generator)
            tokens[r] = row_tokens
            conf[r] = torch.gather(row_probs, -1, row_tokens[:, None])[:, 0]
    sub_masked = masked.gather(1, index)
    conf = torch.where(sub_masked, conf, -torch.inf)
    take = (conf > threshold).scatter(1, conf.argmax(dim=1, keepdim=True), True)  # the most confident always
    take &= sub_masked & active[:, None]
    return cur.scatter(1, index, torch.where(take, tokens, cur.gather(1, index)))
