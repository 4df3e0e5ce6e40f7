"""Test oracle: Fast-dLLM v2's official per-step rule restated row by row on the host (``batch_sample`` in NVlabs/
Fast-dLLM ``v2/generation_functions.py``, the checkpoints' ``generate``), without the decoder's machinery.

For one row ``x`` ``[T]`` and its block ``[s, e)``:

* the current sub-block is the first one of length ``S`` holding a mask: ``a = nonzero(x[s:e] == mask)[0] // S * S``;
* the step reads the shifted block logits of that sub-block, ``logits[a : a + S]`` ``[S, V]``: temperature 0 takes
  ``argmax(softmax(logits))``; else ``softmax(logits / T)``, top-p filtered (the crossing token kept: the official
  ``probs[drop] = 0``), renormalised, one ``multinomial`` draw per position (one call per row: the row's draws);
* a masked position whose probability is ``> threshold`` is unmasked, and the most probable masked one always is;
* stop: the row's first stop token of the block past its prompt, ``x[max(s, gen_start) : e]``, with no mask before
  it, ends the row (the block is not stepped again, the row's generation ends with it).

The head of a block (the previous commit's argmax) is placed by the decoder's first step; it is restated here too.
"""

from __future__ import annotations

import torch


def official_sample(logits: torch.Tensor, temperature: float, top_p: float,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The official sampler on ``[S, V]`` logits: ``(tokens [S], probabilities [S, V])``."""
    if temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(dim=-1), probs
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    drop_sorted = cumulative > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, drop_sorted)
    probs[drop] = 0
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0], probs


def reference_stop_hit(x: torch.Tensor, s: int, e: int, gen_start: int, mask_id: int,
                       stop_ids: tuple[int, ...]) -> bool:
    """Whether row ``x`` ``[T]``'s first stop token in ``[max(s, gen_start), e)`` has no mask before it."""
    if not stop_ids:
        return False
    region = x[max(s, gen_start) : e]
    hits = torch.isin(region, torch.tensor(stop_ids)).nonzero()
    return hits.numel() > 0 and not bool((region[: int(hits[0, 0])] == mask_id).any())


def reference_step(x: torch.Tensor, logits: torch.Tensor, s: int, e: int, mask_id: int, small: int, threshold: float,
                   temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One denoising step of row ``x`` ``[T]`` on its block's shifted logits ``[e - s, V]``: the new row."""
    out = x.clone()
    masked = (x[s:e] == mask_id).nonzero()
    if masked.numel() == 0:
        return out
    a = int(masked[0, 0]) // small * small
    c = a + small
    tokens, probs = official_sample(logits[a:c], temperature, top_p, generator)
    sub_masked = x[s + a : s + c] == mask_id
    conf = torch.gather(probs, -1, tokens[:, None])[:, 0]
    conf = torch.where(sub_masked, conf, -torch.inf)
    take = conf > threshold
    take[conf.argmax()] = True
    take &= sub_masked
    out[s + a : s + c] = torch.where(take, tokens, x[s + a : s + c])
    return out


def reference_head(x: torch.Tensor, logits: torch.Tensor, s: int, mask_id: int) -> torch.Tensor:
    """The block's head on row ``x`` ``[T]``: the argmax of the commit's last logits ``[V]`` where ``x[s]`` is
    masked."""
    out = x.clone()
    if int(x[s]) == mask_id:
        out[s] = logits.argmax()
    return out
