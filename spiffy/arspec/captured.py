"""The captured path of the AR loop (``compile=True``): the target's verification and plain-AR steps on a static
K/V cache with static shapes per bucket, and rounds that stay on the device.

:class:`StaticTarget` holds, for one target, a :class:`~spiffy.capture.SlotCache` of ``rows x slots`` and the
static input buffers of a round (ids, positions ``[rows, W]``; parents, depths ``[rows, W - 1]``; node counts), and
one step per bucket ``(rows, width, depth)`` in a :class:`~spiffy.capture.StepGraphs` (a CUDA graph on a GPU, the
same static code eagerly on a CPU). A smaller tree is padded to its bucket with nodes that see only the root and
themselves and are never accepted. The step reads the device-side context length ``ctx``: it writes the round's
rows at slots ``ctx .. ctx + width - 1`` and builds the mask (committed slots of the row, then the tree's ancestor
block) on the device. Static targets are kept per target model and reused across prompts and calls while their
cache is large enough, so a bucket is captured once.

The rounds of a generation run on it through :class:`~spiffy.arspec.captured_rounds.CapturedRounds`; the round after
its tree is one step here (:meth:`StaticTarget.walk_round`, :mod:`spiffy.arspec.captured_walk`).

A hybrid target (Qwen3.5, Qwen3-Next) runs here too: its Gated-DeltaNet layers keep their committed state per row in
a :class:`~spiffy.arspec.captured_recurrent.StaticRecurrent`, whose mixers the verification step runs over every
column's root path from that state, and whose commit re-advances it over the accepted path (inside the fused round;
a round walked on the host commits in a bucket of its own, ``("commit", rows, span)``; both static: no host read).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from spiffy.arspec.captured_recurrent import StaticRecurrent
from spiffy.arspec.captured_trees import TreePlan, draft_length, tree_program
from spiffy.arspec.captured_walk import WalkInputs, WalkPlan, bucket_groups, packed_walk, walk_program
from spiffy.arspec.device_rejection import Proposals, SamplingGroups
from spiffy.arspec.device_tree import ancestor_visibility
from spiffy.arspec.selector import Draft, SelectorDraft
from spiffy.arspec.stages import prefill_inputs
from spiffy.capture import SlotCache, StatefulStep, StepGraphs, slot_cache_supported
from spiffy.models.cache import hf_cache
from spiffy.models.dflash import TargetFeatureHooks
from spiffy.torch_utils import device_tensor, execution_device, on_device

__all__ = ["SLOT_ROUNDING", "StaticTarget", "static_target_of", "static_unsupported"]

#: slot counts are rounded up to a multiple of this (a later prompt of about the same length reuses the cache)
SLOT_ROUNDING = 256

#: the static targets of live models (one per target; replaced when a call needs more rows or slots)
_STATIC: "weakref.WeakKeyDictionary[nn.Module, StaticTarget]" = weakref.WeakKeyDictionary()


def static_target_of(target: nn.Module) -> "StaticTarget | None":
    """The static target ``target``'s captured calls run on now (its buckets, capture times), if any."""
    return _STATIC.get(target)


def static_unsupported(target: nn.Module, capture: bool = False) -> str | None:
    """``None`` when ``target`` runs on the captured path, else why not (layer kinds other than full and linear
    attention, a sliding window, an attention implementation that takes no 4-D mask, layers spread over several
    devices; with ``capture`` on CUDA, a mixture of experts run by transformers' ``"eager"`` experts, whose loop
    over the experts chosen reads them back: a CUDA graph cannot hold it)."""
    why = _eager_experts(target) if capture and execution_device(target.get_input_embeddings()).type == "cuda" else None
    if why is not None:
        return why
    why = slot_cache_supported(target.config)
    if why is not None:
        return why
    impl = str(getattr(target.config, "_attn_implementation", None) or "")
    if "flash" in impl:
        return f"attn_implementation={impl!r} takes no tree mask"
    if len({p.device for p in target.parameters()}) > 1:
        return "the target is spread over several devices"
    return None


def _eager_experts(target: nn.Module) -> str | None:
    """Why a CUDA graph cannot hold ``target``'s mixture of experts (transformers' ``"eager"`` experts), or ``None``."""
    experts = str(getattr(target.config, "_experts_implementation", None) or "")
    moe = any(int(getattr(target.config, name, 0) or 0) > 0 for name in ("num_experts", "num_local_experts"))
    if moe and experts == "eager":
        return ("experts_implementation='eager' loops over the experts chosen on the host (a target loaded with "
                "experts_implementation='grouped_mm', transformers' default outside float64, can be captured)")
    return None


class StaticTarget:
    """A target's static cache, round buffers and captured steps (see the module docstring)."""

    def __init__(self, target: nn.Module, rows: int, slots: int, width: int, capture: bool,
                 fuse: bool = False) -> None:
        self.target = target
        self.backbone, self.lm_head = target.model, target.lm_head
        embed = target.get_input_embeddings()
        self.device, self.dtype = execution_device(embed), embed.weight.dtype
        self.rows, self.slots, self.width = int(rows), int(slots), int(width)
        self.cache = SlotCache(target.config, rows, slots, self.dtype, self.device)
        dev = self.device
        self.ctx = torch.zeros(1, dtype=torch.long, device=dev)  # committed columns (the same for every row)
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=dev)  # [rows, slots] committed and visible
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self.parents = torch.full((rows, max(width - 1, 0)), -1, dtype=torch.long, device=dev)
        self.depths = torch.ones(rows, max(width - 1, 0), dtype=torch.long, device=dev)
        self.counts = torch.zeros(rows, dtype=torch.long, device=dev)
        self.ramp = torch.arange(max(width, slots), device=dev)
        self.graphs = StepGraphs(self._step, dev, capture, fuse, unrecordable=_eager_experts(target))
        self._inputs: dict[tuple, dict[str, torch.Tensor]] = {}  # static input buffers per bucket (walk, drafts)
        self.hooks: TargetFeatureHooks | None = None  # the layers drafters read, recorded by the captured step
        # a hybrid's recurrent layers: their committed state per row, verified and advanced in static steps
        self.recurrent = StaticRecurrent.for_target(target, self.cache, rows, width)

    @classmethod
    def for_target(cls, target: nn.Module, rows: int, slots: int, width: int, capture: bool, fuse: bool = False
                   ) -> "StaticTarget":
        """The target's static target if it holds ``rows x slots`` and rounds of ``width`` (and is not more than
        twice the slots needed: attention reads every slot) with the same capture and fuse settings, else a new one
        (replacing it)."""
        slots = -(-int(slots) // SLOT_ROUNDING) * SLOT_ROUNDING
        have = _STATIC.get(target)
        if (have is not None and have.rows >= rows and slots <= have.slots <= 2 * slots and have.width >= width
                and have.graphs.capture == (capture and have.device.type == "cuda") and have.graphs.fuse == fuse):
            return have
        if have is not None:
            have.release()
        made = _STATIC[target] = cls(target, rows, slots, width, capture, fuse)
        return made

    def release(self) -> None:
        self.graphs.clear()
        self._inputs.clear()
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    def record_layers(self, layer_ids: Sequence[int]) -> None:
        """Make the captured step record the outputs of target layers ``layer_ids`` (a DFlash drafter's features):
        hooks do not fire on a replayed graph, so the step's own hooks hold the replayed outputs."""
        have = set(self.hooks.layer_ids) if self.hooks is not None else set()
        if set(layer_ids) <= have:
            return
        if self.hooks is not None:
            self.hooks.remove()
        self.hooks = TargetFeatureHooks(self.target, sorted(have | set(layer_ids)))
        self.graphs.clear()  # steps captured without these hooks would not refresh them
        self._inputs.clear()

    def share_features(self, drafter_hooks: Sequence[TargetFeatureHooks]) -> None:
        """Hand the latest verification's layer outputs to the drafters' hooks (as if theirs had fired)."""
        if self.hooks is not None:
            for h in drafter_hooks:
                h._out.update({i: self.hooks._out[i] for i in h.layer_ids if i in self.hooks._out})

    def _step(self, key: Any) -> Any:
        if key[0] == "commit":  # a hybrid's recurrent commit, ("commit", rows, span)
            assert self.recurrent is not None
            return self.recurrent.commit_step(key[1], key[2])
        if key[0] == "round":  # ("round", rows, width, depth, plan, inputs' signature): verify + walk + commit
            return self._round_step(key)
        if key[0] == "tree":  # ("tree", rows, width, tree plan, draft dtype): every row's tree from its draft
            return self._tree_step(key)
        return self._verify_step(*key)

    def _hook_outputs(self) -> dict[int, torch.Tensor]:
        """What the recording hooks saw in the step running now, by layer."""
        return {} if self.hooks is None else dict(self.hooks._out)

    def _hold_features(self, features: dict[int, torch.Tensor]) -> None:
        """Point the recording hooks at the outputs of the step that just ran. A replay runs no hook: the tensors
        the hooks saw when a bucket was recorded are that bucket's (its graph writes them at each replay), while
        the hooks themselves last fired for whichever bucket was recorded last, maybe another one."""
        if self.hooks is not None:
            self.hooks._out.update(features)

    def _verify_step(self, rows: int, width: int, depth: int
                     ) -> Callable[[], tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        slots = self.cache.slots[:width]
        nodes = width - 1
        block = torch.zeros(rows, width, width, dtype=torch.bool, device=self.device)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        hidden_value = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)

        def step() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            slots.copy_(self.ctx + self.ramp[:width])
            block[:, :, 0] = True  # every row sees the root
            if nodes:
                block[:, 1:, 1:] = ancestor_visibility(self.parents[:rows, :nodes], depth)
            visible = self.valid[:rows].unsqueeze(1).expand(rows, width, self.slots).clone()
            visible.index_copy_(2, slots, block)
            mask = torch.where(visible, zero, hidden_value).unsqueeze(1)
            with self._recurrent_verify(rows, width, depth):
                out = self.backbone(input_ids=self.ids[:rows, :width], position_ids=self.positions[:rows, :width],
                                    attention_mask=mask, use_cache=True, **hf_cache(self.cache))
            return out.last_hidden_state, self._hook_outputs()

        return step

    def _recurrent_verify(self, rows: int, width: int, depth: int) -> ContextManager[None]:
        if self.recurrent is None:
            return nullcontext()
        return self.recurrent.verify(rows, width, depth, self.parents, self.depths)

    def _round_step(self, key: tuple) -> StatefulStep:
        """The fused round (:mod:`spiffy.arspec.captured_walk`): ``(keep [rows, D + 1], accepted [rows], packed)``."""
        _kind, rows, width, depth, plan, _signature = key
        verify = self._verify_step(rows, width, depth)
        inputs = WalkInputs(**self._inputs[key])
        groups = bucket_groups(plan, self.device)

        def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
            hidden, features = verify()
            return (*self._walk_and_commit(hidden, rows, width, depth, plan, inputs, groups), features)

        span = max(width, depth + 1)  # the verification writes `width` slots, the commit moves `depth + 1`

        def save() -> Callable[[], None]:
            # what the round writes: its window's K/V slots, their validity, the context length
            ctx, cols = self.ctx.clone(), self.ctx + self.ramp[:span]
            kv = [(t, t[:rows].index_select(2, cols)) for t in self.cache.tensors()]
            valid = self.valid[:rows].index_select(1, cols)
            recurrent = None if self.recurrent is None else self.recurrent.save(rows)  # a hybrid's committed state

            def restore() -> None:
                for t, saved in kv:
                    t[:rows].index_copy_(2, cols, saved)
                self.valid[:rows].index_copy_(1, cols, valid)
                self.ctx.copy_(ctx)
                if recurrent is not None:
                    recurrent()
            return restore

        return StatefulStep(step, save)

    def walk_round(self, rows: int, width: int, depth: int, plan: WalkPlan, inputs: WalkInputs
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verify the filled round, walk it by ``plan`` and commit it: ``(keep [rows, D + 1], accepted [rows],
        packed)`` (:func:`~spiffy.arspec.captured_walk.packed_walk`): one bucket's step (``inputs`` copied into its
        static buffers first), a hybrid's recurrent commit included."""
        key = ("round", int(rows), int(width), int(depth), plan, inputs.signature())
        self._load(key, inputs.named())
        keep, accepted, packed, features = self.graphs.run(key)
        self._hold_features(features)
        return keep, accepted, packed

    def _walk_and_commit(self, hidden: torch.Tensor, rows: int, width: int, depth: int, plan: WalkPlan,
                         inputs: WalkInputs, groups: SamplingGroups | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The walk of the verified rows (``hidden [rows, width, H]``) and its commit (inside the round's step: a
        hybrid's recurrent commit runs inline): keep, accepted, packed."""
        nodes = width - 1
        walk = walk_program(plan, self.lm_head(hidden), self.ids[:rows, :width], self.parents[:rows, :nodes],
                            self.depths[:rows, :nodes], self.counts[:rows], depth, inputs, groups)
        if self.recurrent is not None:  # before ctx moves; the state after each row's accepted path
            self.recurrent.commit_inline(rows, width, walk.keep, walk.accepted)
        self._commit_window(rows, walk.keep, walk.accepted)
        return walk.keep, walk.accepted, packed_walk(walk, self.counts[:rows])

    def _tree_step(self, key: tuple) -> Callable[[], None]:
        _kind, rows, width, plan, _dtypes = key
        buffers = self._inputs[key]
        proposals = _tree_proposals(buffers)
        selector = (SelectorDraft(buffers["candidates"], buffers["first"], buffers["following"], 0)
                    if plan.candidates else None)

        def step() -> None:
            tree_program(plan, buffers.get("drafts"), buffers["lengths"], self.ids[:rows, :width],
                         self.parents[:rows, : width - 1], self.depths[:rows, : width - 1], self.counts[:rows],
                         self.positions[:rows, :width], buffers.get("uniforms"), proposals, selector,
                         buffers.get("races"))
        return step

    def build_trees(self, rows: int, width: int, plan: TreePlan, drafts: Sequence[Draft | None],
                    uniforms: torch.Tensor | None = None, races: torch.Tensor | None = None) -> Proposals | None:
        """Every row's tree (``plan``) from its draft (logits ``[depth, V]``, or DFlash2's
        :class:`~spiffy.arspec.selector.SelectorDraft`) into the round buffers, in one bucket's step
        (:func:`~spiffy.arspec.captured_trees.tree_program`): the drafts, their lengths (and a sampled row's host
        ``uniforms`` ``[rows, L, K]``, :func:`~spiffy.arspec.captured_trees.tree_uniforms`, or a DFlash2 sampled
        row's ``races`` ``[rows, n, L, K]``, :func:`~spiffy.arspec.captured_trees.tree_races`) copied into its static
        buffers first (the roots' tokens and positions are already in column 0). Returns the bucket's proposal
        buffers when a row samples its drafts (what the rejection walk reads), else ``None``."""
        logits = next((d for d in drafts if isinstance(d, torch.Tensor)), None)
        scores = next((d for d in drafts if isinstance(d, SelectorDraft)), None)
        dtypes = (None if logits is None else logits.dtype, None if scores is None else scores.first.dtype)
        key = ("tree", int(rows), int(width), plan, dtypes)
        buffers = self._inputs.get(key)
        if buffers is None:
            buffers = self._inputs[key] = self._tree_buffers(rows, width, plan, logits, scores)
        for b, draft in enumerate(drafts):
            if isinstance(draft, SelectorDraft):
                depth = draft.depth
                buffers["candidates"][b, :depth].copy_(draft.candidates)
                buffers["first"][b].copy_(draft.first)
                buffers["following"][b, : max(depth - 1, 0)].copy_(draft.following)
            elif draft is not None:
                buffers["drafts"][b, : draft.shape[0]].copy_(draft)
        lengths = [draft_length(d) for d in drafts]
        buffers["lengths"].copy_(on_device(torch.tensor(lengths, dtype=torch.long), self.device))
        for name, host in (("uniforms", uniforms), ("races", races)):
            if name in buffers:
                assert host is not None, f"a tree bucket with sampled rows needs its {name}"
                buffers[name].copy_(on_device(host, self.device))
        self.graphs.run(key)
        return _tree_proposals(buffers)

    def _tree_buffers(self, rows: int, width: int, plan: TreePlan, logits: torch.Tensor | None,
                      scores: SelectorDraft | None) -> dict[str, torch.Tensor]:
        """A tree bucket's static buffers: the draft lengths ``[rows]``; with rows of logits, the drafts
        ``[rows, L, V]``; with a sampled row, its uniforms ``[rows, L, K]`` (drafts of logits) or races ``[rows, n,
        L, K]`` (DFlash2) and the proposals it writes (draws ``[rows, width, K]``, ``q [rows, plan.q_rows, V]``,
        ``q_row``); with DFlash2 rows, their candidates ``[rows, L, K]`` and scores (first ``[rows, K]``, following
        ``[rows, L - 1, K, K]``)."""
        dev, depth = self.device, plan.depth
        out = {"lengths": torch.zeros(rows, dtype=torch.long, device=dev)}
        if logits is not None:
            out["drafts"] = torch.zeros(rows, depth, int(logits.shape[-1]), dtype=logits.dtype, device=dev)
        if plan.drafts_of("sampled"):
            out["uniforms"] = torch.zeros(rows, depth, plan.drafts_of("sampled"), dtype=torch.float64, device=dev)
        if plan.drafts_of("selector_sampled"):
            out["races"] = torch.zeros(rows, plan.drafts_of("selector_sampled"), depth, plan.candidates,
                                       dtype=torch.float64, device=dev)
        if plan.draws:
            assert logits is not None or scores is not None
            vocab = int(logits.shape[-1]) if logits is not None else int(scores.vocab_size)  # type: ignore[union-attr]
            out["draws"] = torch.full((rows, width, plan.draws), -1, dtype=torch.long, device=dev)
            out["q"] = torch.zeros(rows, plan.q_rows, vocab, dtype=torch.float64, device=dev)
            out["q_row"] = torch.zeros(rows, width, dtype=torch.long, device=dev)
        if scores is not None:
            k = plan.candidates
            out["candidates"] = torch.zeros(rows, depth, k, dtype=torch.long, device=dev)
            out["first"] = torch.zeros(rows, k, dtype=scores.first.dtype, device=dev)
            out["following"] = torch.zeros(rows, max(depth - 1, 0), k, k, dtype=scores.following.dtype, device=dev)
        return out

    def _load(self, key: tuple, tensors: dict[str, torch.Tensor]) -> None:
        """``tensors`` copied into bucket ``key``'s static input buffers (made on first use)."""
        buffers = self._inputs.get(key)
        if buffers is None:
            buffers = self._inputs[key] = {name: torch.empty_like(t) for name, t in tensors.items()}
        for name, t in tensors.items():
            buffers[name].copy_(t)

    def verify(self, rows: int, width: int, depth: int) -> torch.Tensor:
        """The bucket's step on the filled buffers: ``[rows, width, H]`` hidden states (their K/V written at
        slots ``ctx ..``; a hybrid's recurrent layers read their committed state and leave it as it was)."""
        out, features = self.graphs.run((int(rows), int(width), int(depth)))
        self._hold_features(features)
        if self.recurrent is not None:
            self.recurrent.verified(int(width))
        return out

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Left-padded prompts into the empty cache (eager: one call per prompt set); ``[B, V]`` logits of each
        row's first new token and the pads."""
        ids, positions, mask, valid, pads = prefill_inputs(prompts, self.device, self.dtype)
        rows, width = int(ids.shape[0]), int(ids.shape[1])
        if mask is None:
            mask = torch.triu(torch.full((width, width), torch.finfo(self.dtype).min, dtype=self.dtype,
                                         device=self.device), diagonal=1).expand(rows, 1, width, width)
        full = torch.full((rows, 1, width, self.slots), torch.finfo(self.dtype).min, dtype=self.dtype,
                          device=self.device)
        full[..., :width] = mask
        self.cache.slots[:width].copy_(self.ramp[:width])
        self.valid.zero_()
        self.valid[:rows, :width] = valid
        self.ctx.fill_(width)

        def forward() -> Any:
            return self.backbone(input_ids=ids, position_ids=positions, attention_mask=full, use_cache=True,
                                 **hf_cache(self.cache))

        if self.recurrent is None:
            out = forward()
        else:  # each row's real tokens alone through the recurrent layers (left padding never enters a state)
            out = self.recurrent.prefill([range(pad, width) for pad in pads], forward,
                                         int(self.target.config.hidden_size), self.dtype)
        return self.lm_head(out.last_hidden_state[:, -1]), pads

    def commit(self, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """Move each row's kept verification rows (``keep [rows, W]``, root first; ``accepted [rows]``: kept
        nodes) to the front of the round's window, mark them valid (shorter rows leave holes) and advance ``ctx``
        by the longest (device tensors only)."""
        if self.recurrent is not None:  # before ctx moves; the state after each row's accepted path
            self.recurrent.commit(self.graphs, rows, keep, accepted)
        self._commit_window(rows, keep, accepted)

    def _commit_window(self, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """:meth:`commit`'s K/V, validity and context length (the attention layers' part)."""
        width = int(keep.shape[1])
        self.cache.move_window(self.ctx, keep, rows)
        cols = self.ctx + self.ramp[:width]
        self.valid[:rows].index_copy_(1, cols, self.ramp[:width].view(1, -1) <= accepted.view(-1, 1))
        self.ctx.add_(accepted.max() + 1)

    def keep_rows(self, kept: Sequence[int]) -> None:
        """Only batch rows ``kept`` go on (moved to the front, in order)."""
        self.cache.keep_rows(kept)
        if self.recurrent is not None:
            self.recurrent.keep_rows(kept)
        idx = device_tensor(list(kept), torch.long, self.device)
        self.valid[: len(kept)] = self.valid.index_select(0, idx)


def _tree_proposals(buffers: dict[str, torch.Tensor]) -> Proposals | None:
    """The proposals a tree bucket's sampled rows write (its draws, ``q`` and ``q_row`` buffers), else ``None``."""
    return Proposals(buffers["draws"], buffers["q"], buffers["q_row"]) if "draws" in buffers else None
