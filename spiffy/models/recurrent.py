"""Exact verification on hybrid targets: the recurrent (linear-attention) layers of a transformers model, run so that
every verified node and the committed state are what the same tokens decoded alone would give.

A hybrid target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated-DeltaNet layers between full-attention layers) has layers
whose state is a recurrence over the sequence (a causal convolution window ``[B, C, K]`` and a recurrent state
``[B, H_v, d_k, d_v]`` per layer). A 4-D tree mask does not reach them (they read the rows in order) and cropping the
K/V cache does not roll them back. :class:`RecurrentMixers` replaces, only for the duration of a target forward it
plans, each such layer's token mixer (transformers' own module, e.g. ``Qwen3_5GatedDeltaNet``) by a call of the same
module on exact sequences:

* prefill (:meth:`RecurrentMixers.prefill`): each batch row's real tokens alone (left padding never enters a state);
* verification (:meth:`RecurrentMixers.tree`): every root-to-leaf branch of a row's draft tree as its own sequence
  (batch ``[N_branches, M]``, right padded: a causal recurrence's output at a token does not depend on later ones),
  started from the row's committed state; each node's output is taken from the first branch through it;
* commit (:meth:`RecurrentMixers.advance`): the state after the accepted path, either a branch's final state when the
  path is a whole unpadded branch (AR, a fully accepted chain), or the committed state re-advanced over the path's
  saved layer inputs (the same inputs a forward of the path alone gives the layer).

The attention layers are untouched (they take the tree mask and the K/V cache as on any target); the committed
recurrent state lives here, per batch row, and the transformers cache's linear-attention layers are scratch space
loaded before and read after each call (:func:`attention_layers` are the cache layers the K/V stages may cut).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from spiffy.errors import UnsupportedTargetError
from spiffy.torch_utils import device_tensor

__all__ = ["RECURRENT_KINDS", "RecurrentMixers", "State", "attention_layers", "branches", "crop_attention",
           "load_state", "select_rows"]

#: the recurrent layer kinds (transformers' ``layer_types`` spelling) spiffy verifies exactly, with the attribute of
#: transformers' decoder layer that holds the kind's token mixer
RECURRENT_KINDS: dict[str, str] = {"linear_attention": "linear_attn"}

State = tuple[torch.Tensor, torch.Tensor]  # (conv window [N, C, K], recurrent state [N, H_v, d_k, d_v])


def _is_recurrent(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def load_state(layer: Any, conv: torch.Tensor, rec: torch.Tensor) -> None:
    """Make transformers' linear-attention cache ``layer`` hold ``conv [N, C, K]`` and ``rec [N, H_v, d_k, d_v]``
    as a previous state (the tensors themselves, not copies: the mixer's next call reads and updates them)."""
    layer.conv_states[0], layer.recurrent_states[0] = conv, rec
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.conv_kernel_size[0] = int(conv.shape[-1])
    if layer.device is None:
        layer.dtype, layer.device = conv.dtype, conv.device


def attention_layers(cache: Any) -> list[Any]:
    """The K/V layers of a transformers cache (its linear-attention layers carry no positions to cut or gather)."""
    return [layer for layer in cache.layers if not _is_recurrent(layer)]


def crop_attention(cache: Any, drop: int) -> None:
    """Drop the last ``drop`` cached positions of every K/V layer (``Cache.crop`` would refuse a linear layer)."""
    for layer in attention_layers(cache):
        layer.crop(-drop)  # transformers 5.x: a negative count of positions to drop


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep batch rows ``rows`` of every K/V layer (the recurrent rows live in :class:`RecurrentMixers`)."""
    for layer in attention_layers(cache):
        layer.batch_select_indices(rows)


def branches(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path of a tree given as ``parents[col]`` (column 0 the root, ``-1``), in leaf order."""
    children = {p for p in parents[1:]}
    out = []
    for leaf in range(len(parents)):
        if leaf in children:
            continue
        path = [leaf]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        out.append(path[::-1])
    return out


@dataclass
class _Call:
    """One batched call of a mixer: sequence ``n`` is row ``rows[n]``'s columns ``cols[n]`` (the index tensors are
    built once per call and device, then shared by every layer)."""

    rows: list[int]
    cols: list[list[int]]
    _index: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return max(len(c) for c in self.cols)

    def gather_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [N, M], cols [N, M], real [N, M] bool)``: padding repeats a sequence's last column, not real."""
        if ("gather", device) not in self._index:  # type: ignore[comparison-overlap]
            width = self.width
            cols = torch.tensor([c + [c[-1]] * (width - len(c)) for c in self.cols])
            rows = torch.tensor(self.rows).view(-1, 1).expand_as(cols)
            real = torch.arange(width).view(1, -1) < torch.tensor([len(c) for c in self.cols]).view(-1, 1)
            self._index[("gather", device)] = tuple(t.to(device) for t in (rows, cols, real))  # type: ignore[index]
        return self._index[("gather", device)]  # type: ignore[index,return-value]

    def scatter_index(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(sequence, step, row, column)`` ``[K]`` each: every (row, column) once, from the first sequence through
        it (deterministic: a node on several branches is read from one)."""
        if ("scatter", device) not in self._index:  # type: ignore[comparison-overlap]
            seen: set[tuple[int, int]] = set()
            picks: list[tuple[int, int, int, int]] = []
            for n, (b, cols) in enumerate(zip(self.rows, self.cols)):
                for m, c in enumerate(cols):
                    if (b, c) not in seen:
                        seen.add((b, c))
                        picks.append((n, m, b, c))
            self._index[("scatter", device)] = tuple(device_tensor(t, torch.long, device) for t in zip(*picks))  # type: ignore[index]
        return self._index[("scatter", device)]  # type: ignore[index]


class RecurrentMixers:
    """The recurrent token mixers of one hybrid target and their committed state for one generation's batch rows.

    Attributes:
        mixers: ``{layer index: mixer module}``; state: ``{layer index: (conv, recurrent)}``, each ``[B, ...]``
            (``None`` before the prefill).
    """

    def __init__(self, target: nn.Module, cache: Any) -> None:
        config = getattr(target.config, "text_config", None) or target.config
        kinds = list(getattr(config, "layer_types", None) or [])
        layers = getattr(getattr(target, "model", None), "layers", None)
        self.cache = cache
        self.mixers: dict[int, nn.Module] = {}
        for i, kind in enumerate(kinds):
            if kind not in RECURRENT_KINDS:
                continue
            mixer = getattr(layers[i], RECURRENT_KINDS[kind], None) if layers is not None else None
            if mixer is None or getattr(mixer, "layer_idx", i) != i:
                raise UnsupportedTargetError(
                    f"{type(target).__name__} layer {i} is of kind {kind!r} but has no .{RECURRENT_KINDS[kind]} token "
                    "mixer spiffy can run branch by branch; fix: use transformers' own class of the checkpoint"
                )
            self.mixers[i] = mixer
            layers_of_cache = getattr(cache, "layers", None)
            fields = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                      "is_recurrent_states_initialized", "conv_kernel_size")
            if layers_of_cache is None or i >= len(layers_of_cache) or not all(
                    hasattr(layers_of_cache[i], f) for f in fields):
                raise UnsupportedTargetError(
                    f"{type(target).__name__} layer {i} ({kind!r}): this transformers version's cache layer does not "
                    f"keep the state as {', '.join(fields)}; fix: use transformers 5.17 to 5.24 (tested)"
                )
        # the forward each call runs: an instance forward already there (accelerate's offloading hook wraps the
        # module so) or transformers' own; ours replaces it only inside a planned target forward and then gives it back
        self._previous: dict[int, Any] = {i: m.__dict__.get("forward") for i, m in self.mixers.items()}
        self._forwards: dict[int, Callable[..., torch.Tensor]] = {
            i: prev if prev is not None else type(m).forward.__get__(m) for (i, m), prev in
            zip(self.mixers.items(), self._previous.values())}
        self.state: dict[int, State | None] = {i: None for i in self.mixers}
        self._saved: dict[int, tuple[torch.Tensor, _Call, State]] = {}

    @classmethod
    def for_target(cls, target: nn.Module, cache: Any) -> "RecurrentMixers | None":
        """The target's recurrent mixers, or ``None`` when every layer is attention."""
        mixers = cls(target, cache)
        return mixers if mixers.mixers else None

    # ------------------------------------------------------------------------------------------ one mixer call

    def _run(self, index: int, x: torch.Tensor, start: State | None, **kwargs: Any) -> tuple[torch.Tensor, State]:
        """Transformers' mixer ``index`` over ``x [N, M, H]`` from ``start`` (``None``: a fresh sequence); returns its
        output ``[N, M, H]`` and final state (the cache layer is loaded with ``start`` and read back)."""
        layer = self.cache.layers[index]
        if start is None:
            layer.conv_states[0] = layer.recurrent_states[0] = None
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = False
            layer.has_previous_state[0] = False
        else:
            load_state(layer, start[0].clone(), start[1].clone())  # transformers updates them in place
        out = self.call(index, x, **kwargs)
        return out, (layer.conv_states[0], layer.recurrent_states[0])

    def call(self, index: int, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Transformers' own forward of mixer ``index`` over ``x [N, M, H]`` on the state its cache layer holds now
        (``cache.layers[index]``, which the call advances: in place on a one-token step); ``[N, M, H]`` out."""
        # (hidden_states, cache, attention_mask) positionally: transformers 5.17 names the cache cache_params, 5.24 cache
        return self._forwards[index](x, self.cache, None, **kwargs)

    def _gather(self, hidden: torch.Tensor, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [N, M, H], row index [N, M], column index [N, M])`` of a call (padding zeroed in ``x``)."""
        rows, cols, real = call.gather_index(hidden.device)
        return hidden[rows, cols] * real.unsqueeze(-1).to(hidden.dtype), rows, cols

    def _start(self, index: int, rows: Sequence[int]) -> State | None:
        state = self.state[index]
        if state is None:
            return None
        idx = device_tensor(list(rows), torch.long, state[0].device)
        return state[0].index_select(0, idx), state[1].index_select(0, idx.to(state[1].device))

    def _scatter(self, hidden: torch.Tensor, call: _Call, y: torch.Tensor) -> torch.Tensor:
        """``[B, R, H]`` outputs: each (row, column) from the first sequence through it; zeros elsewhere."""
        out = torch.zeros(hidden.shape[:2] + y.shape[2:], dtype=y.dtype, device=y.device)
        n, m, b, c = call.scatter_index(y.device)
        out[b, c] = y[n, m]
        return out

    # ---------------------------------------------------------------------------------------------- the plans

    @contextmanager
    def patched(self, step: Callable[[int, torch.Tensor, dict[str, Any]], torch.Tensor]) -> Iterator[None]:
        """Route every mixer's forward through ``step(layer index, hidden [B, R, H], kwargs)`` inside the block."""
        for index, mixer in self.mixers.items():
            def forward(hidden_states: torch.Tensor, *args: Any, _i: int = index, **kwargs: Any) -> torch.Tensor:
                for name in ("cache", "cache_params", "attention_mask"):
                    kwargs.pop(name, None)  # the padding and the cache are handled per sequence
                return step(_i, hidden_states, kwargs)
            mixer.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            for index, mixer in self.mixers.items():
                if self._previous[index] is None:
                    mixer.__dict__.pop("forward", None)
                else:
                    mixer.forward = self._previous[index]  # type: ignore[method-assign]

    @contextmanager
    def prefill(self, columns: Sequence[Sequence[int]]) -> Iterator[None]:
        """A target forward in this block is the prefill: row ``b``'s real tokens are its ``columns[b]`` (after its
        left padding), each row's state starts empty and becomes the state after those tokens."""
        groups: dict[int, list[int]] = {}
        for b, cols in enumerate(columns):
            groups.setdefault(len(cols), []).append(b)
        calls = [_Call(rows, [list(columns[b]) for b in rows]) for rows in groups.values()]

        def step(index: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
            out = torch.zeros_like(hidden)
            conv: list[torch.Tensor | None] = [None] * len(columns)
            rec: list[torch.Tensor | None] = [None] * len(columns)
            for call in calls:
                x, rows, cols = self._gather(hidden, call)
                y, (c, r) = self._run(index, x, None, **kwargs)
                out[rows, cols] = y
                for n, b in enumerate(call.rows):
                    conv[b], rec[b] = c[n], r[n]
            self.state[index] = (torch.stack(conv), torch.stack(rec))  # type: ignore[arg-type]
            return out

        with self.patched(step):
            yield

    @contextmanager
    def tree(self, parents: Sequence[Sequence[int]]) -> Iterator[None]:
        """A target forward in this block verifies row ``b``'s tree over columns ``0..len(parents[b])`` (column 0 the
        root; ``parents[b][c]`` the parent column of column ``c``): each branch runs from the row's committed state.
        The committed state does not change until :meth:`advance`."""
        call = _Call([], [])
        for b, par in enumerate(parents):
            for path in branches(par):
                call.rows.append(b)
                call.cols.append(path)

        def step(index: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
            x, _, _ = self._gather(hidden, call)
            y, final = self._run(index, x, self._start(index, call.rows), **kwargs)
            self._saved[index] = (hidden, call, final)
            return self._scatter(hidden, call, y)

        self._saved = {}
        with self.patched(step):
            yield

    def advance(self, keep: Sequence[Sequence[int]]) -> None:
        """Commit row ``b``'s accepted path ``keep[b]`` (verified columns, root first) of the last :meth:`tree`."""
        if not self._saved:
            raise RuntimeError("advance() needs a verified tree; fix: run the target forward inside tree()")
        for index, (hidden, call, final) in self._saved.items():
            width = call.width
            conv, rec = self.state[index]  # type: ignore[misc]
            conv, rec = conv.clone(), rec.clone()
            redo: dict[int, list[int]] = {}
            for b, path in enumerate(keep):
                path = list(path)
                done = next((n for n, (r, cols) in enumerate(zip(call.rows, call.cols))
                             if r == b and cols == path and len(cols) == width), None)
                if done is not None:  # the branch ran unpadded: its final state is the path's
                    conv[b], rec[b] = final[0][done], final[1][done]
                else:
                    redo.setdefault(len(path), []).append(b)
            for rows in redo.values():
                again = _Call(rows, [list(keep[b]) for b in rows])
                x, _, _ = self._gather(hidden, again)
                _, (c, r) = self._run(index, x, self._start(index, rows))
                for n, b in enumerate(rows):
                    conv[b], rec[b] = c[n], r[n]
            self.state[index] = (conv, rec)
        self._saved = {}

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the committed state of batch rows ``rows`` (``[B']`` long), in that order."""
        for index, state in self.state.items():
            if state is not None:
                self.state[index] = (state[0].index_select(0, rows.to(state[0].device)),
                                     state[1].index_select(0, rows.to(state[1].device)))
