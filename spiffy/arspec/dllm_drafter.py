"""A standalone diffusion LM as the drafter of an AR target (DEER, SpecDiff-2): :class:`DLLMDrafter`.

The drafter shares the target's tokenizer and is conditioned on the committed tokens only
(``q(y_i | x_1..j)``). It keeps a K/V cache of exactly the committed prefix. Each round runs ONE forward over

    [tokens committed since the last round ; root ; MASK x depth]     at positions C .. root_position + depth

with the mask: a committed row sees the cache and the committed rows up to itself (causal, so its K/V describe
the prefix and never change again); the draft rows (root and masks) see the cache, every committed row and each
other (bidirectional inside the drafted block, as a block-diffusion block). The committed rows' K/V are appended
to the cache and the draft rows' are cropped away, so the cache never holds drafted positions (nothing to roll
back). This is the layout SDAR decodes with (a clean prefix in the cache, one bidirectional block being
denoised); the drafted block here starts at the root instead of an aligned block boundary, and the prefix K/V are
causal rather than block-causal (a pretrained SDAR sees a small shift; drafters trained by
:mod:`spiffy.train.d2a` are trained on exactly this layout).

That is the ``"root"`` layout (drafters trained by :mod:`spiffy.train.d2a`). The ``"aligned"`` layout (the default
for a plain SDAR checkpoint) uses SDAR's own attention instead: blocks of ``attention_block`` positions aligned to
absolute positions, bidirectional inside a block and causal across blocks (:func:`spiffy.models.sdar.block_causal_mask`).
The cache then holds only the committed blocks that are complete; each round runs ``[committed tokens of the
current block ; root ; MASK x depth]`` and the drafted masks of the root's block are exactly SDAR's decoding state
(clean block prefix, masked rest). Masks beyond that block see the masks before them, which SDAR never trains on:
they are weaker drafts.

Which logits predict which position: SDAR and LLaDA are unshifted (the row at position ``p`` predicts the token
at ``p``), so the mask rows ``root_position + 1 .. root_position + depth`` give the ``[depth, V]`` distributions;
Dream is shifted (the row at ``p - 1`` predicts ``p``), so the rows ``root_position .. root_position + depth - 1``
do (the family fact ``shifted_logits`` decides).

With ``denoise_steps > 1`` the block is denoised in a few steps: each step fixes the ``ceil(depth / steps)`` most
confident still-masked positions (equal confidences: the lower position first) to their argmax and re-runs the block
(reading the cache only); a position's distribution is the one of the step that fixed it. One step (the default)
gives the position-wise marginals DEER and SpecDiff-2 draft from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from spiffy.arspec.drafter import (
    ContextUpdate,
    DFlash2Drafter,
    DFlashDrafter,
    Drafter,
    append_rows,
    new_rows,
    stack_caches,
)
from spiffy.errors import ConfigError
from spiffy.models.ar_drafters import check_dllm_compatible, dllm_drafter_settings
from spiffy.models.cache import KVCache
from spiffy.models.dflash import DFlashDraftModel
from spiffy.models.dflash2 import DFlash2DraftModel
from spiffy.models.sdar import block_causal_mask
from spiffy.torch_utils import device_tensor, execution_device, model_device

__all__ = ["DLLMDrafter", "DraftPass", "as_drafter", "drafter_block_mask"]


def drafter_block_mask(n_committed: int, n_block: int, cache_len: int, device: torch.device | str) -> torch.Tensor:
    """``[1, 1, n + b, C + n + b]`` bool visibility (True = visible) of one drafting forward.

    Rows ``0..n-1`` (newly committed tokens) are causal over ``[cache ; committed]``; rows ``n..n+b-1`` (root and
    masks) see every key.
    """
    rows = n_committed + n_block
    total = cache_len + rows
    q = torch.arange(rows, device=device)[:, None] + cache_len
    k = torch.arange(total, device=device)[None, :]
    visible = k <= q
    visible[n_committed:, :] = True
    return visible[None, None]


@dataclass(frozen=True)
class DraftPass:
    """One row's drafting forward: ``ids`` at positions ``start ..`` (``start`` = cached positions) under ``mask``
    ``[1, 1, Q, start + Q]`` (True = visible); afterwards the cache keeps positions ``[0, keep)``, and logits rows
    ``first .. first + depth - 1`` are the ``[depth, V]`` draft."""

    ids: list[int]
    start: int
    mask: torch.Tensor
    keep: int
    first: int
    depth: int


class DLLMDrafter:
    """:class:`~spiffy.arspec.drafter.BatchDrafter` for a dLLM checkpoint (SDAR, LLaDA or Dream model of spiffy).

    Args:
        model: the loaded dLLM (``spiffy.models.load_ar_drafter`` / ``load_model``).
        block_size: drafted block length including the root (default: ``drafter_config.block_size`` or 16).
        denoise_steps: denoising forwards per draft (1 = one pass, position-wise marginals).
    """

    kind = "dllm"

    def __init__(self, model: nn.Module, block_size: int | None = None, denoise_steps: int = 1) -> None:
        settings = dllm_drafter_settings(model)
        self.model = model
        self.block_size = int(block_size if block_size is not None else settings.block_size)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if int(denoise_steps) < 1:
            raise ConfigError(f"denoise_steps must be >= 1, got {denoise_steps}")
        self.denoise_steps = int(denoise_steps)
        self.mask_token_id = settings.mask_token_id
        self.shifted = settings.shifted
        self.layout = settings.layout
        self.attention_block = settings.attention_block
        self._num_layers = int(model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers")
                               else model.config.n_layers)
        self._cache: KVCache | None = None
        self._pending: list[int] = []
        self._next_position = 0
        self._device = model_device(model)

    def check(self, target: nn.Module) -> None:
        """Raise :class:`~spiffy.errors.DrafterMismatchError` unless the drafter fits ``target``."""
        check_dllm_compatible(self.model, target)

    def attach(self, target: nn.Module) -> None:
        self.check(target)
        device = execution_device(target.get_input_embeddings())  # its weight may be offloaded (device_map)
        if self._device != device:
            raise ConfigError(
                f"the drafter is on {self._device} but the target on {device}; "
                "fix: load the drafter on the device of the target's input embedding (load_ar_drafter(..., device=...))"
            )
        self._cache = KVCache(self._num_layers)
        self._pending = []
        self._next_position = 0

    def commit(self, update: ContextUpdate) -> None:
        """Queue the committed tokens; their K/V are computed by the next :meth:`propose` (fused with the draft)."""
        if self._cache is None:
            raise RuntimeError("DLLMDrafter.commit before attach()")
        if int(update.start) != self._next_position:
            raise RuntimeError(f"non-contiguous commit: expected position {self._next_position}, got {update.start}")
        self._pending.extend(int(t) for t in update.tokens)
        self._next_position += len(update.tokens)

    def _forward(self, ids: list[int], start: int, mask: torch.Tensor, policy: str) -> torch.Tensor:
        x = device_tensor([ids], torch.long, self._device)
        pos = torch.arange(start, start + len(ids), device=self._device).view(1, -1)
        out = self.model(x, attention_mask=mask, position_ids=pos, past_key_values=self._cache, cache_policy=policy)
        return out.logits[0]

    def draft_pass(self, root_token: int, root_position: int, depth: int) -> DraftPass:
        """The first drafting forward of a round, as data (``propose`` runs it; a batched round shares it)."""
        if self._cache is None:
            raise RuntimeError("DLLMDrafter.propose before attach()")
        cached = self._cache.get_seq_length()
        n = len(self._pending)
        if cached + n != int(root_position):
            raise RuntimeError(f"the root at {root_position} does not follow the committed context ({cached + n})")
        block = [int(root_token)] + [self.mask_token_id] * int(depth)
        if self.layout == "aligned":
            mask = block_causal_mask(n + len(block), self.attention_block, start=cached, device=self._device)
            keep = (int(root_position) // self.attention_block) * self.attention_block  # complete committed blocks
        else:
            mask = drafter_block_mask(n, len(block), cached, self._device)
            keep = cached + n
        first = n if self.shifted else n + 1
        return DraftPass(self._pending + block, cached, mask, keep, first, int(depth))

    def absorb(self, step: DraftPass, keys: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> None:
        """After ``step`` ran in a forward shared with other rows: append the kept committed rows' K/V (per layer
        ``[1, H, keep - start, D]``) to the cache and drop them from the pending tokens, as :meth:`propose` does."""
        assert self._cache is not None, "absorb before attach()"
        append_rows(self._cache, keys, values)
        self._pending = self._pending[step.keep - step.start :]

    def batch_key(self) -> Hashable | None:
        """Rows of one model with one layout share a forward when they denoise in one step."""
        if self.denoise_steps != 1:
            return None
        return (id(self.model), self.layout, self.attention_block, self.shifted)

    @classmethod
    def propose_batch(cls, drafters: Sequence["DLLMDrafter"], roots: Sequence[tuple[int, int]],
                      depths: Sequence[int]) -> list[torch.Tensor]:
        """One dLLM forward over ``[cached prefix ; newly committed tokens ; root, MASK x depth]`` of every row."""
        passes = [d.draft_pass(tok, pos, depth) for d, (tok, pos), depth in zip(drafters, roots, depths)]
        first = drafters[0]
        dev = first._device
        b = len(drafters)
        cache, lengths, width_cache = stack_caches([d._cache for d in drafters], first._num_layers)  # type: ignore[misc]
        width = max(len(p.ids) for p in passes)
        ids = torch.full((b, width), first.mask_token_id, dtype=torch.long, device=dev)
        positions = torch.zeros((b, width), dtype=torch.long, device=dev)
        # padding queries see only themselves (their outputs are discarded); every padding key is hidden
        visible = torch.eye(width, dtype=torch.bool, device=dev)
        visible = torch.cat([torch.zeros((width, width_cache), dtype=torch.bool, device=dev), visible], dim=1)
        visible = visible[None].repeat(b, 1, 1)
        for r, p in enumerate(passes):
            q = len(p.ids)
            ids[r, :q] = device_tensor(p.ids, torch.long, dev)
            positions[r] = p.start + torch.arange(width, device=dev)
            own = p.mask[0, 0].to(dev)  # [q, start + q]
            visible[r, :q, width_cache - lengths[r] : width_cache] = own[:, : p.start]
            visible[r, :q, width_cache : width_cache + q] = own[:, p.start :]
        logits = first.model(ids, attention_mask=visible[:, None], position_ids=positions, past_key_values=cache,
                             cache_policy="append").logits
        out = []
        for r, (d, p) in enumerate(zip(drafters, passes)):
            d.absorb(p, *new_rows(cache, width_cache, r, p.keep - p.start))
            out.append(logits[r, p.first : p.first + p.depth])
        return out

    def propose(self, root_token: int, root_position: int, depth: int) -> torch.Tensor:
        """``[depth, V]`` logits for positions ``root_position + 1 .. root_position + depth`` (one forward, or
        ``denoise_steps``)."""
        step = self.draft_pass(root_token, root_position, depth)
        logits = self._forward(step.ids, step.start, step.mask, "append")
        self._cache.crop(step.keep)  # type: ignore[union-attr]  # committed rows only (aligned: complete blocks)
        self._pending = self._pending[step.keep - step.start :]
        out = logits[step.first : step.first + depth]
        if self.denoise_steps > 1 and depth > 1:
            out = self._denoise(step.ids[len(step.ids) - depth - 1 :], root_position, out.clone())
        return out

    def _denoise(self, block: list[int], root_position: int, first: torch.Tensor) -> torch.Tensor:
        """Further steps: fix the most confident masked positions, re-run the block on the (read-only) cache."""
        depth = first.shape[0]
        out = first
        fixed = torch.zeros(depth, dtype=torch.bool)
        per_step = -(-depth // self.denoise_steps)
        current = first
        cached = self._cache.get_seq_length()  # type: ignore[union-attr]
        tail = list(self._pending)  # aligned layout: committed rows of the current block, re-run with the block
        if self.layout == "aligned":
            mask = block_causal_mask(len(tail) + len(block), self.attention_block, start=cached, device=self._device)
        else:
            mask = drafter_block_mask(len(tail), len(block), cached, self._device)
        offset = len(tail)
        for _step in range(self.denoise_steps - 1):
            conf = torch.softmax(current.float(), dim=-1).max(dim=-1).values.cpu()
            conf[fixed] = -1.0
            # the most confident still-masked positions; equal confidences: the lower position first (the static
            # drafter's device twin ranks the same way)
            take = conf.sort(descending=True, stable=True).indices[: min(per_step, int((~fixed).sum()))]
            for i in take.tolist():
                fixed[i] = True
                out[i] = current[i]
                block[i + 1] = int(current[i].argmax())
            if bool(fixed.all()):
                break
            logits = self._forward(tail + block, root_position - offset, mask, "read")
            start = offset + (0 if self.shifted else 1)
            current = logits[start : start + depth]
        out[~fixed] = current[~fixed]
        return out

    def detach(self) -> None:
        self._cache = None
        self._pending = []


def as_drafter(model: Any, block_size: int | None = None) -> Drafter:
    """Wrap a loaded drafter model in its :class:`~spiffy.arspec.Drafter`: DFlash2 -> :class:`DFlash2Drafter`,
    DFlash -> :class:`DFlashDrafter`, a dLLM -> :class:`DLLMDrafter`; an object that already is a drafter is returned
    unchanged."""
    if isinstance(model, DFlash2DraftModel):
        return DFlash2Drafter(model, block_size)
    if isinstance(model, DFlashDraftModel):
        return DFlashDrafter(model, block_size)
    if isinstance(model, nn.Module):
        return DLLMDrafter(model, block_size)
    if isinstance(model, Drafter):
        return model
    raise ConfigError(f"cannot draft with a {type(model).__name__}; fix: pass a DFlash drafter or a dLLM model")
