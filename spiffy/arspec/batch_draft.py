"""One drafter forward for every row of a batched AR speculative round (:mod:`spiffy.arspec.batch`).

Rows whose drafters share one model are drafted together in one forward: :class:`~spiffy.arspec.DFlashDrafter` rows
of one DFlash model (without sliding-window layers), and :class:`~spiffy.arspec.DLLMDrafter` rows of one dLLM with
one denoising step. Any other row (a custom drafter, a model of its own, several denoising steps) proposes alone.

Each row's drafter keeps its own context cache, exactly what it holds when the prompt is decoded alone. For the
shared forward, the rows' caches are stacked into one batch cache, left padded to the longest (per layer
``[B, H, C_max, D]``); each row's new rows (DFlash: new context features and the block ``[root, MASK x depth]``;
dLLM: the newly committed tokens and the block) are padded on the right to the longest. One boolean mask hides
every padding key from every row, so each row attends to exactly its own keys and computes what it computes alone
(float rounding aside: tests compare tokens, rounds and acceptance in float64). Afterwards each row's new context
K/V are appended to its own cache. Stacking the caches copies ``rows x context`` K/V per round; a persistent
batched drafter cache would avoid that copy but has not been needed at the sizes measured here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spiffy.arspec.dllm_drafter import DLLMDrafter, DraftPass
from spiffy.arspec.drafter import DFlashDrafter, Drafter
from spiffy.models.cache import KVCache
from spiffy.models.dflash import DFlashDraftModel

__all__ = ["draft_rows"]


def draft_rows(
    drafters: Sequence[Drafter | None], roots: Sequence[tuple[int, int]], depths: Sequence[int]
) -> list[torch.Tensor | None]:
    """Every row's ``[depth, V]`` draft logits (``None``: no drafter or nothing to draft), with one forward per
    group of rows sharing a drafter model.

    Args:
        drafters: one drafter per row (``None``: plain AR).
        roots: ``(root token, root position)`` per row.
        depths: positions to draft after each root.
    """
    out: list[torch.Tensor | None] = [None] * len(drafters)
    groups: dict[tuple, list[int]] = {}
    for i, (d, depth) in enumerate(zip(drafters, depths)):
        if d is None or depth <= 0:
            continue
        groups.setdefault(_group(d, i), []).append(i)
    for key, rows in groups.items():
        if len(rows) == 1 or key[0] == "alone":
            for i in rows:
                out[i] = drafters[i].propose(roots[i][0], roots[i][1], int(depths[i]))  # type: ignore[union-attr]
        elif key[0] == "dflash":
            logits = _dflash_rows([drafters[i] for i in rows], [roots[i] for i in rows], [int(depths[i]) for i in rows])  # type: ignore[misc]
            for i, lg in zip(rows, logits):
                out[i] = lg
        else:
            logits = _dllm_rows([drafters[i] for i in rows], [roots[i] for i in rows], [int(depths[i]) for i in rows])  # type: ignore[misc]
            for i, lg in zip(rows, logits):
                out[i] = lg
    return out


def _group(d: Drafter, row: int) -> tuple:
    """Rows with equal keys share a drafting forward."""
    if isinstance(d, DFlashDrafter):
        model = d.model
        plain = type(model).forward is DFlashDraftModel.forward and type(model).compute_logits is DFlashDraftModel.compute_logits
        if plain and not any(model.sliding_layers):  # the sliding-window mask assumes one unpadded row
            return ("dflash", id(model))
    elif isinstance(d, DLLMDrafter) and d.denoise_steps == 1:
        return ("dllm", id(d.model), d.layout, d.attention_block, d.shifted)
    return ("alone", row)


def _stack_caches(caches: Sequence[KVCache], num_layers: int) -> tuple[KVCache, list[int], int]:
    """One batch cache of the rows' caches, left padded; returns it, each row's length and the padded length."""
    lengths = [c.get_seq_length() for c in caches]
    width = max(lengths)
    batched = KVCache(num_layers)
    if width == 0:
        return batched, lengths, 0
    ref = next(c for c, n in zip(caches, lengths) if n > 0)
    for layer in range(num_layers):
        k0, v0 = ref.layer(layer)
        assert k0 is not None and v0 is not None
        keys = k0.new_zeros((len(caches), k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((len(caches), v0.shape[1], width, v0.shape[3]))
        for r, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                k, v = c.layer(layer)
                keys[r, :, width - n :] = k[0]  # type: ignore[index]
                values[r, :, width - n :] = v[0]  # type: ignore[index]
        batched.keys[layer], batched.values[layer] = keys, values
    return batched, lengths, width


def _new_rows(cache: KVCache, start: int, row: int, count: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Row ``row``'s K/V of batch-cache positions ``[start, start + count)``, per layer ``[1, H, count, D]``."""
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for k, v in zip(cache.keys, cache.values):
        if k is None or v is None or count == 0:
            keys.append(None)
            values.append(None)
        else:
            keys.append(k[row : row + 1, :, start : start + count])
            values.append(v[row : row + 1, :, start : start + count])
    return keys, values


def _dflash_rows(drafters: Sequence[DFlashDrafter], roots: Sequence[tuple[int, int]], depths: Sequence[int]) -> list[torch.Tensor]:
    """One DFlash forward over ``[cached context ; new context ; root, MASK x depth]`` of every row."""
    model = drafters[0].model
    inputs = [d.batch_inputs() for d in drafters]
    embed, head = inputs[0][2], inputs[0][3]
    dev = model.device
    b = len(drafters)
    n_ctx = [int(p.shape[1]) for p, _c, _e, _h in inputs]
    width_ctx = max(n_ctx)
    blocks = [depth + 1 for depth in depths]
    width_blk = max(blocks)
    feats = inputs[0][0].new_zeros((b, width_ctx, inputs[0][0].shape[-1]))
    ids = torch.full((b, width_blk), model.mask_token_id, dtype=torch.long, device=dev)
    positions = torch.zeros((b, width_ctx + width_blk), dtype=torch.long, device=dev)
    ramp = torch.arange(width_blk, device=dev)
    for r, ((pending, _c, _e, _h), (tok, pos)) in enumerate(zip(inputs, roots)):
        n = n_ctx[r]
        feats[r, :n] = pending[0]
        ids[r, 0] = int(tok)
        positions[r, :n] = torch.arange(pos - n, pos, device=dev)
        positions[r, width_ctx:] = pos + ramp
    cache, lengths, width_cache = _stack_caches([c for _p, c, _e, _h in inputs], model.num_layers)
    keys = torch.arange(width_cache + width_ctx + width_blk, device=dev)
    visible = torch.zeros((b, keys.numel()), dtype=torch.bool, device=dev)
    for r in range(b):
        visible[r, width_cache - lengths[r] : width_cache] = True
        visible[r, width_cache : width_cache + n_ctx[r]] = True
        visible[r, width_cache + width_ctx : width_cache + width_ctx + blocks[r]] = True
    hidden = model(feats, embed(ids), positions, past_key_values=cache, attention_mask=visible[:, None, None, :])
    out = []
    for r, d in enumerate(drafters):
        d.batch_absorb(*_new_rows(cache, width_cache, r, n_ctx[r]))
        out.append(model.compute_logits(hidden[r, 1 : blocks[r]], head))
    return out


def _dllm_rows(drafters: Sequence[DLLMDrafter], roots: Sequence[tuple[int, int]], depths: Sequence[int]) -> list[torch.Tensor]:
    """One dLLM forward over ``[cached prefix ; newly committed tokens ; root, MASK x depth]`` of every row."""
    passes: list[DraftPass] = [d.draft_pass(tok, pos, depth) for d, (tok, pos), depth in zip(drafters, roots, depths)]
    first = drafters[0]
    dev = first._device
    b = len(drafters)
    cache, lengths, width_cache = _stack_caches([d._cache for d in drafters], first._num_layers)  # type: ignore[misc]
    width = max(len(p.ids) for p in passes)
    ids = torch.full((b, width), first.mask_token_id, dtype=torch.long, device=dev)
    positions = torch.zeros((b, width), dtype=torch.long, device=dev)
    # padding queries see only themselves (their outputs are discarded); every padding key is hidden
    visible = torch.eye(width, dtype=torch.bool, device=dev)
    visible = torch.cat([torch.zeros((width, width_cache), dtype=torch.bool, device=dev), visible], dim=1)
    visible = visible[None].repeat(b, 1, 1)
    for r, p in enumerate(passes):
        q = len(p.ids)
        ids[r, :q] = torch.tensor(p.ids, dtype=torch.long, device=dev)
        positions[r] = p.start + torch.arange(width, device=dev)
        own = p.mask[0, 0].to(dev)  # [q, start + q]
        visible[r, :q, width_cache - lengths[r] : width_cache] = own[:, : p.start]
        visible[r, :q, width_cache : width_cache + q] = own[:, p.start :]
    logits = first.model(ids, attention_mask=visible[:, None], position_ids=positions, past_key_values=cache,
                         cache_policy="append").logits
    out = []
    for r, (d, p) in enumerate(zip(drafters, passes)):
        d.absorb(p, *_new_rows(cache, width_cache, r, p.keep - p.start))
        out.append(logits[r, p.first : p.first + p.depth])
    return out
