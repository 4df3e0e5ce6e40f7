"""A preallocated K/V cache written at explicit slots: the static cache of captured target steps.

transformers' ``StaticCache`` appends at a running length; a speculative round instead writes its ``R`` verification
rows at slots ``ctx .. ctx + R - 1`` (``ctx`` a device tensor, so the write needs no host value) and then moves the
kept rows to the front of that window. :class:`SlotCache` is a transformers :class:`~transformers.Cache` (the
model's attention layers call its ``update`` as they call any cache's) whose every layer holds
``keys / values [B, H_kv, C_max, D]`` allocated once, and writes a forward's new rows at :attr:`SlotCache.slots`, a
``[R]`` long device tensor the caller fills before each forward (so the same captured forward serves every round).
The attention reads all ``C_max`` slots; the caller's 4-D mask hides the slots that hold nothing committed (never
written, rejected drafts, holes of uneven batch commits), so stale values are never seen.

Attention-only targets (every layer full attention: Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral without a window) fit
it, and so do hybrids (Qwen3.5, Qwen3-Next: Gated-DeltaNet ``linear_attention`` layers between full-attention ones):
a hybrid's cache holds K/V for its full-attention layers only, and at each linear-attention index the cache layer
transformers' own mixer reads and writes (the one ``DynamicCache(config=...)`` builds, e.g. ``LinearAttentionLayer``:
``conv_states`` / ``recurrent_states``). That layer is scratch space: the committed recurrent state of every row lives
in :class:`~spiffy.arspec.captured_recurrent.StaticRecurrent`, which loads the layer with static buffers around each
mixer call. A sliding window or any other layer kind does not fit (:func:`slot_cache_supported`). A DFlash drafter's
context cache is one too (:mod:`spiffy.arspec.captured_drafter`): its rows have their own lengths, so it writes each
row at its own slots (:meth:`SlotCache.scatter`) instead of the shared ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from spiffy.torch_utils import device_tensor

__all__ = ["SLOT_LAYER_KINDS", "SlotCache", "slot_cache_supported"]

#: the layer kinds (transformers' ``layer_types`` spelling) a :class:`SlotCache` holds
SLOT_LAYER_KINDS: frozenset[str] = frozenset({"full_attention", "linear_attention"})


def _layer_kinds(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * int(config.num_hidden_layers))


def slot_cache_supported(config: Any) -> str | None:
    """``None`` when every layer of ``config`` is full attention or linear attention (a hybrid's Gated-DeltaNet),
    else why a :class:`SlotCache` cannot hold it."""
    kinds = set(_layer_kinds(config))
    if not kinds <= SLOT_LAYER_KINDS:
        return (f"layer types {sorted(kinds)} (the static cache holds {' and '.join(sorted(SLOT_LAYER_KINDS))} "
                f"layers only, not {', '.join(sorted(kinds - SLOT_LAYER_KINDS))})")
    if "full_attention" not in kinds:
        return "no full-attention layer (the static cache keeps its positions in full-attention K/V)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        return "a sliding window (the static cache holds full-attention and linear-attention layers only)"
    return None


class _SlotLayer(StaticLayer):
    """One layer's preallocated K/V; ``update`` writes the new rows at the cache's shared slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: list[torch.Tensor]) -> None:
        super().__init__(max_cache_len=int(keys.shape[2]))
        self.keys, self.values = keys, values
        self.device = keys.device
        self.batch_size, self.num_heads = int(keys.shape[0]), int(keys.shape[1])
        self.k_head_dim, self.v_head_dim = int(keys.shape[3]), int(values.shape[3])
        self.is_initialized = True
        self._slots = slots  # a one-element list shared by every layer: the cache's current slot tensor
        self._rows = self.batch_size

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[: key_states.shape[0]], self.values[: key_states.shape[0]]
        slots = self._slots[0][: key_states.shape[-2]]
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return keys, values

    def get_seq_length(self) -> int:
        return int(self.max_cache_len)


class SlotCache(Cache):
    """``B`` rows x ``C_max`` slots of every full-attention layer's K/V, allocated once (see the module docstring).

    Args:
        config: the target's config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` or
            ``hidden_size / num_attention_heads``; ``layer_types`` for a hybrid).
        rows: batch rows ``B``; slots: ``C_max``; dtype, device: of the K/V tensors (the model's).
    A forward over ``b <= B`` rows reads and writes the first ``b`` rows (views: the addresses never change). A
    linear-attention index holds transformers' own (scratch) state layer, :attr:`linear_layers`.
    """

    def __init__(self, config: Any, rows: int, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rows, self.max_slots = int(rows), int(slots)
        self._slot_ref = [torch.arange(self.max_slots, dtype=torch.long, device=device)]
        kinds = _layer_kinds(config)
        # the state layer class the model's own mixers expect, whatever this transformers version calls it
        linear = DynamicCache(config=config).layers if "linear_attention" in kinds else []
        layers: list[Any] = [
            linear[i] if i < len(kinds) and kinds[i] == "linear_attention" else
            _SlotLayer(torch.zeros(rows, heads, slots, head_dim, dtype=dtype, device=device),
                       torch.zeros(rows, heads, slots, head_dim, dtype=dtype, device=device), self._slot_ref)
            for i in range(int(config.num_hidden_layers))]
        #: ``{layer index: transformers' linear-attention state layer}`` (empty on an attention-only target)
        self.linear_layers: dict[int, Any] = {i: layer for i, layer in enumerate(layers)
                                              if not isinstance(layer, _SlotLayer)}
        super().__init__(layers=layers)

    @property
    def slots(self) -> torch.Tensor:
        """``[C_max]`` long: a forward of ``R`` rows writes them at slots ``slots[:R]`` (fill in place, e.g.
        ``slots[:R].copy_(ctx + ramp)``: the same static buffer for every round)."""
        return self._slot_ref[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every full-attention layer's keys and values (``[B, H, C_max, D]``)."""
        return [t for layer in self.layers if isinstance(layer, _SlotLayer) for t in (layer.keys, layer.values)]

    def layer_kv(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values of the first ``rows`` rows (``[rows, H, C_max, D]`` views)."""
        entry = self.layers[layer]
        return entry.keys[:rows], entry.values[:rows]

    def scatter(self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys`` / ``values [rows, H, N, D]`` of layer ``layer`` at each row's own slots ``index [rows, N]``
        long (a device tensor: rows whose committed lengths differ, as a drafter's context cache has; a row's
        ``N`` slots must be distinct)."""
        rows, heads, n, dim = (int(s) for s in keys.shape)
        where = index.view(rows, 1, n, 1).expand(rows, heads, n, dim)
        entry = self.layers[layer]
        entry.keys[:rows].scatter_(2, where, keys)
        entry.values[:rows].scatter_(2, where, values)

    def move_window(self, start: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Row ``b`` of the first ``rows``: slots ``start + j`` take slot ``start + src[b, j]`` (``src [rows, W]``
        long, ``start`` a 0-d or ``[1]`` long device tensor): the kept rows of a round moved to the front of its
        window, in one gather and one scatter per tensor, no host value needed."""
        width = int(src.shape[1])
        dest = start.view(1) + torch.arange(width, device=src.device)
        index = (start.view(1, 1) + src).view(rows, 1, width, 1)
        for t in self.tensors():
            view = t[:rows]
            moved = view.gather(2, index.expand(rows, view.shape[1], width, view.shape[3]))
            view.index_copy_(2, dest, moved)

    def keep_rows(self, kept: Sequence[int]) -> None:
        """Batch rows ``kept`` (in order) become rows ``0 .. len(kept) - 1`` (in place: addresses kept)."""
        if list(kept) == list(range(len(kept))):
            return
        idx = device_tensor(list(kept), torch.long, self.slots.device)
        for t in self.tensors():
            t[: len(kept)] = t.index_select(0, idx)
