"""Fast-dLLM v2's sub-block cache (``cache="dual"``, the official ``use_block_cache=True``): eager and static.

Within a block the official generator keeps the K/V of the whole block (``B`` positions). A step whose current
sub-block (``[a, a + S)``, the first one holding a mask) starts with a mask, or the block's first step, forwards the
whole block against the committed cache (block-causal mask) and keeps the block's fresh K/V; any other step forwards
only the sub-block's ``S`` tokens with no mask, its keys ``[committed ; kept[:a] ; fresh ; kept[a + S:]]`` in
sequence order, and writes the fresh K/V over ``kept[a : a + S]`` in place. Which of the two calls a step makes (and
``a``) depends on the state: one host read per step (the first masked column), as officially.

Static path (``compile=True``; issue 37): both calls run on the model's
:class:`~spiffy.decoding.captured.StaticStates` buffers, one bucket each per block (the committed cache grows
between blocks, so their shapes do): the refresh writes the block's K/V into static per-layer buffers; the sub-block
call reads its tokens, positions and keys from them by ``a`` held as data in a 0-dim buffer (so one bucket serves
every sub-block of a block) and writes its K/V back in place. The keys and values are the eager ones, copied in the
same order, so both paths give the same logits bit for bit (tests/test_captured_dllm.py). A one-position window (the
final head's block) runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from spiffy.decoding.base import ForwardInputs
from spiffy.decoding.fast_dllm_v2_rule import first_masked
from spiffy.decoding.sdar import _logits_of
from spiffy.errors import ConfigError
from spiffy.models.cache import KVCache
from spiffy.models.fast_dllm_v2 import OFFICIAL_MASK_BLOCK

__all__ = ["SubBlockCache"]

KeptKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, H_kv, B, D]


class SubBlockCache:
    """The block K/V the sub-block cache keeps for one session, and the forward that reads them.

    Args:
        session: the :class:`~spiffy.decoding.fast_dllm_v2.FastDLLMv2Session` (one prompt, no drafts); its
            ``static`` (a :class:`~spiffy.decoding.captured.StaticStates` or ``None``) selects the path.
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        self.kept: KeptKV | None = None  # None: no refresh yet in this block

    def reset(self) -> None:
        """A new block: its first step refreshes."""
        self.kept = None

    def forward(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Shifted logits ``[1, end - start, V]`` of the block ``[start, end)`` of the one state ``x [1, T]`` (the
        sub-block call's logits in its columns, zeros elsewhere, as officially). One NFE, one host read."""
        s = self.session
        width, small = end - start, s.small_block
        # one read: the call's shape depends on it. The block's first masked column; its sub-block [a, c) is the one
        # decoded, and a step refreshes the whole block iff that sub-block starts with a mask (first == a)
        first = int(first_masked(x[:, start:end] == s.mask_id)[0])
        a = first // small * small if first < s.block_length else 0
        c = a + small if first < s.block_length else s.block_length
        refresh = self.kept is None or (first < s.block_length and first == a)
        s.nfe += 1
        static = s.static is not None and width == s.block_length
        if refresh:
            return self._static_refresh(x, start, end) if static else self._refresh(x, start, end)
        if static and c - a == small:
            return self._static_sub_block(x, start, end, a)
        return self._sub_block(x, start, a, c)

    # ------------------------------------------------------------------ eager (the official computation)
    def _refresh(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        s = self.session
        recorder = _recording(s.cache)
        logits = s.masked_call(x[:, start:end], start, False, OFFICIAL_MASK_BLOCK, None, s.forward_inputs(),
                               cache=recorder)
        self.kept = recorder.record_new
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

    def _sub_block(self, x: torch.Tensor, start: int, a: int, c: int) -> torch.Tensor:
        s = self.session
        assert self.kept is not None
        keys, values = [], []
        for i, (bk, bv) in enumerate(self.kept):
            k, v = s.cache.layer(i)
            keys.append(torch.cat([t for t in (k, bk[..., :a, :], bk[..., c:, :]) if t is not None], dim=-2))
            values.append(torch.cat([t for t in (v, bv[..., :a, :], bv[..., c:, :]) if t is not None], dim=-2))
        recorder = _recording(s.cache, keys, values, s.cache.get_seq_length() + a)
        positions = torch.arange(start + a, start + c, device=x.device)[None, :] - s.offsets[0]
        with torch.no_grad():
            out = s.model(x[:, start + a : start + c], position_ids=positions, past_key_values=recorder,
                          cache_policy="read", block_size=0)
        part = _logits_of(out)
        for (bk, bv), (k, v) in zip(self.kept, recorder.record_new):  # the official in-place write of the K/V
            bk[..., a:c, :] = k
            bv[..., a:c, :] = v
        full = torch.zeros((1, s.block_length, part.shape[-1]), dtype=part.dtype, device=part.device)
        full[:, a:c] = torch.cat([part[:, :1], part[:, :-1]], dim=1)
        return full

    # ------------------------------------------------------------------ static (a CUDA graph per bucket on a GPU)
    def _static_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ForwardInputs, tuple]:
        """The state and the forward's inputs copied into the static buffers, and the key part they fix."""
        s, static = self.session, self.session.static
        states = static.load("states", x)
        inp = s.forward_inputs()
        cache = static.load_cache(inp.cache, int(x.shape[1]))
        inputs = ForwardInputs(None, static.load("positions", inp.position_ids), None, None, cache)
        shape = None if cache is None or cache.keys[0] is None else tuple(cache.keys[0].shape)
        return states, inputs, (s.static_layout(), tuple(states.shape), shape, s.block_length, s.small_block)

    def _kept_buffers(self, cache: KVCache) -> KeptKV:
        """The static per-layer block K/V ``[1, H_kv, B, D]`` (shapes and dtype from the model: the buffers exist
        before any step runs, so a recording allocates none)."""
        s = self.session
        attn = s.model.model.layers[0].self_attn
        dtype = s.model.get_input_embeddings().weight.dtype
        shape = (1, int(attn.num_kv_heads), s.block_length, int(attn.head_dim))
        return [tuple(s.static.buffer(f"sub_block_{part}_{i}", shape, dtype) for part in ("keys", "values"))
                for i in range(cache.num_layers)]  # type: ignore[misc]

    def _static_refresh(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        s, static = self.session, self.session.static
        states, inputs, fixed = self._static_inputs(x)
        kept = self.kept = self._kept_buffers(s.cache)

        def make() -> Any:
            def step() -> torch.Tensor:
                recorder = _recording(inputs.cache)  # the static cache's views (no tensor before a prefill)
                logits = static.current.masked_call(states[:, start:end], start, False, OFFICIAL_MASK_BLOCK, None,
                                                    inputs, cache=recorder)
                _write(kept, recorder.record_new, None)
                return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            return step

        out = static.run(s, ("fast_dllm_v2_refresh", start, end, *fixed), make)
        return out.clone() if static.replays else out

    def _static_sub_block(self, x: torch.Tensor, start: int, end: int, a: int) -> torch.Tensor:
        s, static = self.session, self.session.static
        states, inputs, fixed = self._static_inputs(x)
        kept = self.kept
        assert kept is not None
        place = static.buffer("sub_block_start", (), torch.long)
        place.fill_(a)  # a fill kernel with the number as its argument: no host read
        cache = inputs.cache  # the committed cache's static views (a session's cache is never None)
        small, length, cached = s.small_block, s.block_length, cache.get_seq_length()

        def make() -> Any:
            def step() -> torch.Tensor:
                dev = states.device
                cols = place + torch.arange(small, device=dev)  # [S] block columns of the sub-block
                tokens = states[:, start:end].index_select(1, cols)
                positions = (cols + start)[None, :] - inputs.position_ids[:1, None]
                rest = torch.arange(length - small, device=dev)
                rest = rest + small * (rest >= place)  # the kept columns outside the sub-block, in order
                keys, values = [], []
                for i, (bk, bv) in enumerate(kept):
                    k, v = cache.layer(i)
                    keys.append(torch.cat([t for t in (k, bk.index_select(-2, rest)) if t is not None], dim=-2))
                    values.append(torch.cat([t for t in (v, bv.index_select(-2, rest)) if t is not None], dim=-2))
                recorder = _recording(cache, keys, values, place + cached)
                with torch.no_grad():
                    out = static.current.model(tokens, position_ids=positions, past_key_values=recorder,
                                               cache_policy="read", block_size=0)
                part = _logits_of(out)
                _write(kept, recorder.record_new, cols)
                full = torch.zeros((1, length, part.shape[-1]), dtype=part.dtype, device=dev)
                return full.index_copy(1, cols, torch.cat([part[:, :1], part[:, :-1]], dim=1))
            return step

        out = static.run(s, ("fast_dllm_v2_sub_block", start, end, *fixed), make)
        return out.clone() if static.replays else out


def _recording(cache: KVCache, keys: list[torch.Tensor] | None = None, values: list[torch.Tensor] | None = None,
               insert_at: int | torch.Tensor | None = None) -> KVCache:
    """A read-only cache over ``keys`` / ``values`` (default: ``cache``'s own) whose forward records each layer's
    new K/V in ``record_new`` (:func:`spiffy.models.layers.attend`); new positions go at ``insert_at``."""
    out = KVCache(cache.num_layers)
    out.keys = list(cache.keys) if keys is None else list(keys)
    out.values = list(cache.values) if values is None else list(values)
    out.insert_at = insert_at
    out.record_new = []  # type: ignore[attr-defined]
    return out


def _write(kept: KeptKV, new: KeptKV, cols: torch.Tensor | None) -> None:
    """The recorded K/V written into the static block buffers: all ``B`` columns, or the sub-block's ``cols``."""
    if len(new) != len(kept):
        raise ConfigError(f"the model recorded K/V for {len(new)} of {len(kept)} layers; fix: pass compile=False")
    for (bk, bv), (k, v) in zip(kept, new):
        if k.dtype != bk.dtype:
            raise ConfigError(f"the model's K/V are {k.dtype}, its embeddings {bk.dtype}: compile=True keeps the "
                              "sub-block cache in the latter; fix: load the model in one dtype or pass compile=False")
        if cols is None:
            bk.copy_(k)
            bv.copy_(v)
        else:
            bk.index_copy_(-2, cols, k)
            bv.index_copy_(-2, cols, v)
