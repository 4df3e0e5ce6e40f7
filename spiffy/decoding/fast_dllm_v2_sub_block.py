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
every sub-block of a block) and writes its K/V back in place. Eager and static run one computation each
(:func:`_refresh_call`, :func:`_sub_block_call`), eagerly on the session's tensors or as a bucket's step on copies in
the buffers, so both paths give the same logits bit for bit (tests/test_captured_sub_block.py). A window of another
width than the block (the final head's one position) runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

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
        small = s.small_block
        # one read: the call's shape depends on it. The block's first masked column; its sub-block [a, c) is the one
        # decoded, and a step refreshes the whole block iff that sub-block starts with a mask (first == a)
        first = int(first_masked(x[:, start:end] == s.mask_id)[0])
        a = first // small * small if first < s.block_length else 0
        c = a + small if first < s.block_length else s.block_length
        refresh = self.kept is None or (first < s.block_length and first == a)
        s.nfe += 1
        static = s.static if end - start == s.block_length else None
        if refresh:
            return self._refresh(x, start, end, static)
        return self._sub_block(x, start, end, a, c - a, static)

    def _refresh(self, x: torch.Tensor, start: int, end: int, static: Any) -> torch.Tensor:
        s = self.session
        if static is None:
            logits, self.kept = _refresh_call(s, x, start, end, s.forward_inputs())
            return logits
        states, inputs, fixed = self._static_inputs(x)
        kept = self.kept = self._kept_buffers()

        def make() -> Any:
            def step() -> torch.Tensor:
                logits, new = _refresh_call(static.current, states, start, end, inputs)
                _write(kept, new, None)
                return logits
            return step

        out = static.run(s, ("fast_dllm_v2_refresh", start, end, *fixed), make)
        return out.clone() if static.replays else out

    def _sub_block(self, x: torch.Tensor, start: int, end: int, a: int, size: int, static: Any) -> torch.Tensor:
        s, kept, length = self.session, self.kept, self.session.block_length
        assert kept is not None
        if static is None:
            place = torch.full((), a, dtype=torch.long, device=x.device)
            return _sub_block_call(s.model, x, start, length, size, place, s.position_offsets, s.cache, kept)
        states, inputs, fixed = self._static_inputs(x)
        place = static.buffer("sub_block_start", (), torch.long)
        place.fill_(a)  # a fill kernel with the number as its argument: no host read

        def make() -> Any:
            return lambda: _sub_block_call(static.current.model, states, start, length, size, place,
                                           inputs.position_ids, inputs.cache, kept)

        out = static.run(s, ("fast_dllm_v2_sub_block", start, end, size, *fixed), make)
        return out.clone() if static.replays else out

    def _static_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, Any, tuple]:
        """The state and the forward's inputs copied into the static buffers, and the key part they fix."""
        s, static = self.session, self.session.static
        states = static.load("states", x)
        inp = s.forward_inputs()
        inputs = static.load_inputs(inp, static.load_cache(inp.cache, int(x.shape[1])))
        shape = None if inputs.cache.keys[0] is None else tuple(inputs.cache.keys[0].shape)
        return states, inputs, (s.static_layout(), tuple(states.shape), shape, s.block_length, s.small_block)

    def _kept_buffers(self) -> KeptKV:
        """The static per-layer block K/V ``[1, H_kv, B, D]`` (shapes and dtype from the model: the buffers exist
        before any step runs, so a recording allocates none)."""
        s = self.session
        attn = s.model.model.layers[0].self_attn
        dtype = s.model.get_input_embeddings().weight.dtype
        shape = (1, int(attn.num_kv_heads), s.block_length, int(attn.head_dim))
        return [tuple(s.static.buffer(f"sub_block_{part}_{i}", shape, dtype) for part in ("keys", "values"))
                for i in range(s.cache.num_layers)]  # type: ignore[misc]


def _refresh_call(session: Any, states: torch.Tensor, start: int, end: int, inputs: Any
                  ) -> tuple[torch.Tensor, KeptKV]:
    """The whole block ``[start, end)`` of ``states [1, T]`` against the committed cache of ``inputs`` (block-causal
    mask): its shifted logits ``[1, end - start, V]`` and each layer's fresh K/V."""
    recorder = _recording(inputs.cache)
    logits = session.masked_call(states[:, start:end], start, False, OFFICIAL_MASK_BLOCK, None, inputs,
                                 cache=recorder)
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1), recorder.record_new


def _sub_block_call(model: Any, states: torch.Tensor, start: int, length: int, size: int, place: torch.Tensor,
                    offsets: torch.Tensor, cache: KVCache, kept: KeptKV) -> torch.Tensor:
    """The sub-block call: the ``size`` tokens of ``states [1, T]`` from block column ``place`` (0-dim long) of the
    block at ``start`` (``length`` columns), no mask, over ``[committed ; kept[:place] ; fresh ; kept[place + size:]]``
    (``cache``: the committed K/V; ``offsets [B]``: the position offsets), the fresh K/V then written over
    ``kept[place : place + size]`` in place. Returns ``[1, length, V]``: the shifted logits in the sub-block's
    columns, zeros elsewhere. Reads nothing back (a graph can hold it: the place is data)."""
    dev = states.device
    cols = place + torch.arange(size, device=dev)  # [size] block columns of the sub-block
    tokens = states[:, start : start + length].index_select(1, cols)
    positions = (cols + start)[None, :] - offsets[:1, None]
    rest = torch.arange(length - size, device=dev)
    rest = rest + size * (rest >= place)  # the kept columns outside the sub-block, in order
    keys, values = [], []
    for i, (bk, bv) in enumerate(kept):
        k, v = cache.layer(i)
        keys.append(torch.cat([t for t in (k, bk.index_select(-2, rest)) if t is not None], dim=-2))
        values.append(torch.cat([t for t in (v, bv.index_select(-2, rest)) if t is not None], dim=-2))
    recorder = _recording(cache, keys, values, place + cache.get_seq_length())
    with torch.no_grad():
        out = model(tokens, position_ids=positions, past_key_values=recorder, cache_policy="read", block_size=0)
    part = _logits_of(out)
    _write(kept, recorder.record_new, cols)  # the official in-place write of the sub-block's K/V
    full = torch.zeros((1, length, part.shape[-1]), dtype=part.dtype, device=dev)
    return full.index_copy(1, cols, torch.cat([part[:, :1], part[:, :-1]], dim=1))


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
    """The recorded K/V written into the kept block K/V: all ``B`` columns, or the sub-block's ``cols``."""
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
