"""The DFlash drafter's block forward on the captured path (``compile=True``): static buffers, one step per bucket.

:class:`StaticDrafter` is to a :class:`~spiffy.models.dflash.DFlashDraftModel` what
:class:`~spiffy.arspec.captured.StaticTarget` is to the target (an SGLang-style runner): its context K/V live in a
:class:`~spiffy.capture.SlotCache` of ``rows x slots`` (one per drafter layer), and a round's inputs in buffers
allocated once:

* ``feats [rows, B, F]``: the target features (``F = len(target_layer_ids) x H``) of the rows the last round
  committed (root + accepted nodes, ``counts [rows]`` of them, at most the block ``B``), gathered on the device from
  the target step's recorded layer outputs by the walk's kept rows (:meth:`StaticDrafter.stage`);
* ``lengths [rows]``: the context rows each row's cache holds (a device-side length per row: row ``b``'s committed
  context sits at slots ``0 .. lengths[b] - 1``, in order, as the eager drafter's own cache holds it);
* ``ids [rows, B]``: the block ``[root, MASK x (B - 1)]``; ``depths [rows]``: the positions each row drafts.

The step of bucket ``(rows, L)`` (a :class:`~spiffy.capture.StepGraphs` step: captured once in a CUDA graph on a
GPU, the same static code run eagerly on a CPU) is the model's own forward over ``[cached context (every slot) ; new
context (B rows) ; block (L rows)]`` keys with a mask that shows row ``b`` its ``lengths[b]`` cached rows, its
``counts[b]`` new rows and its ``depths[b] + 1`` block rows, so each row attends over exactly the keys the eager
drafter's forward of that row sees, in the same order (padded with hidden keys, so the attention sums in another
order: the logits agree to rounding, the tokens exactly). ``L`` is one more than the generation's deepest draft, in
every round: a draft of the last rounds (it stops at ``max_new_tokens``) is shorter, and its row sees only its own
``depths[b] + 1`` block rows, the keys the eager drafter's shorter block has (a DFlash block is bidirectional), so
those rounds replay the same bucket instead of capturing (or, with ``compile="inductor"``, compiling) one per length.
The new context's K/V are written at slots ``lengths[b] ..`` (:meth:`~spiffy.capture.SlotCache.scatter`, per row), and
``lengths`` advances by ``counts`` after the step (which stays idempotent: the suite's rehearsal of a capture runs it
twice); the root's position is ``lengths + counts`` (every committed token precedes it), so nothing of the step is
read from the host. Its output is the block's ``[rows, L - 1, V]`` logits; row ``b``'s draft is its first
``depths[b]`` rows.

The prompt's features (hundreds of rows, once per generation) do not fit the ``B``-row bucket: the first round runs
the same step program eagerly over a context of the prompt's width, and every later round replays the bucket.

Causal and sliding-window layers see keys by position: the step hands the model each cached slot's position (slot
``j`` holds position ``j``, :meth:`~spiffy.models.dflash.DFlashDraftModel.forward`'s ``cached_positions``), so each
row's layers hide what its eager forward hides, and such drafters share the bucket's forward too.

A :class:`~spiffy.arspec.drafter.DFlash2Drafter` (``selector=True``) reads the block out through its candidate
selector inside the step: each row's top-``K`` candidates ranked without a host read
(:func:`~spiffy.topk.top_ranked_static`), its root token taken from the block buffer, and every transition score of
the round computed for all rows at once; a row's draft is a :class:`~spiffy.arspec.selector.SelectorDraft` of views
of the step's ``candidates [rows, L - 1, K]``, ``first [rows, K]`` and ``following [rows, L - 2, K, K]``, cut to its
depth (a selector's score at a depth reads that depth's row and the one before, never a deeper one).

Only rows of one drafter class sharing one plain model (the family's own ``forward``, ``compute_logits`` and
selector) run here; subclassed drafters keep the eager drafter (:func:`static_drafter_model` says which). The dLLM
drafters (DEER, SpecDiff-2, DDTree-dLLM) have their own static drafter, :mod:`spiffy.arspec.captured_dllm_drafter`
(the same design over the drafter's committed tokens).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from spiffy.arspec.drafter import DFlash2Drafter, DFlashDrafter
from spiffy.arspec.selector import Draft, SelectorDraft
from spiffy.capture import SlotCache, StepGraphs
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks
from spiffy.models.dflash2 import CandidateSelector
from spiffy.torch_utils import execution_device, on_device

__all__ = ["StaticBlockDrafter", "StaticDrafter", "recorded_features", "static_drafter_model", "static_drafter_of"]

#: the static drafters of live drafter models (one per model; replaced when a call needs more rows or slots)
_STATIC: "weakref.WeakKeyDictionary[nn.Module, StaticDrafter]" = weakref.WeakKeyDictionary()


def static_drafter_of(model: nn.Module) -> "StaticDrafter | None":
    """The static drafter ``model``'s captured calls run on now (its buckets, capture times), if any."""
    return _STATIC.get(model)


def static_drafter_model(drafters: Sequence[Any], target: nn.Module) -> DFlashDraftModel | None:
    """The one DFlash or DFlash2 model every row drafts with, when the static drafter runs it (see the module
    docstring); ``None``: the rows keep their eager drafters."""
    kind = type(drafters[0]) if drafters else None
    if kind not in (DFlashDrafter, DFlash2Drafter) or any(type(d) is not kind for d in drafters):
        return None
    model = drafters[0].model
    if any(d.model is not model for d in drafters) or drafters[0].batch_key() is None:
        return None  # rows of several models, or a subclassed forward, head or selector (it may read the host)
    if kind is DFlash2Drafter and type(model.candidate_selector).forward is not CandidateSelector.forward:
        return None  # the step scores every row at once through the family's own selector
    if model.device != execution_device(target.get_input_embeddings()):
        return None  # the eager drafter's attach names the mismatch
    return model


class _ContextSlots:
    """The face of a :class:`~spiffy.models.cache.KVCache` that :class:`~spiffy.models.dflash.DFlashAttention` uses,
    over a :class:`SlotCache`: ``layer`` gives every slot of the first ``rows`` rows (the mask hides the uncommitted
    ones), ``append`` writes the new context rows at each row's own slots ``index [rows, N]``."""

    def __init__(self, cache: SlotCache, rows: int) -> None:
        self.cache, self.rows = cache, int(rows)
        self.index: torch.Tensor | None = None  # set by the step before the forward (a device tensor)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layer_kv(layer_idx, self.rows)

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.index is not None
        self.cache.scatter(layer_idx, self.index, k, v)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.max_slots


class StaticBlockDrafter:
    """What the static drafters share (:class:`StaticDrafter`, and the dLLM drafters'
    :class:`~spiffy.arspec.captured_dllm_drafter.StaticDLLMDrafter`): a round's draft from the bucket's step (the
    first round's prompt-wide program run eagerly once), the per-row lengths advanced after it, and rows leaving the
    batch. A subclass holds ``cache`` (a :class:`~spiffy.capture.SlotCache`), ``graphs``, ``device``, its sizes
    ``rows``, ``slots``, ``block``, the round buffers ``ids [rows, B]``, ``depths``, ``lengths``, ``counts [rows]``,
    ``_prompt`` (the first round's staged context, or ``None``) and ``_staged``, and says in :meth:`_row_state` which
    per-row tensors follow the rows."""

    cache: SlotCache
    graphs: StepGraphs
    device: torch.device
    rows: int
    slots: int
    block: int
    ids: torch.Tensor
    depths: torch.Tensor
    lengths: torch.Tensor
    counts: torch.Tensor
    _prompt: torch.Tensor | None
    _staged: bool

    def _program(self, rows: int, context: torch.Tensor, block: int) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def _row_state(self) -> tuple[torch.Tensor, ...]:
        """The per-row tensors (first dimension: batch rows) that :meth:`keep_rows` reorders with the cache."""
        raise NotImplementedError

    def stage_first(self, target: Any, prompts: Sequence[Sequence[int]], pads: Sequence[int]) -> None:
        """Stage the first round's context from the static target ``target`` (a
        :class:`~spiffy.arspec.captured.StaticTarget`) right after its prefill of ``prompts`` (left ``pads``)."""
        raise NotImplementedError

    def stage_round(self, target: Any, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """Stage a round's committed rows (``keep [rows, K]`` root first, ``accepted [rows]``) as the next draft's
        context, from ``target``'s verification step (device tensors only)."""
        raise NotImplementedError

    def holds(self, rows: int, slots: int, block: int, capture: bool, fuse: bool = False) -> bool:
        """Whether this drafter serves a generation of ``rows x slots`` and blocks of ``block`` (holding at most twice
        the slots needed: attention reads every slot) with the same capture and fuse settings."""
        return (self.rows >= rows and slots <= self.slots <= 2 * slots and self.block == block
                and self.graphs.capture == (capture and self.device.type == "cuda") and self.graphs.fuse == fuse)

    def emptied(self) -> "StaticBlockDrafter":
        """This drafter with no context and nothing staged (a new generation starts), for chaining."""
        self.lengths.zero_()
        self.counts.zero_()
        self._prompt, self._staged = None, False
        return self

    def _row_draft(self, out: Any, row: int, depth: int) -> Draft:
        """Row ``row``'s draft of ``depth`` positions from the step's output (views): its ``[depth, V]`` logits."""
        return out[row, :depth]

    def draft(self, roots: Sequence[tuple[int, int]], depths: Sequence[int], block: int | None = None
              ) -> list[Draft | None]:
        """Every row's draft (:meth:`_row_draft`: ``[depth, V]`` logits, or a DFlash2 drafter's
        :class:`~spiffy.arspec.selector.SelectorDraft`; ``None`` where ``depths[b] == 0``), in one block forward that
        also commits the staged context (so it runs even when no row drafts). Returns views of the step's output:
        read them before the next draft.

        ``block``: the bucket's block (``1 +`` the deepest draft of the generation, so that the last rounds, whose
        drafts stop at ``max_new_tokens``, replay the same bucket instead of capturing, or compiling, one per
        depth); ``None``: ``1 +`` the deepest of these drafts. Either way each row's query sees exactly its own
        ``depths[b] + 1`` block rows (the step's mask), as the eager drafter's block of that length does (a block is
        bidirectional): the values agree to rounding, as every padded key of the step does."""
        rows = len(roots)
        deepest = 1 + max(int(d) for d in depths)
        block = deepest if block is None else int(block)
        if block < deepest:
            raise ValueError(f"a block of {block} cannot hold a draft of depth {deepest - 1}")
        meta = on_device(torch.tensor([[tok, d] for (tok, _pos), d in zip(roots, depths)], dtype=torch.long),
                         self.device)
        self.ids[:rows, 0] = meta[:, 0]
        self.depths[:rows] = meta[:, 1]
        if self._prompt is not None:  # the first round: the prompt-wide program, run eagerly once
            out = self._program(rows, self._prompt, block)()
            self._prompt = None
        else:
            out = self.graphs.run((rows, block))
        self._advance(rows)
        self._staged = False
        return [self._row_draft(out, b, int(d)) if d else None for b, d in enumerate(depths)]

    def _advance(self, rows: int) -> None:
        """After a draft: the new context is in the cache now (outside the step, which stays idempotent: the
        suite's rehearsal of a capture runs it twice)."""
        self.lengths[:rows].add_(self.counts[:rows])
        self.counts[:rows].zero_()

    def keep_rows(self, kept: Sequence[int]) -> None:
        """Only batch rows ``kept`` go on (moved to the front, in order)."""
        self.cache.keep_rows(kept)
        idx = on_device(torch.tensor(list(kept), dtype=torch.long), self.device)
        for t in self._row_state():
            t[: len(kept)] = t.index_select(0, idx)
        if self._prompt is not None:
            self._prompt = self._prompt.index_select(0, idx)



class StaticDrafter(StaticBlockDrafter):
    """A DFlash model's static context cache, block buffers and captured block forwards (see the module docstring).

    Args:
        model: the drafter; target: the target whose embeddings and head it borrows (and whose features it reads);
        rows: batch rows; slots: context slots per row (the prompt, every committed token and two blocks);
        block: the block ``B`` (root + the deepest draft); capture: CUDA graphs on a GPU; fuse: steps compiled by
        TorchInductor (:func:`spiffy.capture.compile_fuses`).
    """

    def __init__(self, model: DFlashDraftModel, target: nn.Module, rows: int, slots: int, block: int,
                 capture: bool, fuse: bool = False, selector: bool = False) -> None:
        self.model, self.target = model, target
        self.selector = bool(selector)  # read out through a DFlash2 model's candidate selector
        self.embed, self.head = target.get_input_embeddings(), target.lm_head
        self.device = model.device
        self.rows, self.slots, self.block = int(rows), int(slots), int(block)
        self.cache = SlotCache(model.config, rows, slots, model.dtype, self.device)
        width = len(model.target_layer_ids) * int(target.config.hidden_size)
        dev = self.device
        self.feats = torch.zeros(rows, block, width, dtype=self.embed.weight.dtype, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # committed context rows per row
        self.counts = torch.zeros(rows, dtype=torch.long, device=dev)  # staged new context rows per row
        self.ids = torch.full((rows, block), model.mask_token_id, dtype=torch.long, device=dev)
        self.depths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.ramp = torch.arange(max(slots, block), device=dev)
        self.vocab = int(model.config.vocab_size)  # a SelectorDraft's V, as the eager DFlash2 drafter reads it
        self.graphs = StepGraphs(self._step, dev, capture, fuse)
        self._prompt: torch.Tensor | None = None  # the prompt's features until the first round drafts from them
        self._staged = False  # whether a committed context waits for the next draft (it must be drafted from)

    @classmethod
    def for_model(cls, model: DFlashDraftModel, target: nn.Module, rows: int, slots: int, block: int,
                  capture: bool, fuse: bool = False, selector: bool = False) -> "StaticDrafter":
        """The model's static drafter if it fits ``rows x slots`` and blocks of ``block`` for ``target`` (and holds
        at most twice the slots needed: attention reads every slot) with the same read-out (``selector``: a DFlash2
        drafter's selector), else a new one (replacing it); emptied."""
        have = _STATIC.get(model)
        if not (have is not None and have.target is target and have.selector == selector
                and have.holds(rows, slots, block, capture, fuse)):
            if have is not None:
                have.graphs.clear()
            have = _STATIC[model] = cls(model, target, rows, slots, block, capture, fuse, selector)
        return have.emptied()

    def _program(self, rows: int, feats: torch.Tensor, block: int) -> Callable[[], Any]:
        """The forward of a ``block``-row block (``<= B``) of the first ``rows`` rows over new-context features
        ``feats [rows, N, F]`` (the static ``self.feats`` for a bucket, the prompt's for the first round), as a
        zero-argument step returning the read-out of the drafted block rows: their ``[rows, block - 1, V]`` logits,
        or a DFlash2 drafter's selector scores (:meth:`~spiffy.models.dflash2.CandidateSelector.forward` over the
        rows, each from its own root, ranked without a host read)."""
        width, ramp = int(feats.shape[1]), self.ramp
        slots = _ContextSlots(self.cache, rows)
        cached_positions = ramp[: self.slots].view(1, -1)  # slot j holds position j (what masked layers read)

        def step() -> Any:
            n, length = self.counts[:rows].view(rows, 1), self.lengths[:rows].view(rows, 1)
            root = length + n  # the root's position: every committed token precedes it
            positions = torch.cat([root - n + ramp[:width], root + ramp[:block]], dim=1)  # [rows, N + B]
            slots.index = length + ramp[:width]  # the new context after the row's committed rows
            # keys [cached (every slot) ; new context ; block]: the row's committed, new and drafted rows are seen
            visible = torch.cat([ramp[: self.slots] < length, ramp[:width] < n,
                                 ramp[:block] <= self.depths[:rows].view(rows, 1)], dim=1).view(rows, 1, 1, -1)
            hidden = self.model(feats, self.embed(self.ids[:rows, :block]), positions, past_key_values=slots,
                                attention_mask=visible, cached_positions=cached_positions)  # type: ignore[arg-type]
            if self.selector:
                roots = self.ids[:rows, 0]
                return self.model.select(hidden[:, 1:], self.head, roots, static=True)  # type: ignore[operator]
            return self.model.compute_logits(hidden[:, 1:], self.head)

        return step

    def _row_draft(self, out: Any, row: int, depth: int) -> Draft:
        if not self.selector:
            return super()._row_draft(out, row, depth)
        candidates, first, following = out
        return SelectorDraft(candidates[row, :depth], first[row], following[row, : depth - 1], self.vocab)

    def _step(self, key: Any) -> Callable[[], Any]:
        rows, block = key
        return self._program(rows, self.feats[:rows], block)

    def stage_prompt(self, features: torch.Tensor, pads: Sequence[int], lengths: Sequence[int]) -> None:
        """The prompts' features ``[rows, P, F]`` (left padded: row ``b``'s at columns ``pads[b] ..``, its
        ``lengths[b]`` tokens) as the first round's new context."""
        rows, width = len(pads), max(lengths)
        meta = on_device(torch.tensor([list(pads), list(lengths)], dtype=torch.long), self.device)
        index = (meta[0].view(rows, 1) + self.ramp[:width]).clamp(max=int(features.shape[1]) - 1)
        self._prompt = features.gather(1, index.unsqueeze(-1).expand(rows, width, int(features.shape[-1])))
        self.lengths[:rows].zero_()
        self.counts[:rows].copy_(meta[1])
        self._staged = True

    def stage(self, features: torch.Tensor, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """A round's committed rows as the next draft's new context: ``features [rows, W, F]`` of the verification
        rows, ``keep [rows, K]`` each row's kept rows (root first; padding any index), ``accepted [rows]`` the kept
        nodes (so ``accepted + 1`` rows are committed). Device tensors only: no host value is read."""
        rows, kept = int(keep.shape[0]), int(keep.shape[1])
        if self._staged:
            raise RuntimeError("StaticDrafter.stage before the staged context was drafted from")
        if kept > self.block:
            raise RuntimeError(f"{kept} committed rows exceed the drafter's block of {self.block}")
        index = keep.clamp(0, int(features.shape[1]) - 1).unsqueeze(-1).expand(rows, kept, int(features.shape[-1]))
        self.feats[:rows, :kept] = features.gather(1, index)
        self.counts[:rows].copy_(accepted + 1)
        self._staged = True

    def _row_state(self) -> tuple[torch.Tensor, ...]:
        return self.lengths, self.counts, self.feats

    def stage_first(self, target: Any, prompts: Sequence[Sequence[int]], pads: Sequence[int]) -> None:
        """The prompts' target features, recorded by ``target``'s prefill (:meth:`stage_prompt`)."""
        assert target.hooks is not None
        self.stage_prompt(recorded_features(target.hooks, self.model.target_layer_ids), pads, [len(p) for p in prompts])

    def stage_round(self, target: Any, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """The kept rows' target features, recorded by ``target``'s verification step (:meth:`stage`)."""
        assert target.hooks is not None
        self.stage(recorded_features(target.hooks, self.model.target_layer_ids), keep, accepted)


def recorded_features(hooks: TargetFeatureHooks, layer_ids: Sequence[int]) -> torch.Tensor:
    """``[rows, W, F]``: the latest target step's outputs of layers ``layer_ids`` (in order), concatenated (one
    device: a static target is never spread over several)."""
    return torch.cat([hooks._out[int(i)] for i in layer_ids], dim=-1)
