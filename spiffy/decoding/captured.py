"""The static (captured on a GPU) path of a dLLM session's :meth:`~spiffy.decoding.session.DecodeSession.forward_states`.

Spiffy's verification forward runs ``1 + D`` states at once; on a GPU an eager forward over one 32-row block is
launch-bound, so the forward is replayed from a CUDA graph instead. This module plugs the dLLM sessions into the one
capture home, :class:`spiffy.capture.StepGraphs` (no second capture machinery): :class:`StaticStates` keeps, per
model, static buffers and one step per bucket, keyed by

* the session's Python-level layout (family, cache mode, prompt rows, state length, window ``[start, end)``, CFG
  scale, mask id: :meth:`StaticStates.forward` reads them from the session) and
* the number of states ``N`` itself and the shapes of the tensors the forward reads. States are *not* padded to a
  larger bucket: a matrix product over more rows may block its reduction differently (measured: the float64 logits
  of 3 states computed in a batch of 4 differ from a batch of 3 by ~3e-15 on a CPU; cuBLAS picks kernels by row
  count too), and the static path must equal eager bit for bit. ``N`` takes few values (``1 + D`` for Spiffy's
  budget ``D``, the chain length for FreeDave / SSD), so a window has a handful of buckets.

Before each run the session's states, batch rows, key-padding mask, positions and (once per block) its cache K/V
are copied into the buffers, and the bucket's step calls the session's own
:meth:`~spiffy.decoding.base.BidirectionalSession.window_logits` on them: the same code the eager path runs, so on a
CPU (where the step runs eagerly) the static path is the eager computation on copies of its inputs. A bucket is built
once per model and reused by every later forward, block, prompt and call with the same layout.

Sessions plug in with ``forward_inputs()`` (the tensors a forward reads, :class:`~spiffy.decoding.base.ForwardInputs`),
``window_logits(states, rows, inputs, window)`` (the forward on explicit tensors) and ``static_layout()``: LLaDA,
LLaDA-MoE and Dream (:class:`~spiffy.decoding.base.BidirectionalSession`), SDAR, SDAR-MoE and LLaDA2.0
(:class:`~spiffy.decoding.sdar.SDARSession`), Fast-dLLM v2's prefix cache
(:class:`~spiffy.decoding.fast_dllm_v2.FastDLLMv2Session`; its sub-block cache's two calls build their own steps
through :meth:`StaticStates.run`). The MoE families (LLaDA-MoE, SDAR-MoE, LLaDA2.0) run their experts grouped in a
static forward (:mod:`spiffy.models.moe_dispatch`: sorted by expert, one ``torch._grouped_mm`` per projection, no host
read; bitwise the per-expert products); where that is impossible a CUDA capture is refused
(:meth:`StaticStates.for_model`).

The cache K/V live in one buffer per layer of ``T`` slots (grown, and the graphs dropped, only when a longer state
comes); a block's cache of ``C`` positions is the view of its first ``C`` slots, so buckets of every block share it.
A prefix cache's window ``[start, T)`` and SDAR's committed cache change shape from block to block, so their buckets
are per block; a dual cache's do not (the block's ``L`` rows between ``T - L`` cached ones), so its window's start is
data in a buffer and one bucket per ``N`` serves every block. The block-start refresh of LLaDA's and Dream's caches
(a forward over the whole state) is a bucket of its own (:meth:`StaticStates.refresh`), shared by every block.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn

from spiffy.capture import StepGraphs
from spiffy.errors import ConfigError
from spiffy.models.cache import KVCache
from spiffy.models.moe_dispatch import capture_unsupported, grouped_experts, stack_experts

__all__ = ["StaticStates", "static_states_of"]

#: the static buffers of live models (one per model; replaced when the capture setting changes)
_STATIC: "weakref.WeakKeyDictionary[nn.Module, StaticStates]" = weakref.WeakKeyDictionary()


def static_states_of(model: nn.Module) -> "StaticStates | None":
    """The static buffers ``model``'s captured dLLM forwards run on now (buckets, capture times), if any."""
    return _STATIC.get(model)


class StaticStates:
    """A model's static forward buffers and its steps per bucket (see the module docstring).

    Args:
        device: where the model runs; capture: capture CUDA graphs there when it is a GPU.
    """

    def __init__(self, device: torch.device, capture: bool, fuse: bool = False, unrecordable: str | None = None
                 ) -> None:
        self.device = torch.device(device)
        self.graphs = StepGraphs(self._build, self.device, capture, fuse, unrecordable=unrecordable)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._cache_buf: KVCache | None = None
        self._cache_src: list[Any] = []  # weak references to the source tensors the buffer holds now
        self._step: Callable[[], Any] | None = None  # the step the bucket being built gets
        self.current: Any = None  # the session whose forward runs now (Python values only; never kept)

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device, capture: bool, fuse: bool = False) -> "StaticStates":
        """``model``'s static buffers (made on first use; replaced when the capture or fuse setting differs; ``fuse``:
        steps compiled by TorchInductor, :func:`spiffy.capture.compile_fuses`).

        An MoE model's (LLaDA-MoE, SDAR-MoE, LLaDA2.0) static forwards run its experts grouped
        (:mod:`spiffy.models.moe_dispatch`: no host read); where they cannot (a dtype ``torch._grouped_mm`` does not
        take there, quantized experts, torch < 2.9) a CUDA capture is refused, and on a CPU the experts run one by
        one inside the static code."""
        device = torch.device(device)
        why = capture_unsupported(model)
        if capture and device.type == "cuda" and why is not None:
            raise ConfigError(
                f"compile=True cannot capture {type(model).__name__}'s forward in a CUDA graph: its MoE layers cannot "
                f"run their experts grouped ({why}), and per expert the shapes are known only on the host; fix: "
                "load the model in bfloat16 (plain weights, torch >= 2.9) or pass compile=False (eager, same tokens)")
        stack_experts(model)  # before any static forward: eager and static then read the same weight memory
        have = _STATIC.get(model)
        if (have is not None and have.graphs.capture == (bool(capture) and torch.device(device).type == "cuda")
                and have.graphs.fuse == bool(fuse)):
            return have
        if have is not None:
            have.graphs.clear()
        made = _STATIC[model] = cls(device, capture, fuse, why)
        return made

    @property
    def captured(self) -> bool:
        """Whether the buckets are CUDA graphs (else the same static code runs eagerly)."""
        return self.graphs.capture

    @property
    def replays(self) -> bool:
        """Whether a forward's outputs are a replay's, overwritten by the bucket's next call (a CUDA graph, or its
        emulation on a CPU: :attr:`spiffy.capture.StepGraphs.replays`): what a caller keeps, it copies."""
        return self.graphs.replays

    def _build(self, key: Hashable) -> Callable[[], Any]:
        step, self._step = self._step, None
        assert step is not None, "a bucket is built only from run()"
        return step

    # ------------------------------------------------------------------ buffers
    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The persistent buffer ``name`` of ``shape`` / ``dtype`` (zeros when first made; same address after)."""
        key = (name, tuple(int(s) for s in shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros(key[1], dtype=dtype, device=self.device)
        return buf

    def load(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` copied into the buffer ``name`` of its shape (``None`` stays ``None``)."""
        if t is None:
            return None
        buf = self.buffer(name, tuple(t.shape), t.dtype)
        buf.copy_(t)
        return buf

    def load_cache(self, cache: Any, slots: int) -> KVCache | None:
        """``cache`` (a :class:`KVCache`, every layer ``[Bc, H, C, D]`` with ``C <= slots``) as views of the first
        ``C`` slots of the static per-layer buffers, copied only when its tensors changed since the last load."""
        if cache is None:
            return None
        if isinstance(cache, KVCache) and all(k is None for k in cache.keys):  # nothing cached yet (no tensor)
            empty = KVCache(cache.num_layers)
            empty.insert_at = cache.insert_at
            return empty
        keys, values = list(cache.keys), list(cache.values)
        if not isinstance(cache, KVCache) or any(k is None for k in keys):
            raise ConfigError(f"compile=True holds spiffy's KVCache only, the model returned {type(cache).__name__}; "
                              "fix: load the model with spiffy.load_model, or pass compile=False")
        buf = self._cache_buf
        first = keys[0]
        fits = (buf is not None and buf.num_layers == len(keys) and buf.keys[0] is not None
                and buf.keys[0].shape[0] == first.shape[0] and buf.keys[0].shape[1] == first.shape[1]
                and buf.keys[0].shape[3] == first.shape[3] and buf.keys[0].dtype == first.dtype
                and int(buf.keys[0].shape[2]) >= int(first.shape[2]))
        if not fits:
            slots = max(int(slots), int(first.shape[2]))
            buf = KVCache(len(keys))
            for i, (k, v) in enumerate(zip(keys, values)):
                buf.keys[i] = torch.zeros(k.shape[0], k.shape[1], slots, k.shape[3], dtype=k.dtype, device=self.device)
                buf.values[i] = torch.zeros(v.shape[0], v.shape[1], slots, v.shape[3], dtype=v.dtype, device=self.device)
            self.graphs.clear()  # steps captured on the old buffers would read freed memory
            self._cache_buf, self._cache_src = buf, []
        length = int(first.shape[2])
        fresh = len(self._cache_src) == 2 * len(keys) and all(
            ref() is t for ref, t in zip(self._cache_src, keys + values))
        if not fresh:
            for i, (k, v) in enumerate(zip(keys, values)):
                buf.keys[i][:, :, :length].copy_(k)  # type: ignore[index]
                buf.values[i][:, :, :length].copy_(v)  # type: ignore[index]
            self._cache_src = [weakref.ref(t) for t in keys + values]
        view = KVCache(len(keys))
        view.insert_at = cache.insert_at
        view.keys = [k[:, :, :length] for k in buf.keys]  # type: ignore[index]
        view.values = [v[:, :, :length] for v in buf.values]  # type: ignore[index]
        return view

    # ------------------------------------------------------------------ the forwards
    def load_inputs(self, inp: Any, cache: KVCache | None, window_start: torch.Tensor | None = None) -> Any:
        """The session's forward inputs ``inp`` as copies in the static buffers (``cache``: already loaded)."""
        static = type(inp)(self.load("attention_mask", inp.attention_mask), self.load("positions", inp.position_ids),
                           None, self.load("prompt_index", inp.prompt_index), cache, window_start)
        if inp.full_positions is not None:  # the session's positions (the only full-call positions there are)
            static = type(inp)(static.attention_mask, static.position_ids, static.position_ids,
                               static.prompt_index, cache, window_start)
        return static

    def run(self, session: Any, key: Hashable, make_step: Callable[[], Callable[[], Any]]) -> Any:
        """A session's own static step under ``key`` (built by ``make_step()`` on the bucket's first call, reused
        after): its outputs, a replay's when :attr:`replays` (the caller copies what it keeps). While it runs,
        :attr:`current` is ``session``; the step reads only static buffers and Python values ``key`` fixes."""
        if key not in self.graphs:
            self._step = make_step()
        self.current = session
        try:
            return self.graphs.run(key)
        finally:
            self.current = None

    def forward(self, session: Any, states: torch.Tensor, rows: torch.Tensor | None,
                window: tuple[int, int]) -> torch.Tensor:
        """``session.window_logits`` of ``states [N, T]`` (``rows [N]`` or ``None``) over ``window`` on the
        static buffers of bucket ``N``: ``[N, W, V]`` logits (a copy when captured: the graph's outputs are overwritten
        by the next replay). The session's inputs (:meth:`~spiffy.decoding.base.BidirectionalSession.forward_inputs`)
        are copied in first. A dual cache (keys ``[:start] ; block ; [end:]``: ``insert_at`` set) gets the window's
        start as data, so one bucket per ``N`` serves every block of the generation (its shapes do not change)."""
        n, t = int(states.shape[0]), int(states.shape[1])
        sbuf = self.load("states", states)
        rbuf = self.load("rows", rows)
        inp = session.forward_inputs()
        cache = self.load_cache(inp.cache, t)
        placed = cache is not None and isinstance(cache.insert_at, int)
        start = None
        if placed:
            start = self.buffer("window_start", (), torch.long)
            start.fill_(int(window[0]))  # a fill kernel with the number as its argument: no host read
            cache.insert_at = start
        static = self.load_inputs(inp, cache, start)
        where: tuple = ("rows", window[1] - window[0]) if placed else tuple(window)
        key = (type(session).__name__, session.static_layout(), n, t, where, rbuf is not None,
               _shape(static.attention_mask), _shape(static.position_ids), inp.full_positions is not None,
               None if cache is None else (_shape(cache.keys[0]), "data" if placed else cache.insert_at))
        win = tuple(int(w) for w in window)

        def make_step() -> Callable[[], torch.Tensor]:
            def step() -> torch.Tensor:
                with grouped_experts():  # MoE experts without host reads (a graph can hold them)
                    return self.current.window_logits(sbuf, rbuf, static, win)
            return step

        out = self.run(session, key, make_step)
        return out.clone() if self.replays else out

    def refresh(self, session: Any) -> tuple[torch.Tensor, KVCache]:
        """The block-start forward of a cached bidirectional session (``session.full_logits(session.x,
        use_cache=True)``: every row of the state, its K/V kept) on static buffers: ``(logits [B, T, V], cache)``.
        Its shapes are the state's, so one bucket serves every block of a generation (and every prompt of the same
        length). Captured, the logits and K/V live in the graph's memory until the next refresh of that shape: the
        caller takes what it keeps (its window, and the K/V, which the next forward copies into the cache buffer)."""
        xbuf = self.load("refresh_states", session.x)
        inp = session.forward_inputs()
        static = self.load_inputs(inp, None)
        key = ("refresh", type(session).__name__, session.static_layout(), tuple(xbuf.shape),
               _shape(static.attention_mask), _shape(static.position_ids), inp.full_positions is not None)
        def make_step() -> Callable[[], tuple[torch.Tensor, tuple, tuple]]:
            def step() -> tuple[torch.Tensor, tuple, tuple]:
                with grouped_experts():
                    logits, kv = self.current.full_logits(xbuf, use_cache=True, inputs=static)
                return logits, tuple(kv.keys), tuple(kv.values)
            return step

        logits, keys, values = self.run(session, key, make_step)
        cache = KVCache(len(keys))
        cache.keys, cache.values = list(keys), list(values)
        return logits, cache


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)
