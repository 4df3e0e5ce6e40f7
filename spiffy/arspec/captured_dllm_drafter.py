"""The dLLM drafter's round forward on the captured path (``compile=True``): static buffers, one step per bucket.

:class:`StaticDLLMDrafter` is to a :class:`~spiffy.arspec.dllm_drafter.DLLMDrafter` (DEER, SpecDiff-2,
``ddtree-dllm``) what :class:`~spiffy.arspec.captured_drafter.StaticDrafter` is to a DFlash drafter. The eager drafter
keeps a K/V cache of exactly the committed prefix and runs one forward per round over
``[tokens committed since the last round ; root ; MASK x depth]``; here the same forward runs on buffers allocated
once:

* the context cache: a :class:`~spiffy.capture.SlotCache` of ``rows x slots`` (one per drafter layer), seen by the
  model through :class:`_SlotKV` (the :class:`~spiffy.models.cache.KVCache` face the dLLM families' ``attend`` calls:
  ``get_seq_length`` / ``layer`` / ``append`` under the ``"append"`` cache policy), so the models run unchanged;
* ``lengths [rows]``: the committed rows each row's cache holds (row ``b``'s prefix at slots ``0 .. lengths[b] - 1``,
  in order, as the eager drafter's cache holds it: a device-side length per row);
* ``tokens [rows, slots]`` / ``counts [rows]``: every committed token at its position (a round's commit, root +
  accepted nodes, is gathered on the device from the verification's ids by the walk's kept rows and written after
  the last one, :meth:`StaticDLLMDrafter.stage`) and how many of them follow the cached rows;
* ``ids [rows, B]``: the block ``[root, MASK x (B - 1)]``; ``depths [rows]``: the positions each row drafts.

The step of bucket ``(rows, L)`` (a :class:`~spiffy.capture.StepGraphs` step: a CUDA graph on a GPU, the same static
code eagerly on a CPU) is the model's own forward over the ``N + L`` queries ``[context (N columns of ``tokens`` from
``lengths[b]``, ``counts[b]`` real) ; block (L columns, ``depths[b] + 1`` real)]`` at positions ``lengths[b] + j`` and
``root + i`` (root = ``lengths + counts``: every committed token precedes it) with keys ``[cache (every slot) ; the N +
L new rows]`` and a ``[rows, 1, N + L, slots + N + L]`` bool mask built on the device: a context row sees the row's
cached slots and the real context rows up to itself (causal: its K/V describe the prefix and never change), a block row
sees the cached slots, the real context rows and the block rows ``0 .. depths[b]`` (bidirectional inside the drafted
block: the ``"root"`` layout). Each real query therefore attends over exactly the keys the eager forward of its row
sees, in another order (padded with hidden keys): the draft logits agree to rounding, the tokens exactly. The new rows'
K/V are written at slots ``lengths[b] ..`` (:meth:`~spiffy.capture.SlotCache.scatter`, per row); only the first
``counts[b]`` become visible, when ``lengths`` advances by ``counts`` after the step (outside it: the suite's rehearsal
of a capture runs the step twice), so the drafted rows are never seen again (the eager drafter crops them).
Nothing of the step is read from the host. Its output is ``[rows, L - 1, V]``: block rows ``1 .. L - 1`` (SDAR and
LLaDA: the row at ``p`` predicts ``p``) or ``0 .. L - 2`` (Dream, shifted); row ``b``'s draft is its first
``depths[b]``. ``L`` is one more than the generation's deepest draft, in every round (the shorter drafts of the
last rounds are masked to their own block rows, as for any row: one bucket, not one per draft length).

The prompt (hundreds of tokens, once per generation) does not fit the ``B``-column context: the first round runs the
same step program eagerly at the prompt's width, every later round replays the bucket. Unlike the eager loop, which
skips the drafter in a round where no row drafts, the static drafter runs every round (a round's draft also commits
the last round's tokens), so its context K/V are computed in other forwards: again equal to rounding.

That is the ``"root"`` layout (``N = B``: a round's context is the last commit). In the ``"aligned"`` layout (a
plain SDAR checkpoint's default: SDAR's own block-causal attention over blocks of ``A`` positions) the eager drafter
caches only the complete attention blocks before the root's: the committed rest of the root's block saw the drafted
masks, so it runs again with the next round's block. Here ``N = B + A - 1`` (fewer than ``A`` uncached tokens of the
root's block, then the last commit), every real key in the query's block or an earlier one is visible (``positions //
A``), and after the step ``lengths`` advances to the root's block start (``counts`` keeps the rest): the eager
drafter's crop, on the device.

With ``denoise_steps > 1`` the same step goes on with the eager drafter's further denoising steps, every row at once
(:meth:`StaticDLLMDrafter._denoised`: the positions each step fixes are ranked on the device, and the block re-runs
on the cache read only), so a round is still one replay.

Only :class:`~spiffy.arspec.dllm_drafter.DLLMDrafter` rows sharing one dLLM model of spiffy's families (SDAR,
LLaDA, Dream, and the MoE families LLaDA-MoE, SDAR-MoE, LLaDA2.0) and one step count run here
(:func:`static_dllm_drafter_model`). An MoE model's experts run grouped in the step (:mod:`spiffy.models.moe_dispatch`:
static shapes, bitwise the per-expert products); where they cannot (float64, quantized experts) a CUDA capture keeps
the eager drafter, and on a CPU they run one by one inside the static code. Subclassed drafters keep the eager
drafter.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from spiffy.arspec.captured_drafter import StaticBlockDrafter
from spiffy.arspec.dllm_drafter import DLLMDrafter
from spiffy.capture import SlotCache, StepGraphs, slot_cache_supported
from spiffy.models.cache import KVCache
from spiffy.models.moe_dispatch import capture_unsupported, grouped_experts, stack_experts
from spiffy.models.pretrained import SpiffyForwardMixin
from spiffy.torch_utils import execution_device, on_device

__all__ = ["StaticDLLMDrafter", "static_dllm_drafter", "static_dllm_drafter_model", "static_dllm_drafter_of"]

#: slot counts are rounded up to a multiple of this (a later prompt of about the same length reuses the cache)
SLOT_ROUNDING = 256

#: the static drafters of live dLLM models (one per model; replaced when a call needs more rows or slots)
_STATIC: "weakref.WeakKeyDictionary[nn.Module, StaticDLLMDrafter]" = weakref.WeakKeyDictionary()


def static_dllm_drafter_of(model: nn.Module) -> "StaticDLLMDrafter | None":
    """The static drafter ``model``'s captured calls run on now (its buckets, capture times), if any."""
    return _STATIC.get(model)


def static_dllm_drafter_model(drafters: Sequence[Any], target: nn.Module) -> nn.Module | None:
    """The one dLLM model every row drafts with, when the static drafter runs it (see the module docstring);
    ``None``: the rows keep their eager drafters."""
    if not drafters or any(type(d) is not DLLMDrafter for d in drafters):
        return None
    first = drafters[0]
    model = first.model
    if any(d.model is not model or d.denoise_steps != first.denoise_steps for d in drafters):
        return None
    if any(d.block_size != first.block_size or d.shifted != first.shifted or d.mask_token_id != first.mask_token_id
           or d.layout != first.layout or d.attention_block != first.attention_block for d in drafters):
        return None  # one block buffer, one read-out, one mask token and one layout for every row
    if not isinstance(model, SpiffyForwardMixin):
        return None  # spiffy's families only (their attention takes the slot cache as a KVCache)
    if slot_cache_supported(model.config) is not None or "flash" in str(
            getattr(model.config, "_attn_implementation", None) or ""):
        return None
    if first._device != execution_device(target.get_input_embeddings()):
        return None  # the eager drafter's attach names the mismatch
    return model


def static_dllm_drafter(drafters: Sequence[Any], target: nn.Module, prompts: Sequence[Sequence[int]],
                        max_new_tokens: int, capture: bool, fuse: bool = False) -> "StaticDLLMDrafter | None":
    """The rows' static dLLM drafter for one generation (emptied), or ``None`` when they keep the eager ones."""
    model = static_dllm_drafter_model(drafters, target)
    if model is None:
        return None
    first = drafters[0]
    if capture and first._device.type == "cuda" and capture_unsupported(model) is not None:
        return None  # MoE experts that cannot run grouped: their shapes are host values, which no graph holds
    block = int(first.block_size)
    # the committed prefix, then a round's context (the aligned layout's uncached part of the root's block too) and
    # block written after it (hidden, overwritten next round)
    need = max(len(p) for p in prompts) + int(max_new_tokens) + 2 * block + _aligned_block(first) + 1
    return StaticDLLMDrafter.for_model(model, first, len(prompts), -(-need // SLOT_ROUNDING) * SLOT_ROUNDING,
                                       block, capture, fuse)


def _aligned_block(drafter: DLLMDrafter) -> int:
    """The aligned layout's attention block ``A`` (``0``: the root layout)."""
    return int(drafter.attention_block) if drafter.layout == "aligned" else 0


class _SlotKV(KVCache):
    """A :class:`~spiffy.models.cache.KVCache` over a :class:`SlotCache` (the families take a KVCache, so the models
    run unchanged): ``layer`` gives every slot of the first ``rows`` rows (the mask hides the uncommitted ones),
    ``append`` writes the forward's new rows at each row's own slots ``index [rows, N + L]`` (``insert_at`` stays
    ``None``: new keys follow the cached ones, as :func:`spiffy.models.layers.attend` orders them)."""

    def __init__(self, cache: SlotCache, rows: int) -> None:
        super().__init__(len(cache.layers))  # its own per-layer lists stay empty: the slots hold the K/V
        self.cache, self.rows = cache, int(rows)
        self.index: torch.Tensor | None = None  # set by the step before the forward (a device tensor)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.max_slots

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layer_kv(layer_idx, self.rows)

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.index is not None
        self.cache.scatter(layer_idx, self.index, k, v)


class StaticDLLMDrafter(StaticBlockDrafter):
    """A dLLM drafter model's static context cache, round buffers and captured forwards (see the module docstring).

    Args:
        model: the dLLM; drafter: one of the rows' drafters (mask token, block, read-out convention);
        rows: batch rows; slots: context slots per row; block: the block ``B`` (root + the deepest draft, also the
        most tokens a round commits); capture: CUDA graphs on a GPU.
    """

    def __init__(self, model: nn.Module, drafter: DLLMDrafter, rows: int, slots: int, block: int,
                 capture: bool, fuse: bool = False) -> None:
        self.model = model
        embed = model.get_input_embeddings()
        self.device, dtype = execution_device(embed), embed.weight.dtype
        self.rows, self.slots, self.block = int(rows), int(slots), int(block)
        self.mask_token_id, self.shifted = int(drafter.mask_token_id), bool(drafter.shifted)
        stack_experts(model)  # an MoE model's experts as one tensor per projection (grouped in the step; no copy)
        self.aligned = _aligned_block(drafter)  # A (the aligned layout), or 0 (the root layout)
        self.denoise_steps = int(drafter.denoise_steps)
        # the committed tokens a round's forward runs: the root layout's last commit (at most B), or the aligned
        # layout's uncached tokens (fewer than A of the root's block, then the last commit)
        self.width = block + max(self.aligned - 1, 0)
        self.cache = SlotCache(model.config, rows, slots, dtype, self.device)
        dev = self.device
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # committed rows in the cache per row
        self.counts = torch.zeros(rows, dtype=torch.long, device=dev)  # committed tokens not in the cache per row
        self.tokens = torch.zeros(rows, slots, dtype=torch.long, device=dev)  # every committed token, by position
        self.ids = torch.full((rows, block), self.mask_token_id, dtype=torch.long, device=dev)
        self.depths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.ramp = torch.arange(slots + 2 * block + self.width, device=dev)
        self.graphs = StepGraphs(self._step, dev, capture, fuse, unrecordable=capture_unsupported(model))
        self._prompt: torch.Tensor | None = None  # the prompts [rows, P] until the first round drafts from them
        self._staged = False  # whether committed tokens wait for the next draft (it must be drafted from)

    @classmethod
    def for_model(cls, model: nn.Module, drafter: DLLMDrafter, rows: int, slots: int, block: int,
                  capture: bool, fuse: bool = False) -> "StaticDLLMDrafter":
        """The model's static drafter if it fits ``rows x slots`` and blocks of ``block`` (and holds at most twice
        the slots needed: attention reads every slot), else a new one (replacing it); emptied."""
        have = _STATIC.get(model)
        if not (have is not None and have.holds(rows, slots, block, capture, fuse)
                and have.mask_token_id == int(drafter.mask_token_id) and have.shifted == bool(drafter.shifted)
                and have.aligned == _aligned_block(drafter) and have.denoise_steps == int(drafter.denoise_steps)):
            if have is not None:
                have.graphs.clear()
            have = _STATIC[model] = cls(model, drafter, rows, slots, block, capture, fuse)
        return have.emptied()

    def _program(self, rows: int, context: torch.Tensor | None, block: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``block``-column block (``<= B``) of the first ``rows`` rows after the committed tokens
        not in the cache (``counts`` of them real: the prompts ``context [rows, P]`` for the first round; ``None``:
        a bucket's, the ``width`` tokens from each row's ``lengths`` in ``tokens``), as a zero-argument step
        returning the ``[rows, block - 1, V]`` draft logits."""
        width, ramp = (self.width if context is None else int(context.shape[1])), self.ramp
        kv = _SlotKV(self.cache, rows)
        first = width + (0 if self.shifted else 1)  # the logits row of the first drafted position
        slots, aligned = self.slots, self.aligned

        def step() -> torch.Tensor:
            n, length = self.counts[:rows].view(rows, 1), self.lengths[:rows].view(rows, 1)
            root = length + n  # the root's position: every committed token precedes it
            positions = torch.cat([length + ramp[:width], root + ramp[:block]], dim=1)  # [rows, N + L]
            kv.index = length + ramp[: width + block]  # after the row's cached rows (the step advances nothing)
            committed = context if context is not None else self.tokens[:rows].gather(
                1, (length + ramp[:width]).clamp(max=slots - 1))
            ids = torch.cat([committed, self.ids[:rows, :block]], dim=1)
            real = ramp[:width].view(1, 1, width) < n.view(rows, 1, 1)  # [rows, 1, N]: the row's real context keys
            cached = (ramp[:slots] < length).view(rows, 1, slots)  # [rows, 1, S]
            drafted = (ramp[:block] <= self.depths[:rows].view(rows, 1)).view(rows, 1, block)  # [rows, 1, L]
            if aligned:
                new = self._block_causal(torch.cat([real, drafted], dim=2), positions)
                visible = torch.cat([cached.expand(rows, width + block, slots), new], dim=2)
            else:
                # context rows: cache + real context keys up to themselves (causal); block rows: cache + real
                # context + the row's drafted block (bidirectional)
                q, k = ramp[:width].view(1, width, 1), ramp[:width].view(1, 1, width)
                ctx_rows = torch.cat([cached.expand(rows, width, slots), real & (k <= q),
                                      torch.zeros(rows, width, block, dtype=torch.bool, device=self.device)], dim=2)
                block_rows = torch.cat([cached, real, drafted], dim=2).expand(rows, block, slots + width + block)
                visible = torch.cat([ctx_rows, block_rows], dim=1)
            with grouped_experts():  # an MoE model's experts without host reads (a graph can hold them)
                # the mask: [rows, 1, N + L, S + N + L]
                logits = self.model(ids, attention_mask=visible.unsqueeze(1), position_ids=positions,
                                    past_key_values=kv, cache_policy="append", mask_all_visible=False).logits
            draft = logits[:, first : first + block - 1]
            return self._denoised(rows, block, root, draft, kv) if self.denoise_steps > 1 else draft

        return step

    def _block_causal(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``keys [rows, 1, K]`` narrowed to SDAR's block-causal attention over ``positions [rows, K]`` (queries and
        keys alike): a key in the query's attention block or an earlier one. ``[rows, K, K]``."""
        blocks = positions // self.aligned
        return keys & (blocks.unsqueeze(1) <= blocks.unsqueeze(2))

    def _cached_end(self, root: torch.Tensor) -> torch.Tensor:
        """Where the eager drafter crops its cache after drafting from ``root`` (a long tensor of root positions):
        at the root (the root layout: every committed row stays), or at the start of the root's attention block
        (the aligned layout: the rest of that block saw the drafted masks)."""
        return torch.div(root, self.aligned, rounding_mode="floor") * self.aligned if self.aligned else root

    def _denoised(self, rows: int, block: int, root: torch.Tensor, draft: torch.Tensor, kv: "_SlotKV"
                  ) -> torch.Tensor:
        """``denoise_steps - 1`` further steps of the eager drafter's ``_denoise`` on the device, every row at once.

        Each step ranks a row's still-masked drafted positions by confidence (the softmax maximum; equal: the lower
        position first), fixes the ``min(ceil(depth / steps), still masked)`` best to their argmax and re-runs the
        block (the cache as the eager drafter holds it after its crop, read only; the aligned layout's uncached rest
        of the root's attention block as queries again). Steps after every position is fixed select nothing (the
        eager loop stops there: the same result). ``root [rows, 1]``; ``draft [rows, L - 1, V]`` the first pass's
        logits. Returns ``[rows, L - 1, V]``: each position's logits of the step that fixed it (the last step's where
        none did), the first pass's for rows drafting one position (the eager drafter denoises deeper drafts only).
        ``kv``: the step's view of the slot cache (read only here).
        """
        steps, ramp, slots, span = self.denoise_steps, self.ramp, self.slots, block - 1
        depth = self.depths[:rows].view(rows, 1)
        real = ramp[:span].view(1, span) < depth  # [rows, L - 1]: the row's drafted positions
        per_step = torch.div(depth + steps - 1, steps, rounding_mode="floor")  # ceil(depth / steps)
        kept = self._cached_end(root)
        tail = max(self.aligned - 1, 0)  # the uncached committed tokens of the root's block (aligned layout)
        positions = torch.cat([kept + ramp[:tail], root + ramp[:block]], dim=1)  # [rows, T + L]
        keys = torch.cat([ramp[:tail].view(1, 1, tail) < (root - kept).view(rows, 1, 1),
                          (ramp[:block] <= depth).view(rows, 1, block)], dim=2)  # [rows, 1, T + L]
        if self.aligned:  # block-causal over positions, as the first pass
            keys = self._block_causal(keys, positions)
        visible = torch.cat([(ramp[:slots] < kept).view(rows, 1, slots).expand(rows, tail + block, slots),
                             keys.expand(rows, tail + block, tail + block)], dim=2).unsqueeze(1)
        tail_ids = self.tokens[:rows].gather(1, (kept + ramp[:tail]).clamp(max=slots - 1))
        ids = self.ids[:rows, :block].clone()
        start = tail + (0 if self.shifted else 1)
        fixed = torch.zeros(rows, span, dtype=torch.bool, device=self.device)
        out = current = draft
        for _step in range(steps - 1):
            conf = torch.softmax(current.float(), dim=-1).amax(dim=-1).masked_fill(fixed | ~real, -1.0)
            order = conf.sort(dim=-1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, ramp[:span].expand(rows, span))
            take = rank < torch.minimum(per_step, depth - fixed.sum(dim=-1, keepdim=True))
            fixed = fixed | take
            out = torch.where(take.unsqueeze(-1), current, out)
            ids[:, 1:] = torch.where(take, current.argmax(dim=-1), ids[:, 1:])
            with grouped_experts():
                logits = self.model(torch.cat([tail_ids, ids], dim=1), attention_mask=visible, position_ids=positions,
                                    past_key_values=kv, cache_policy="read", mask_all_visible=False).logits
            current = logits[:, start : start + span]
        return torch.where((depth > 1).view(rows, 1, 1), torch.where(fixed.unsqueeze(-1), out, current), draft)

    def _step(self, key: Any) -> Callable[[], torch.Tensor]:
        rows, block = key
        return self._program(rows, None, block)

    def _advance(self, rows: int) -> None:
        """After a draft the cache holds the committed rows up to :meth:`_cached_end` (the root layout: all of them;
        the aligned layout: the rest of the root's block is run again with the next block); ``counts`` keeps the
        rest."""
        root = self.lengths[:rows] + self.counts[:rows]
        kept = self._cached_end(root)
        self.counts[:rows] = root - kept
        self.lengths[:rows] = kept

    def stage_prompt(self, prompts: Sequence[Sequence[int]]) -> None:
        """The prompts (row ``b``'s tokens at positions ``0 ..``) as the first round's committed tokens."""
        rows, width = len(prompts), max(len(p) for p in prompts)
        packed = torch.tensor([[len(p)] + list(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long)
        packed = on_device(packed, self.device)  # one copy
        self._prompt = packed[:, 1:]
        self.tokens[:rows, :width] = self._prompt
        self.lengths[:rows].zero_()
        self.counts[:rows].copy_(packed[:, 0])
        self._staged = True

    def stage(self, ids: torch.Tensor, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """A round's committed tokens as the next draft's context: ``ids [rows, W]`` the verification's tokens
        (root first), ``keep [rows, K]`` each row's kept rows (root first; padding any index), ``accepted [rows]``
        the kept nodes (so ``accepted + 1`` tokens are committed). Device tensors only: no host value is read."""
        rows, kept = int(keep.shape[0]), int(keep.shape[1])
        if self._staged:
            raise RuntimeError("StaticDLLMDrafter.stage before the staged tokens were drafted from")
        if kept > self.block:
            raise RuntimeError(f"{kept} committed rows exceed the drafter's block of {self.block}")
        root = self.lengths[:rows] + self.counts[:rows]  # where the commit starts (after the uncached tokens)
        # the kept rows' tokens at their positions (the padding's land after the commit: hidden, overwritten later)
        at = (root.view(rows, 1) + self.ramp[:kept]).clamp(max=self.slots - 1)
        self.tokens[:rows].scatter_(1, at, ids.gather(1, keep.clamp(0, int(ids.shape[1]) - 1)))
        self.counts[:rows].add_(accepted + 1)
        self._staged = True

    def _row_state(self) -> tuple[torch.Tensor, ...]:
        return self.lengths, self.counts, self.tokens

    def stage_first(self, target: Any, prompts: Sequence[Sequence[int]], pads: Sequence[int]) -> None:
        """The prompts' tokens (:meth:`stage_prompt`)."""
        self.stage_prompt(prompts)

    def stage_round(self, target: Any, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """The kept rows' tokens, gathered on the device from ``target``'s verification ids (:meth:`stage`)."""
        self.stage(target.ids[:rows], keep, accepted)

