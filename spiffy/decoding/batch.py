"""The dLLM decoding loop, batch first: every method decodes a batch of rows, a single prompt is a batch of one.

Two kinds of session share the work:

* one **forward session** holds the whole (left-padded) batch and makes every model call: the block-start
  refresh/commit for all rows at once, then one :meth:`~spiffy.decoding.session.DecodeSession.forward_states` per
  iteration for every row still decoding its block (:func:`forward_rows`);
* one **row session** per prompt, batch 1 and unpadded, exactly the session the prompt would get alone. It never
  calls the model; it holds the row's state, its own generator, schedule and stop flag, and applies the baseline
  rule to the logits the forward session computed for it.

A single prompt is the batch of one whose forward session is also its row session (``row_sessions ==
[forward_session]``): the session calls the model on its own state exactly as it always did (same shapes, no
padding, no cache gather) and applies its own rule. The same holds for a batched session decoded by its own rule
(one generator for the batch, the official scripts' batched sampling): ``run_baseline(make_session(model, ids))``.

:func:`decode_blocks` is the one loop: blocks in order, **block starts synchronised** (the block-start call stays one
batched call computed on each row's own state; a row whose block is finished waits), and a method's iteration
(:func:`run_baseline_batch`: one forward, one transition per row; Spiffy, :mod:`spiffy.selfspec.runtime`: drafts,
one forward, a walk per row) until every row has finished the block. Every iteration advances each active row by at
least one step, and a block takes at most :meth:`~spiffy.decoding.session.DecodeSession.max_block_steps` steps.

The seed rule, for every batched dLLM path: ``seeds`` (one per row) gives row ``r`` the generator a single-prompt
session creates for ``seed=seeds[r]``; else a given ``generator`` supplies one seed per row, drawn in row order; else
every row is seeded with ``config.seed``, as that prompt alone would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from spiffy.decoding.session import BaselineStats, DecodeSession, StepObserver, StepRecord, close_block
from spiffy.errors import ConfigError, StepLimitError
from spiffy.torch_utils import device_tensor


def row_generators(
    batch_size: int,
    device: torch.device | str,
    seeds: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[torch.Generator | None]:
    """Row ``r``'s random generator under the seed rule of the module docstring (``None`` = the row session seeds
    itself from ``config.seed``, as a single-prompt session does).

    Raises:
        ConfigError: ``seeds`` does not have one entry per row.
    """
    if seeds is not None and len(seeds) != batch_size:
        raise ConfigError(
            f"seeds has {len(seeds)} entries for a batch of {batch_size} prompts; fix: pass one seed per prompt"
        )
    if seeds is None and generator is not None:
        # one seed per row drawn from the given generator (e.g. the global one) in row order: reproducible
        seeds = [int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)) for _ in range(batch_size)]
    if seeds is None:
        return [None] * batch_size
    gens: list[torch.Generator | None] = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
        gens.append(gen)
    return gens


@dataclass(frozen=True)
class RowPlace:
    """Where a row session sits in the forward session.

    Attributes:
        pad: left padding columns (row column ``j`` is forward column ``pad + j``).
        block_offset: the row's block ``b`` is the forward session's block ``b + block_offset`` (SDAR rows of
            different prompt lengths may have one decode block fewer than the longest layout).
    """

    pad: int
    block_offset: int


def row_layout(forward_session: DecodeSession, row_sessions: Sequence[DecodeSession]) -> list[RowPlace]:
    """Each row's place in the forward session, checked: every block and logits window of the row is the forward
    session's, shifted by the padding, and the row's state is the forward row's unpadded tail. A forward session
    that is its own only row session (a single prompt, or a batch decoded by its own rule) sits at ``RowPlace(0, 0)``.

    Raises:
        ConfigError: the layouts do not line up (another prompt, block layout or batch size).
    """
    fwd = forward_session
    if len(row_sessions) == 1 and row_sessions[0] is fwd:
        return [RowPlace(0, 0)]
    b = int(fwd.x.shape[0])
    if len(row_sessions) != b:
        raise ConfigError(f"{len(row_sessions)} row sessions for a batch-{b} forward session; fix: one row session per prompt")
    places = []
    for r, sess in enumerate(row_sessions):
        if sess is fwd or sess.x.dim() != 2 or sess.x.shape[0] != 1:
            raise ConfigError(
                f"row session {r} must be a batch-1 session of its own, got x of shape {tuple(sess.x.shape)}; fix: "
                "one make_session per prompt (or pass the forward session as its only row session)"
            )
        pad = int(fwd.x.shape[1]) - int(sess.x.shape[1])
        off = int(fwd.num_blocks) - int(sess.num_blocks)
        if pad < 0 or off < 0 or sess.block_length != fwd.block_length:
            raise ConfigError(f"row session {r} has another block layout than the forward session")
        for blk in range(int(sess.num_blocks)):
            s, e = sess.block_bounds(blk)
            fs, fe = fwd.block_bounds(blk + off)
            if (fs, fe) != (s + pad, e + pad) or fwd.window_start(blk + off) != sess.window_start(blk) + pad:
                raise ConfigError(f"row session {r} does not line up with the forward session (left padding {pad})")
        if not torch.equal(fwd.x[r, pad:], sess.x[0].to(fwd.x.device)):
            raise ConfigError(f"row session {r}'s prompt differs from row {r} of the forward session")
        places.append(RowPlace(pad, off))
    return places


def is_stopped(session: DecodeSession) -> bool:
    """Whether ``session``'s generation ended before its last block (SDAR stop tokens)."""
    return bool(getattr(session, "stopped", False))


class DecodeRow:
    """One row session's progress through :func:`decode_blocks`.

    Args:
        index: the row's batch row in the forward session.
        session: the row session (or the forward session itself, for a batch of one).
        place: its :class:`RowPlace`.
        drives_forward: ``session`` is the forward session (it makes the model calls on its own state).
        stats: the row's counters (anything with ``nfe``, ``steps`` and ``steps_per_block``, e.g.
            :class:`~spiffy.decoding.session.BaselineStats`); ``nfe`` counts the calls that served the row, which
            is what the same prompt decoded alone makes.
        observer: called with a :class:`~spiffy.decoding.session.StepRecord` after every transition.
        progress: called with ``1`` after every transition.
    """

    def __init__(self, index: int, session: DecodeSession, place: RowPlace, stats: Any, *, drives_forward: bool,
                 observer: StepObserver | None = None, progress: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.session = session
        self.place = place
        self.stats = stats
        self.drives_forward = drives_forward  # the row session is the forward session (a batch of one)
        self.observer = observer
        self.progress = progress
        self.step = 0

    @property
    def stopped(self) -> bool:
        """The row's generation ended before its last block (SDAR stop tokens)."""
        return is_stopped(self.session)

    def block(self, forward_block: int) -> int:
        """The row's own block at the forward session's ``forward_block`` (negative: the row's prompt still covers
        that block, as an SDAR row with a block-aligned prompt beside unaligned ones)."""
        return forward_block - self.place.block_offset

    def done(self, forward_block: int) -> bool:
        """Whether the row has nothing (left) to decode in ``forward_block``."""
        blk = self.block(forward_block)
        return blk < 0 or self.session.block_finished(blk, self.step, self.session.x)

    def own(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's ``[1, W, V]`` slice of the forward session's ``[B, W, V]`` logits (all of them, the same
        tensor, when the row session is the forward session)."""
        if self.drives_forward:
            return logits
        return logits[self.index : self.index + 1].to(self.session.x.device)

    def apply(self, forward_block: int, logits: torch.Tensor) -> torch.Tensor:
        """One baseline transition of the row on ``logits`` computed on its current state; returns the new state."""
        sess = self.session
        info = sess.step_info(self.block(forward_block), self.step)
        x_next = sess.transition(sess.x, logits, info)
        if self.observer is not None:
            self.observer(StepRecord(info, sess.x, logits, x_next, sess.transition_probs(logits)))
        sess.x = x_next
        self.step += 1
        self.after_step(logits, info.window_start)
        if self.progress is not None:
            self.progress(1)
        return x_next

    def after_step(self, logits: torch.Tensor, window_start: int) -> None:
        """Hook: ``logits`` (window starting at ``window_start``) just drove a transition. Default: nothing."""

    def first_step(self, forward_block: int, logits: torch.Tensor) -> None:
        """The block's first step on the block-start logits (a plain baseline step)."""
        self.apply(forward_block, logits)

    def start_block(self, fwd: DecodeSession, forward_block: int) -> None:
        """The rule's block-start bookkeeping, and the row's state copied into the forward session."""
        self.step = 0
        if self.drives_forward:  # its own begin_block does the bookkeeping
            return
        self.session.begin_block_rule(self.block(forward_block))
        fwd.x[self.index, self.place.pad :] = self.session.x[0]

    def padded(self, fwd: DecodeSession, states: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` the row's candidate states ``[N, T_r]`` behind its padding columns of the forward session."""
        pad = self.place.pad
        if pad == 0:
            return states.to(fwd.x.device)
        pad_ids = fwd.x[self.index : self.index + 1, :pad].expand(states.shape[0], pad)
        return torch.cat([pad_ids, states.to(fwd.x.device)], dim=1)


def make_rows(
    forward_session: DecodeSession,
    row_sessions: Sequence[DecodeSession],
    stats: Callable[[], Any],
    observer: StepObserver | None = None,
    progress: Callable[[int], None] | None = None,
    row_class: type[DecodeRow] = DecodeRow,
    **row_kwargs: Any,
) -> list[DecodeRow]:
    """One ``row_class`` per row session, placed by :func:`row_layout`, each with fresh counters ``stats()``.

    Raises:
        ConfigError: the layouts do not line up, or an ``observer`` for several row sessions (its records would
            not say which row they belong to).
    """
    if observer is not None and len(row_sessions) > 1:
        raise ConfigError("observer= is not supported with a batch; fix: decode the prompts one at a time")
    places = row_layout(forward_session, row_sessions)
    return [
        row_class(r, sess, place, stats(), drives_forward=sess is forward_session, observer=observer,
                  progress=progress, **row_kwargs)
        for r, (sess, place) in enumerate(zip(row_sessions, places))
    ]


def forward_rows(fwd: DecodeSession, requests: Sequence[tuple[DecodeRow, torch.Tensor]]) -> list[torch.Tensor]:
    """``F`` for every row's candidate states in **one** model call.

    Args:
        fwd: the forward session.
        requests: ``(row, states [N_r, T_r])`` per active row.
    Returns:
        ``[N_r, W, V]`` aligned window logits per request, on the row session's device. A row session that is the
        forward session passes its states as they are (``rows=None``: the call the session makes alone).
    """
    if len(requests) == 1 and requests[0][0].drives_forward:
        return [fwd.forward_states(requests[0][1])]
    packed = torch.cat([row.padded(fwd, states) for row, states in requests], dim=0)
    owners = device_tensor([row.index for row, states in requests for _ in range(int(states.shape[0]))],
                           torch.long, fwd.x.device)
    out = fwd.forward_states(packed, rows=owners)  # [sum N_r, W, V]
    outs, offset = [], 0
    for row, states in requests:
        n = int(states.shape[0])
        outs.append(out[offset : offset + n].to(row.session.x.device))
        offset += n
    return outs


def decode_blocks(fwd: DecodeSession, rows: Sequence[DecodeRow], iterate: Callable[[int, list[DecodeRow]], None]) -> int:
    """Decode every block of every row: the loop of every dLLM method (module docstring).

    Args:
        fwd: the forward session (prepared).
        rows: one :class:`DecodeRow` per row session (``rows[i].index == i``).
        iterate: ``(forward block, active rows) -> None``: advances every active row by at least one step (and
            counts the model calls it makes in each row's ``stats.nfe``).
    Returns:
        Model calls made for the whole batch (``fwd.nfe``).
    Raises:
        StepLimitError: a block still unfinished after :meth:`~spiffy.decoding.session.DecodeSession.max_block_steps`
            iterations (a rule that never ends a block).
    """
    for block in range(fwd.num_blocks):
        live = [row for row in rows if row.block(block) >= 0]
        for row in live:
            row.start_block(fwd, block)
        waiting = [row for row in live if not row.done(block)]
        logits = None
        if any(not row.stopped for row in live):  # once every row stopped nothing is left to commit or decode
            logits = fwd.begin_block(block)
            for row in live:  # what the row alone makes at its block start (none once it stopped)
                row.stats.nfe += row.session.begin_block_calls(row.block(block))
        if logits is not None:  # block-start logits drive the first step of every row that has one
            for row in waiting:
                row.first_step(block, row.own(logits))
        bound = max((row.session.max_block_steps() for row in live), default=0)
        for _ in range(bound + 1):
            active = [row for row in live if not row.done(block)]
            if not active:
                break
            iterate(block, active)
        else:
            raise StepLimitError(
                f"block {block} is still unfinished after {bound} steps: the decoding rule never ended it; fix: report "
                "it with the model and configuration (a model proposing the mask token forever?)"
            )
        for row in live:
            close_block(row.session, row.block(block), row.step, row.stats)
    fwd.finish()
    for row in rows:
        if not row.drives_forward:
            row.session.finish()
    return int(fwd.nfe)


def run_baseline_batch(
    forward_session: DecodeSession,
    row_sessions: Sequence[DecodeSession],
    progress: Callable[[int], None] | None = None,
    observer: StepObserver | None = None,
) -> tuple[list[BaselineStats], int]:
    """Decode every row with the plain baseline loop (one forward per step); ``row_sessions[r].x`` holds row ``r``'s
    final state afterwards.

    Args:
        forward_session: a prepared batch-``B`` session over the left-padded prompts (it makes every model call;
            its own rule and generator are never used unless it is its own only row session).
        row_sessions: ``B`` prepared batch-1 sessions, row ``r`` = prompt ``r`` unpadded with its own generator; or
            ``[forward_session]`` (a single prompt, or a batch decoded by its own rule).
        progress: called with ``1`` after every transition of a row.
        observer: called with a :class:`~spiffy.decoding.session.StepRecord` after every transition (calibration
            records trajectories); one row session only.
    Returns:
        ``(per-row BaselineStats, model calls made for the whole batch)``.
    """
    fwd = forward_session
    rows = make_rows(fwd, row_sessions, BaselineStats, observer, progress)

    def one_forward(block: int, active: list[DecodeRow]) -> None:
        for row in active:  # an observer has seen them: free them before the forward
            row.session.forget_transition_probs()
        for row, logits in zip(active, forward_rows(fwd, [(row, row.session.x) for row in active])):
            row.stats.nfe += 1
            row.apply(block, logits)

    nfe = decode_blocks(fwd, rows, one_forward)
    return [row.stats for row in rows], nfe


def run_baseline(session: DecodeSession, observer: StepObserver | None = None,
                 progress: Callable[[int], None] | None = None) -> BaselineStats:
    """Decode every block of ``session`` with the plain baseline loop: the batch of one of :func:`run_baseline_batch`
    (a batched session decodes by its own rule: one generator for the batch, as the official scripts).

    Args:
        session: a prepared session; ``session.x`` holds the final state afterwards.
        observer: called with a :class:`~spiffy.decoding.session.StepRecord` after every transition.
        progress: called with the number of steps just taken (for progress bars).
    Returns:
        :class:`~spiffy.decoding.session.BaselineStats` (``nfe`` equals ``session.nfe`` at the end).
    """
    stats, _ = run_baseline_batch(session, [session], progress=progress, observer=observer)
    return stats[0]


__all__ = [
    "DecodeRow",
    "RowPlace",
    "decode_blocks",
    "forward_rows",
    "is_stopped",
    "make_rows",
    "row_generators",
    "row_layout",
    "run_baseline",
    "run_baseline_batch",
]
