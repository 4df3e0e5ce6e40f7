"""The drafter interface of AR speculative decoding, and DFlash as its first implementation.

A drafter proposes, in one pass, a distribution for each of the next ``depth`` positions after the root (the
pending bonus token), conditioned on the committed context and whatever state it keeps. After each verification it
is told which tokens joined the committed context (:class:`ContextUpdate`).

Lifecycle within one generation (every generation is a batch; a drafter follows one row of it)::

    drafter.check(target)                        # raise DrafterMismatchError unless it fits the target
    drafter.attach(target)                       # before the prefill: bind to the target, fresh state
    drafter.commit(ContextUpdate(prompt...))     # after the prefill
    loop: logits = drafter.propose(root_token, root_position, depth)   # [depth, V]
          ... build, verify ...
          drafter.commit(ContextUpdate(root + accepted tokens ...))
    drafter.detach()                             # always (finally), or when its row leaves the batch

A drafter may also propose for several rows in ONE forward (:class:`BatchDrafter`): drafters whose
:meth:`~BatchDrafter.batch_key` agree share the forward of their class's :meth:`~BatchDrafter.propose_batch`, which
gives each row what it proposes alone. The stacked-cache helpers (:func:`stack_caches`, :func:`new_rows`) serve
those forwards: each row's drafter keeps its own context cache (what it holds when its prompt is decoded alone);
for the shared forward the caches are stacked, left padded to the longest (per layer ``[B, H, C_max, D]``), each
row's new rows padded on the right, and one boolean mask hides every padding key from every row (a DFlash drafter's
causal and sliding-window layers are told where each row's cached keys sit, so their masks over positions hold).

:class:`DFlashDrafter` conditions on target features (hidden states of chosen target layers, captured by
:class:`~spiffy.models.dflash.TargetFeatureHooks` during the target's own forwards; the update names the batch row).
A standalone drafter (a dLLM conditioned on the committed tokens: :class:`~spiffy.arspec.DLLMDrafter`) implements
the same methods from ``ContextUpdate.tokens`` alone and ignores ``target_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from spiffy.arspec.selector import Draft, SelectorDraft
from spiffy.errors import ConfigError
from spiffy.models.cache import KVCache
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks, check_compatible
from spiffy.models.dflash2 import DFlash2DraftModel
from spiffy.torch_utils import device_tensor, execution_device

__all__ = ["BatchDrafter", "ContextUpdate", "DFlash2Drafter", "Drafter", "DFlashDrafter", "append_rows", "new_rows",
           "stack_caches"]


@dataclass(frozen=True)
class ContextUpdate:
    """Tokens that have just joined the committed context (the target's K/V cache), in order.

    Attributes:
        tokens: the committed token ids (after the prefill: the prompt; after a round: root + accepted nodes).
        start: absolute position of ``tokens[0]``.
        target_rows: the rows of the latest target forward that computed these tokens, one per token (features
            of these rows describe the committed context; rows not listed belonged to rejected drafts).
        batch_row: the batch row of the latest target forward that holds this generation (0 for one prompt; rows
            are renumbered as finished ones leave the batch).
    """

    tokens: Sequence[int]
    start: int
    target_rows: Sequence[int]
    batch_row: int = 0


@runtime_checkable
class Drafter(Protocol):
    """Proposes per-position distributions for the next block in one pass.

    Attributes:
        block_size: drafted block length including the root token (at most ``block_size - 1`` positions drafted).
    """

    block_size: int

    def check(self, target: nn.Module) -> None:
        """Raise :class:`~spiffy.errors.DrafterMismatchError` unless the drafter fits ``target`` (called for every
        drafter given, even when the run drafts nothing)."""
        ...

    def attach(self, target: nn.Module) -> None:
        """Bind to ``target`` before its prefill and start from an empty context (raise on a mismatch)."""
        ...

    def propose(self, root_token: int, root_position: int, depth: int) -> Draft:
        """``[depth, V]`` logits: row ``d - 1`` is the drafter's distribution of the token at ``root_position + d``
        (or, for a drafter whose positions depend on each other, its own proposal object such as a DFlash2
        selector's :class:`~spiffy.arspec.selector.SelectorDraft`, which the methods build their drafts from).

        ``root_token`` (the pending bonus token at ``root_position``) is not yet in the committed context.
        """
        ...

    def commit(self, update: ContextUpdate) -> None:
        """Extend the context by ``update`` after a verification. This is also the rollback point: any state
        computed for drafted positions that were not accepted must be discarded here, so that afterwards the
        drafter describes exactly the committed context."""
        ...

    def detach(self) -> None:
        """Release what :meth:`attach` took (hooks, caches); called even when generation fails."""
        ...


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A :class:`Drafter` whose rows can share one drafting forward (the capability "proposes for a whole batch")."""

    def batch_key(self) -> Hashable | None:
        """Drafters of one class with equal keys share a forward; ``None``: this one proposes alone."""
        ...

    @classmethod
    def propose_batch(cls, drafters: Sequence["BatchDrafter"], roots: Sequence[tuple[int, int]],
                      depths: Sequence[int]) -> list[Draft]:
        """Each row's ``[depth, V]`` logits, in one forward, equal to what ``drafters[i].propose(*roots[i],
        depths[i])`` gives alone (each row's state advances as it would alone)."""
        ...


def stack_caches(caches: Sequence[KVCache], num_layers: int) -> tuple[KVCache, list[int], int]:
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


def new_rows(cache: KVCache, start: int, row: int, count: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
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


def append_rows(cache: KVCache, keys: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> None:
    """Append per-layer K/V ``[1, H, N, D]`` (``None`` or empty: nothing) to ``cache``."""
    for i, (k, v) in enumerate(zip(keys, values)):
        if k is not None and v is not None and k.shape[-2] > 0:
            cache.append(i, k, v)


class DFlashDrafter:
    """:class:`BatchDrafter` for a :class:`~spiffy.models.dflash.DFlashDraftModel` (target-feature conditioned).

    The block ``[root, MASK x depth]`` is embedded with the target's embeddings and read out through the target's
    ``lm_head``; the drafter's context K/V cache holds exactly the committed rows' projected features.

    Args:
        model: the DFlash drafter model.
        block_size: drafted block length (default: ``model.block_size``).
    """

    def __init__(self, model: DFlashDraftModel, block_size: int | None = None) -> None:
        self.model = model
        self.block_size = int(block_size if block_size is not None else model.block_size)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        self._hooks: TargetFeatureHooks | None = None
        self._embed: nn.Module | None = None
        self._head: nn.Module | None = None
        self._cache = None
        self._pending: torch.Tensor | None = None
        self._block: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def check(self, target: nn.Module) -> None:
        """Raise :class:`~spiffy.errors.DrafterMismatchError` unless the model fits ``target``."""
        check_compatible(self.model, target)

    def attach(self, target: nn.Module) -> None:
        self.check(target)
        embed = target.get_input_embeddings()
        device = execution_device(embed)  # the embedding's weight may be offloaded (device_map)
        if self.model.device != device:
            raise ConfigError(
                f"the drafter is on {self.model.device} but the target on {device}; "
                "fix: load the drafter on the device of the target's input embedding (load_drafter(..., device=...))"
            )
        self._embed = embed
        self._head = target.lm_head
        self._hooks = TargetFeatureHooks(target, self.model.target_layer_ids)
        self._cache = self.model.new_cache()
        self._pending = None
        # allocated once per generation: the block (slot 0 takes the root each round) and a position ramp
        self._block = torch.full((1, self.block_size), self.model.mask_token_id, dtype=torch.long, device=device)
        self._positions = torch.arange(0, dtype=torch.long, device=device)

    def _position_range(self, start: int, stop: int) -> torch.Tensor:
        if self._positions is None or self._positions.numel() < stop:
            device = self._block.device  # type: ignore[union-attr]
            self._positions = torch.arange(max(stop, 2 * int(self._positions.numel())), dtype=torch.long, device=device)  # type: ignore[union-attr]
        return self._positions[start:stop].view(1, -1)

    def propose(self, root_token: int, root_position: int, depth: int) -> Draft:
        """One drafter forward over ``[new context features ; root, MASK x depth]`` -> ``[depth, V]`` logits."""
        if self._hooks is None or self._pending is None:
            raise RuntimeError("DFlashDrafter.propose before attach() and the prompt's commit()")
        n_ctx = int(self._pending.shape[1])
        block = self._block[:, : depth + 1]  # type: ignore[index]
        block[0, 0] = int(root_token)
        positions = self._position_range(root_position - n_ctx, root_position + depth + 1)
        hidden = self.model(self._pending, self._embed(block), positions, past_key_values=self._cache)  # type: ignore[misc]
        self._pending = self._pending[:, :0]  # the new context is in the drafter's cache now
        return self.read_out(hidden[0, 1:], int(root_token))

    def read_out(self, hidden: torch.Tensor, root_token: int) -> Draft:
        """The draft of the block's drafted rows ``[depth, H]``: their ``[depth, V]`` logits (the target's head)."""
        return self.model.compute_logits(hidden, self._head)

    def commit(self, update: ContextUpdate) -> None:
        """Queue the committed rows' target features (of batch row ``update.batch_row``) as the next draft's new
        context (block K/V are never cached, so nothing drafted needs rolling back)."""
        if self._hooks is None:
            raise RuntimeError("DFlashDrafter.commit before attach()")
        feats = self._hooks.features(update.batch_row)[:, list(update.target_rows)]
        if self._pending is None or self._pending.shape[1] == 0:
            self._pending = feats
        else:
            self._pending = torch.cat([self._pending, feats], dim=1)
        self._hooks.clear()

    @property
    def feature_hooks(self) -> TargetFeatureHooks | None:
        """The hooks collecting the target features this drafter reads (``None`` when detached)."""
        return self._hooks

    def detach(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
        self._hooks = None
        self._cache = None
        self._pending = None
        self._block = None
        self._positions = None

    def batch_key(self) -> Hashable | None:
        """Rows of one drafter model share a forward, unless the model's forward or head is overridden (causal and
        sliding-window layers share it too: the forward is told where each row's cached keys sit)."""
        model = self.model
        plain = (type(model).forward is DFlashDraftModel.forward
                 and type(model).compute_logits is DFlashDraftModel.compute_logits)
        return id(model) if plain else None

    @classmethod
    def propose_batch(cls, drafters: Sequence["DFlashDrafter"], roots: Sequence[tuple[int, int]],
                      depths: Sequence[int]) -> list[Draft]:
        """One DFlash forward over ``[cached context ; new context ; root, MASK x depth]`` of every row."""
        for d in drafters:
            if d._hooks is None or d._pending is None or d._cache is None:
                raise RuntimeError("DFlashDrafter.propose_batch before attach() and the prompt's commit()")
        model = drafters[0].model
        embed = drafters[0]._embed  # each row reads out through its own head (read_out)
        dev = model.device
        b = len(drafters)
        n_ctx = [int(d._pending.shape[1]) for d in drafters]  # type: ignore[union-attr]
        width_ctx = max(n_ctx)
        blocks = [int(depth) + 1 for depth in depths]
        width_blk = max(blocks)
        first = drafters[0]._pending
        feats = first.new_zeros((b, width_ctx, first.shape[-1]))  # type: ignore[union-attr]
        ids = torch.full((b, width_blk), model.mask_token_id, dtype=torch.long, device=dev)
        positions = torch.zeros((b, width_ctx + width_blk), dtype=torch.long, device=dev)
        ramp = torch.arange(width_blk, device=dev)
        for r, (d, (tok, pos)) in enumerate(zip(drafters, roots)):
            n = n_ctx[r]
            feats[r, :n] = d._pending[0]  # type: ignore[index]
            ids[r, 0] = int(tok)
            positions[r, :n] = torch.arange(pos - n, pos, device=dev)
            positions[r, width_ctx:] = pos + ramp
        cache, lengths, width_cache = stack_caches([d._cache for d in drafters], model.num_layers)  # type: ignore[misc]
        keys = torch.arange(width_cache + width_ctx + width_blk, device=dev)
        visible = torch.zeros((b, keys.numel()), dtype=torch.bool, device=dev)
        for r in range(b):
            visible[r, width_cache - lengths[r] : width_cache] = True
            visible[r, width_cache : width_cache + n_ctx[r]] = True
            visible[r, width_cache + width_ctx : width_cache + width_ctx + blocks[r]] = True
        cached = None  # what masked layers read: row r's cached keys (positions 0 ..) sit at its last lengths[r] slots
        if any(layer.masked for layer in model.layer_attention):  # (the stacked cache is left padded)
            pads = device_tensor([width_cache - n for n in lengths], torch.long, dev)
            cached = torch.arange(width_cache, device=dev).view(1, -1) - pads.view(-1, 1)
        hidden = model(feats, embed(ids), positions, past_key_values=cache, attention_mask=visible[:, None, None, :],  # type: ignore[misc]
                       cached_positions=cached)
        out = []
        for r, d in enumerate(drafters):
            append_rows(d._cache, *new_rows(cache, width_cache, r, n_ctx[r]))  # type: ignore[arg-type]
            d._pending = d._pending[:, :0]  # type: ignore[index]
            out.append(d.read_out(hidden[r, 1 : blocks[r]], int(roots[r][0])))
        return out


class DFlash2Drafter(DFlashDrafter):
    """:class:`BatchDrafter` for a :class:`~spiffy.models.dflash2.DFlash2DraftModel`: the DFlash forward, read out
    through the candidate selector. :meth:`propose` returns a :class:`~spiffy.arspec.selector.SelectorDraft` (every
    transition score of the round), from which each method builds its draft (the selector's chain, sampled drafts,
    DDTree)."""

    model: DFlash2DraftModel

    def __init__(self, model: DFlash2DraftModel, block_size: int | None = None) -> None:
        super().__init__(model, block_size)

    def read_out(self, hidden: torch.Tensor, root_token: int) -> Draft:
        candidates, first, following = self.model.select(hidden, self._head, root_token)  # type: ignore[arg-type]
        return SelectorDraft(candidates, first, following, int(self.model.config.vocab_size))

    def batch_key(self) -> Hashable | None:
        """DFlash's key (:meth:`DFlashDrafter.batch_key`), unless the model's selector is overridden too."""
        key = super().batch_key()
        return key if key is not None and type(self.model).select is DFlash2DraftModel.select else None
