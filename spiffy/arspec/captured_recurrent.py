"""A hybrid target's recurrent layers on the captured path (``compile=True``): static shapes, no host read in a step.

A hybrid (Qwen3.5, Qwen3-Next) has Gated-DeltaNet ``linear_attention`` layers between its full-attention ones. The
eager loop verifies them exactly with :class:`~spiffy.models.recurrent.RecurrentMixers` (each branch of a tree run
from the committed state, the state re-advanced over the accepted path); :class:`StaticRecurrent` does the same with
static shapes per bucket, calling transformers' own mixer module (``Qwen3_5GatedDeltaNet``, ``Qwen3NextGatedDeltaNet``)
on preallocated buffers. Per recurrent layer it holds, for ``R`` rows (``C``: conv channels, ``K``: conv kernel):

* the committed state ``conv [R, C, K]`` and ``rec [R, H_v, d_k, d_v]``, and a pending copy the steps write;
* the mixer inputs of the last verification ``saved [R, W, hidden]`` (``W``: the widest round's columns).

**Verify** (inside the target's bucket ``(rows, W, D)``): from the round's static ``parents [rows, W - 1]`` and
``depths`` (column 0 the root, column ``j >= 1`` node ``j - 1``; padding nodes hang below the root) every column's
root path is built on the device as ``[rows, W, L]`` column indices (``L = D + 1``: repeated parent gathers; after
the node the path repeats it, zeroed, as the eager call pads a branch); the mixer runs once over the
``[rows * W, L, hidden]`` sequences, each from its row's committed state, and column ``c`` takes the output at its
depth. A causal recurrence's output at a token does not depend on later ones, so every column sees exactly its own
path, as the eager branch-by-branch call gives it. ``W = 1`` (a plain AR round) is the mixer's one-token decode, whose
final state is the new state already (the root is always kept): it goes to the pending state in the step.

**Commit** (bucket ``("commit", rows, S)`` after the walk; ``keep [rows, S]`` root first, ``accepted [rows]``): the
state after each row's accepted path, as the eager ``advance`` computes it: one mixer call over the path's first
``n`` saved inputs from the committed state for every ``n = 1 .. S`` (the chunked kernel for ``n > 1``, the one-token
decode for ``n = 1``), keeping call ``n``'s final state where ``accepted + 1 == n`` (``torch.where``). Eager runs the
same call over the accepted path (or takes it from the verification when the path is a whole unpadded branch: the
same tokens from the same state), so the states agree with the eager path's to the kernels' rounding.

Every step reads the committed state and writes only scratch and pending buffers, so it is idempotent (the suite's
rehearsal of a capture runs it twice); :meth:`StaticRecurrent.commit` then copies the pending state over the committed
one outside the steps. The prefill (variable lengths) runs eagerly through
:meth:`RecurrentMixers.prefill <spiffy.models.recurrent.RecurrentMixers.prefill>` (each row's real tokens alone:
left padding never enters a state) and copies the states into the buffers.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from spiffy.capture import SlotCache, StepGraphs
from spiffy.models.recurrent import RecurrentMixers, load_state
from spiffy.torch_utils import device_tensor

__all__ = ["StaticRecurrent", "root_paths"]


def root_paths(parents: torch.Tensor, depths: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every verification column's root path, padded to ``length``, on the device (static shapes, no host read).

    Args:
        parents: ``[R, N]`` long, node ``j``'s parent node (``-1``: the root); parents precede children.
        depths: ``[R, N]`` long, node ``j``'s depth (``>= 1``; at most ``length - 1``).
        length: ``L``, the longest path (root included).
    Returns:
        ``(path [R, N + 1, L], real [R, N + 1, L] bool, depth [R, N + 1])``: column ``c``'s path (column 0 the root,
        column ``j + 1`` node ``j``) holds at step ``t <= depth[c]`` its ancestor of depth ``t`` and after that the
        column itself (``real`` False there).
    """
    rows, nodes = int(parents.shape[0]), int(parents.shape[1])
    zero = torch.zeros(rows, 1, dtype=torch.long, device=parents.device)
    up = torch.cat([zero, parents + 1], 1)  # [R, W] parent column (the root is its own parent)
    depth = torch.cat([zero, depths.clamp(max=length - 1)], 1)  # [R, W]
    ancestors = [torch.arange(nodes + 1, device=parents.device).expand(rows, nodes + 1)]
    for _ in range(length - 1):  # ancestors[k]: the column k steps up (the root once reached)
        ancestors.append(up.gather(1, ancestors[-1]))
    steps = torch.arange(length, device=parents.device)
    back = (depth.unsqueeze(-1) - steps).clamp(min=0)  # [R, W, L] steps up to depth t; 0 (the column) past it
    path = torch.stack(ancestors, 2).gather(2, back)
    return path, steps <= depth.unsqueeze(-1), depth


class StaticRecurrent:
    """The committed recurrent state of a static target's rows, and its verify / commit steps (module docstring).

    Args:
        target: the hybrid target (transformers' decoder with ``linear_attn`` mixers).
        cache: the static target's :class:`~spiffy.capture.SlotCache` (its linear-attention layers are the mixers'
            scratch state layers).
        rows, width: the static target's most rows ``R`` and widest round ``W``.
    """

    def __init__(self, target: nn.Module, cache: SlotCache, rows: int, width: int) -> None:
        self.mixers = RecurrentMixers(target, cache)  # transformers' modules, their forwards, the eager prefill
        self.layers = cache.linear_layers
        self.rows, self.width = int(rows), int(width)
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # committed (conv, rec) views, [R, ...]
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # what the steps write, [R, ...]
        self.saved: dict[int, torch.Tensor] = {}  # [R, W, hidden] mixer inputs of the last verification
        self.keep = torch.zeros(0, dtype=torch.long)  # [R, W] and [R]: the commit step's inputs (static)
        self.accepted = torch.zeros(0, dtype=torch.long)
        self._stacks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (committed, pending) [layers, R, ...] per shape
        self._scratch: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # [R * W, ...] per shape
        self._adopt = False  # the last verification was a one-token step: its state is pending already

    @staticmethod
    def for_target(target: nn.Module, cache: SlotCache, rows: int, width: int) -> "StaticRecurrent | None":
        """The target's static recurrent layers, or ``None`` on an attention-only target."""
        return StaticRecurrent(target, cache, rows, width) if cache.linear_layers else None

    # ------------------------------------------------------------------------------------------------ buffers

    def _allocate(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]], hidden: int, dtype: torch.dtype
                  ) -> None:
        """The buffers, shaped as the prefill's states (whatever dtype the kernels keep them in); once per target."""
        if self.state:
            return
        device = next(iter(states.values()))[0].device
        self.keep = torch.zeros(self.rows, self.width, dtype=torch.long, device=device)
        self.accepted = torch.zeros(self.rows, dtype=torch.long, device=device)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, (conv, rec) in states.items():  # layers whose states agree in shape share one stacked buffer
            groups.setdefault(self._shape_key(conv, rec), []).append(i)
        for key, members in groups.items():
            conv, rec = states[members[0]]
            made = []
            for _ in range(2):  # committed, pending
                c = torch.zeros(len(members), self.rows, *conv.shape[1:], dtype=conv.dtype, device=device)
                r = torch.zeros(len(members), self.rows, *rec.shape[1:], dtype=rec.dtype, device=device)
                made.append((c, r))
            self._stacks.append((made[0][0], made[1][0]))
            self._stacks.append((made[0][1], made[1][1]))
            for j, i in enumerate(members):
                self.state[i] = (made[0][0][j], made[0][1][j])
                self.pending[i] = (made[1][0][j], made[1][1][j])
            n = self.rows * self.width
            self._scratch[key] = (torch.zeros(n, *conv.shape[1:], dtype=conv.dtype, device=device),
                                  torch.zeros(n, *rec.shape[1:], dtype=rec.dtype, device=device))
        for i in states:
            self.saved[i] = torch.zeros(self.rows, self.width, hidden, dtype=dtype, device=device)

    @staticmethod
    def _shape_key(conv: torch.Tensor, rec: torch.Tensor) -> tuple[Any, ...]:
        return tuple(conv.shape[1:]), conv.dtype, tuple(rec.shape[1:]), rec.dtype

    def _load(self, index: int, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s scratch ``[n, ...]`` (``n`` a multiple of ``rows``), each row's committed state repeated
        ``n / rows`` times, loaded into the mixer's cache layer; returns the scratch (the call's final state)."""
        committed = self.state[index]
        scratch = self._scratch[self._shape_key(*committed)]
        conv, rec = scratch[0][:n], scratch[1][:n]
        for s, c in ((conv, committed[0]), (rec, committed[1])):
            s.view(rows, n // rows, *s.shape[1:]).copy_(c[:rows].unsqueeze(1).expand(rows, n // rows, *c.shape[1:]))
        load_state(self.layers[index], conv, rec)
        return conv, rec

    # ------------------------------------------------------------------------------------------------ the plans

    def prefill(self, columns: Sequence[Sequence[int]], forward: Callable[[], Any], hidden: int,
                dtype: torch.dtype) -> Any:
        """Run ``forward`` (the static target's prefill) with each row's real ``columns[b]`` alone in the recurrent
        layers (eager); their states become rows ``0 .. len(columns) - 1`` of the committed state."""
        with self.mixers.prefill(columns):
            out = forward()
        states = {i: s for i, s in self.mixers.state.items() if s is not None}
        self._allocate(states, hidden, dtype)
        rows = len(columns)
        for i, (conv, rec) in states.items():
            self.state[i][0][:rows].copy_(conv)
            self.state[i][1][:rows].copy_(rec)
        self.mixers.state = {i: None for i in self.mixers.mixers}
        self._adopt = False
        return out

    @contextmanager
    def verify(self, rows: int, width: int, depth: int, parents: torch.Tensor, depths: torch.Tensor
               ) -> Iterator[None]:
        """Inside (within the bucket's step), a backbone forward over ``[rows, width]`` verification columns runs each
        recurrent mixer over every column's root path from the committed state (module docstring). ``parents`` /
        ``depths``: the static target's ``[R, W_max - 1]`` round buffers."""
        nodes, length, n = width - 1, depth + 1, rows * width
        # built once per step on the device (the parents / depths buffers hold this round's trees), for every layer
        paths = root_paths(parents[:rows, :nodes], depths[:rows, :nodes], length) if nodes else None

        def step(index: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
            dim = int(hidden.shape[-1])
            self.saved[index][:rows, :width].copy_(hidden)
            final = self._load(index, n, rows)
            if paths is None:  # [rows, 1]: the one-token decode; the root is kept, so its state is the new state
                out = self.mixers.call(index, hidden, **kwargs)
                for dst, src in zip(self.pending[index], final):
                    dst[:rows].copy_(src)
                return out
            path, real, col_depth = paths
            x = hidden.gather(1, path.view(rows, n * length // rows, 1).expand(-1, -1, dim))  # [rows, W * L, H]
            x = (x * real.view(rows, -1, 1).to(x.dtype)).view(n, length, dim)
            y = self.mixers.call(index, x, **kwargs).view(rows, width, length, -1)
            return y.gather(2, col_depth.view(rows, width, 1, 1).expand(-1, -1, 1, y.shape[-1])).squeeze(2)

        with self.mixers.patched(step):
            yield

    def verified(self, width: int) -> None:
        """Note the width of the verification that just ran (host side: a replay runs no Python)."""
        self._adopt = width == 1

    def commit_step(self, rows: int, span: int) -> Callable[[], None]:
        """Bucket ``("commit", rows, span)``'s step over :attr:`keep` / :attr:`accepted` (module docstring)."""
        def step() -> None:
            keep, accepted = self.keep[:rows, :span], self.accepted[:rows]
            for index in self.state:
                saved = self.saved[index][:rows]
                x = saved.gather(1, keep.unsqueeze(-1).expand(rows, span, saved.shape[-1]))  # [rows, S, H]
                conv, rec = self.pending[index]
                for n in range(1, span + 1):
                    final = self._load(index, rows, rows)
                    self.mixers.call(index, x[:, :n])
                    hit = accepted + 1 == n
                    for dst, src in zip((conv, rec), final):
                        where = hit.view(rows, *[1] * (src.dim() - 1))
                        if n == 1:
                            dst[:rows].copy_(src)  # every row's path has at least the root
                        else:
                            dst[:rows].copy_(torch.where(where, src, dst[:rows]))
        return step

    def commit_inline(self, rows: int, width: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """:meth:`commit` inside a step of the static target (its fused round, verification ``width`` wide: static
        per bucket): the commit step's program run in place of its bucket, then the pending state adopted."""
        self._advance(rows, keep, accepted, None if width == 1 else lambda span: self.commit_step(rows, span)())

    def save(self, rows: int) -> Callable[[], None]:
        """Snapshot the first ``rows`` rows' committed state; returns the call that writes it back (a rehearsed
        recording of a fused round runs between the two)."""
        saved = [(committed, committed[:, :rows].clone()) for committed, _pending in self._stacks]

        def restore() -> None:
            for committed, copy in saved:
                committed[:, :rows].copy_(copy)
        return restore

    def commit(self, graphs: StepGraphs, rows: int, keep: torch.Tensor, accepted: torch.Tensor) -> None:
        """Advance the committed state of the first ``rows`` rows over their accepted paths (``keep [rows, S]``
        verification columns, root first; ``accepted [rows]`` nodes): the commit bucket of ``graphs`` (device
        tensors only), then the pending state copied over the committed one."""
        self._advance(rows, keep, accepted, None if self._adopt else lambda span: graphs.run(("commit", rows, span)))
        self._adopt = False

    def _advance(self, rows: int, keep: torch.Tensor, accepted: torch.Tensor,
                 run_commit: Callable[[int], Any] | None) -> None:
        """The commit: the accepted paths staged and ``run_commit(span)`` run (the commit step, as a bucket or
        inline; ``None`` after a one-token step, whose state is pending already), then the pending state adopted."""
        if run_commit is not None:
            # keep is as wide as the deepest draft allows; a path has at most one column per verified column
            span = min(int(keep.shape[1]), self.width)
            self.keep[:rows, :span].copy_(keep[:, :span])
            self.accepted[:rows].copy_(accepted)
            run_commit(span)
        for committed, pending in self._stacks:
            committed[:, :rows].copy_(pending[:, :rows])

    def keep_rows(self, kept: Sequence[int]) -> None:
        """Only rows ``kept`` go on (moved to the front, in order; addresses kept)."""
        if not self._stacks or list(kept) == list(range(len(kept))):
            return
        idx = device_tensor(list(kept), torch.long, self.keep.device)
        for committed, _pending in self._stacks:
            committed[:, : len(kept)] = committed.index_select(1, idx)
