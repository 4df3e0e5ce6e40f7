"""A minimal per-layer key/value cache shared by spiffy's own diffusion-LM implementations.

Tensors are stored per layer as ``[B, H_kv, C, D]`` (batch, key/value heads, cached positions, head dim).
The cache is *policy driven*: a forward either appends what it computes (``"append"``, SDAR's
``store_kv=True``) or only reads the cache (``"read"``, SDAR's ``store_kv=False``). A cache whose batch is 1
is broadcast against a larger query batch, so several speculative drafts can share one committed prefix.

A transformers ``DynamicCache`` may be passed to the models instead (users' SDAR scripts do); the models
wrap it with :func:`as_kv_cache`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

CachePolicy = Literal["append", "read"]
CACHE_POLICIES: tuple[str, ...] = ("append", "read")

#: the name transformers' models take their K/V cache under and return it in: ``cache`` from transformers 5.2x (the
#: old ``past_key_values`` then warns that it will be removed), ``past_key_values`` before
HF_CACHE_NAME: str = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def hf_cache(cache: Any) -> dict[str, Any]:
    """``{HF_CACHE_NAME: cache}``: the keyword argument that passes ``cache`` to a transformers model
    (``model(ids, **hf_cache(cache))``), and to a ``ModelOutput`` constructor."""
    return {HF_CACHE_NAME: cache}


class KVCache:
    """Per-layer K/V store. ``keys[i]`` / ``values[i]`` are ``[B, H_kv, C, D]`` or ``None`` before first use.

    ``insert_at`` (default ``None``: new positions come after the cached ones) places a read-only forward's new
    K/V between cached positions ``[:insert_at]`` and ``[insert_at:]``, so a dual cache (prefix and suffix
    cached, the block recomputed) attends over keys in sequence order, as Fast-dLLM's in-place block write
    does; the order changes the attention's summation order, hence half-precision logits. ``insert_at`` may be a 0-dim
    long tensor (a static forward shared by every block of a dual cache: the place is data, :func:`between`).
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError(f"KVCache needs num_layers > 0, got {num_layers}")
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.insert_at: int | torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions C (0 when empty)."""
        k = self.keys[layer_idx]
        return 0 if k is None else int(k.shape[-2])

    def layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cached ``(keys, values)`` of one layer, each ``[B, H_kv, C, D]``, or ``(None, None)``."""
        return self.keys[layer_idx], self.values[layer_idx]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k``/``v`` (``[B, H_kv, L, D]``) after the cached positions of ``layer_idx``."""
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=-2)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (``length >= 0``); drop the rest."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[..., :length, :]
                self.values[i] = self.values[i][..., :length, :]  # type: ignore[index]

    def select(self, index: torch.Tensor, insert_at: int | torch.Tensor | None = None) -> "KVCache":
        """A new cache holding only cached positions ``index`` (``[C']`` long), in that order; new positions of a
        forward on it go at ``insert_at`` (see the class docstring)."""
        out = KVCache(self.num_layers)
        out.insert_at = insert_at
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                out.keys[i] = k.index_select(-2, index.to(k.device))
                out.values[i] = v.index_select(-2, index.to(v.device))  # type: ignore[union-attr]
        return out

    def gather_batch(self, rows: torch.Tensor) -> "KVCache":
        """A new cache whose batch entry ``n`` is this cache's batch entry ``rows[n]`` (``rows``: ``[N]`` long).

        Batch entries of size 1 are kept as they are (they already broadcast to any query batch).
        """
        out = KVCache(self.num_layers)
        out.insert_at = self.insert_at
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None or k.shape[0] == 1:
                out.keys[i], out.values[i] = k, v
            else:
                out.keys[i] = k.index_select(0, rows.to(k.device))
                out.values[i] = v.index_select(0, rows.to(v.device))  # type: ignore[union-attr]
        return out

    def clone(self) -> "KVCache":
        out = KVCache(self.num_layers)
        out.insert_at = self.insert_at
        out.keys = [None if k is None else k.clone() for k in self.keys]
        out.values = [None if v is None else v.clone() for v in self.values]
        return out


class DynamicCacheView:
    """Adapts a transformers ``DynamicCache`` to the :class:`KVCache` interface (read/append/length)."""

    def __init__(self, cache) -> None:  # noqa: ANN001 - transformers type, imported lazily
        self.cache = cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.cache.get_seq_length(layer_idx))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        layers = getattr(self.cache, "layers", None)
        if layers is None or layer_idx >= len(layers):
            return None, None
        lay = layers[layer_idx]
        keys = getattr(lay, "keys", None)
        if keys is None or (isinstance(keys, torch.Tensor) and keys.numel() == 0):
            return None, None
        return keys, lay.values

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.update(k, v, layer_idx)


def as_kv_cache(cache) -> KVCache | DynamicCacheView | None:  # noqa: ANN001
    """Return ``cache`` as an object with ``layer/append/get_seq_length`` (``None`` stays ``None``)."""
    if cache is None or isinstance(cache, (KVCache, DynamicCacheView)):
        return cache
    if hasattr(cache, "update") and hasattr(cache, "get_seq_length"):
        return DynamicCacheView(cache)
    raise TypeError(
        f"past_key_values must be a spiffy KVCache or a transformers DynamicCache, got {type(cache).__name__}"
    )


def between(cached: torch.Tensor, new: torch.Tensor, at: int | torch.Tensor) -> torch.Tensor:
    """``cached[..., :at, :] ; new ; cached[..., at:, :]`` along the positions: ``cached [..., C, D]`` and ``new [...,
    L, D]`` give ``[..., C + L, D]`` (a dual cache's keys in sequence order). ``at`` may be a 0-dim long tensor on
    their device: the place is then data (no host read), the values the same as with the int (only copies)."""
    if not isinstance(at, torch.Tensor):
        return torch.cat([cached[..., :at, :], new, cached[..., at:, :]], dim=-2)
    c, n = cached.shape[-2], new.shape[-2]
    col = torch.arange(c + n, device=cached.device)
    # column j reads cached[j] before the place, new[j - at] inside it, cached[j - n] after it
    source = torch.where(col < at, col, torch.where(col < at + n, c + col - at, col - n))
    return torch.cat([cached, new], dim=-2).index_select(-2, source)
