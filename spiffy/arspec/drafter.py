"""The drafter interface of AR speculative decoding, and DFlash as its first implementation.

A drafter proposes, in one pass, a distribution for each of the next ``depth`` positions after the root (the
pending bonus token), conditioned on the committed context and whatever state it keeps. After each verification it
is told which tokens joined the committed context (:class:`ContextUpdate`).

Lifecycle within one generation::

    drafter.attach(target)                       # before the prefill: bind to the target, fresh state
    drafter.commit(ContextUpdate(prompt...))     # after the prefill
    loop: logits = drafter.propose(root_token, root_position, depth)   # [depth, V]
          ... build, verify ...
          drafter.commit(ContextUpdate(root + accepted tokens ...))
    drafter.detach()                             # always (finally)

:class:`DFlashDrafter` conditions on target features (hidden states of chosen target layers, captured by
:class:`~spiffy.models.dflash.TargetFeatureHooks` during the target's own forwards). A standalone drafter (a dLLM
conditioned on the committed tokens, issue 13's DEER / SpecDiff-2) implements the same four methods from
``ContextUpdate.tokens`` alone and ignores ``target_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from spiffy.errors import ConfigError
from spiffy.models.cache import KVCache
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks, check_compatible
from spiffy.torch_utils import execution_device

__all__ = ["ContextUpdate", "Drafter", "DFlashDrafter"]


@dataclass(frozen=True)
class ContextUpdate:
    """Tokens that have just joined the committed context (the target's K/V cache), in order.

    Attributes:
        tokens: the committed token ids (after the prefill: the prompt; after a round: root + accepted nodes).
        start: absolute position of ``tokens[0]``.
        target_rows: the rows of the latest target forward that computed these tokens, one per token (features
            of these rows describe the committed context; rows not listed belonged to rejected drafts).
    """

    tokens: Sequence[int]
    start: int
    target_rows: Sequence[int]


@runtime_checkable
class Drafter(Protocol):
    """Proposes per-position distributions for the next block in one pass.

    Attributes:
        block_size: drafted block length including the root token (at most ``block_size - 1`` positions drafted).
    """

    block_size: int

    def attach(self, target: nn.Module) -> None:
        """Bind to ``target`` before its prefill and start from an empty context (raise on a mismatch)."""
        ...

    def propose(self, root_token: int, root_position: int, depth: int) -> torch.Tensor:
        """``[depth, V]`` logits: row ``d - 1`` is the drafter's distribution of the token at ``root_position + d``.

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


class DFlashDrafter:
    """:class:`Drafter` for a :class:`~spiffy.models.dflash.DFlashDraftModel` (target-feature conditioned).

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
        self._owns_hooks = True
        #: batched generation: which row of the target's batch this drafter follows (``None``: batch of one)
        self.batch_row: int | None = None

    def check(self, target: nn.Module) -> None:
        """Raise :class:`~spiffy.errors.DrafterMismatchError` unless the model fits ``target``."""
        check_compatible(self.model, target)

    def attach(self, target: nn.Module) -> None:
        self._bind(target, None)

    def attach_row(self, target: nn.Module, hooks: TargetFeatureHooks, row: int) -> None:
        """Batched generation: follow batch row ``row`` of ``target``, reading features from ``hooks`` shared by
        every row's drafter (the caller owns them: it clears them after each forward's commits and removes them)."""
        self._bind(target, hooks)
        self.batch_row = int(row)

    def _bind(self, target: nn.Module, hooks: TargetFeatureHooks | None) -> None:
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
        self._owns_hooks = hooks is None
        self._hooks = TargetFeatureHooks(target, self.model.target_layer_ids) if hooks is None else hooks
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

    def propose(self, root_token: int, root_position: int, depth: int) -> torch.Tensor:
        """One drafter forward over ``[new context features ; root, MASK x depth]`` -> ``[depth, V]`` logits."""
        if self._hooks is None or self._pending is None:
            raise RuntimeError("DFlashDrafter.propose before attach() and the prompt's commit()")
        n_ctx = int(self._pending.shape[1])
        block = self._block[:, : depth + 1]  # type: ignore[index]
        block[0, 0] = int(root_token)
        positions = self._position_range(root_position - n_ctx, root_position + depth + 1)
        hidden = self.model(self._pending, self._embed(block), positions, past_key_values=self._cache)  # type: ignore[misc]
        self._pending = self._pending[:, :0]  # the new context is in the drafter's cache now
        return self.model.compute_logits(hidden[0, 1:], self._head)

    def batch_inputs(self) -> tuple[torch.Tensor, KVCache, nn.Module, nn.Module]:
        """What a drafting forward shared with other rows (:mod:`spiffy.arspec.batch_draft`) needs from this row:
        the pending context features ``[1, N, F]``, the context cache, the target's embeddings and ``lm_head``."""
        if self._hooks is None or self._pending is None or self._cache is None:
            raise RuntimeError("DFlashDrafter.batch_inputs before attach() and the prompt's commit()")
        return self._pending, self._cache, self._embed, self._head  # type: ignore[return-value]

    def batch_absorb(self, keys: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> None:
        """After a shared drafting forward: append this row's new context K/V (per layer ``[1, H, N, D]``, ``None``
        for none) to its cache, as :meth:`propose` would have, and clear the pending context."""
        assert self._cache is not None and self._pending is not None, "batch_absorb before batch_inputs"
        for i, (k, v) in enumerate(zip(keys, values)):
            if k is not None and v is not None and k.shape[-2] > 0:
                self._cache.append(i, k, v)
        self._pending = self._pending[:, :0]

    def commit(self, update: ContextUpdate) -> None:
        """Queue the committed rows' target features as the next draft's new context (block K/V are never
        cached, so nothing drafted needs rolling back)."""
        if self._hooks is None:
            raise RuntimeError("DFlashDrafter.commit before attach()")
        feats = self._hooks.features()
        if self.batch_row is not None:
            feats = feats[self.batch_row : self.batch_row + 1]
        feats = feats[:, list(update.target_rows)]
        if self._pending is None or self._pending.shape[1] == 0:
            self._pending = feats
        else:
            self._pending = torch.cat([self._pending, feats], dim=1)
        if self._owns_hooks:
            self._hooks.clear()

    def detach(self) -> None:
        if self._hooks is not None and self._owns_hooks:
            self._hooks.remove()
        self._hooks = None
        self._cache = None
        self._pending = None
        self._block = None
        self._positions = None
        self.batch_row = None
