"""Batched baseline decoding: several prompts side by side, row ``r`` decoded exactly as prompt ``r`` alone.

A batched session's own rule (:func:`~spiffy.decoding.session.run_baseline` on a ``[B, T]`` session) follows the
official scripts: one random generator shared by the batch, Dream's batch-averaged schedule, one stop token ending
every row. That reproduces the reference's batched output, but row ``r`` of it is not what prompt ``r`` gives alone.
The front door (:func:`spiffy.api.generate`) decodes batches here instead, with two kinds of session:

* one **forward session** holds the whole left-padded batch and makes every model call (the block-start
  refresh/commit for all rows at once, then one :meth:`~spiffy.decoding.session.DecodeSession.forward_states` per
  step for every row still decoding its block);
* one **row session** per prompt, batch 1 and unpadded, exactly the session the prompt would get alone. It never
  calls the model; it holds the row's state, its own generator, schedule and stop flag, and applies the baseline
  rule to the logits the forward session computed for it.

Rows whose block is finished wait until every row has finished the block (block starts are synchronised, so the
block-start call stays one batched call computed on each row's own state). Batched Spiffy
(:mod:`spiffy.selfspec.batch`) uses the same layout (:func:`row_layout`), the same seed rule
(:func:`row_generators`) and the same block-start accounting, so its rows equal these rows and both equal the
prompts decoded alone.

The seed rule, for every batched dLLM path: ``seeds`` (one per row) gives row ``r`` the generator a single-prompt
session creates for ``seed=seeds[r]``; else a given ``generator`` supplies one seed per row, drawn in row order; else
every row is seeded with ``config.seed``, as that prompt alone would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.factory import as_batch, make_session
from spiffy.decoding.session import BaselineStats, DecodeSession, close_block
from spiffy.errors import ConfigError


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


def make_row_sessions(
    model: Any,
    input_ids: Any,
    attention_mask: torch.Tensor | None,
    config: DecodeConfig,
    generators: Sequence[torch.Generator | None],
    tokenizer: Any = None,
) -> list[DecodeSession]:
    """One unpadded batch-1 session per prompt of the left-padded ``input_ids`` ``[B, P]`` (``attention_mask``
    ``[B, P]``, 0 = padding), each with its own generator."""
    ids = as_batch(input_ids)
    am = None if attention_mask is None else attention_mask.to(ids.device).bool()
    rows: list[DecodeSession] = []
    for r in range(ids.shape[0]):
        prompt = ids[r] if am is None else ids[r][am[r]]
        rows.append(make_session(model, prompt[None], config, tokenizer=tokenizer, generator=generators[r]))
    return rows


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
    session's, shifted by the padding, and the row's state is the forward row's unpadded tail.

    Raises:
        ConfigError: the layouts do not line up (another prompt, block layout or batch size).
    """
    fwd = forward_session
    b = int(fwd.x.shape[0])
    if len(row_sessions) != b:
        raise ConfigError(f"{len(row_sessions)} row sessions for a batch-{b} forward session; fix: one row session per prompt")
    places = []
    for r, sess in enumerate(row_sessions):
        if sess.x.dim() != 2 or sess.x.shape[0] != 1:
            raise ConfigError(f"row session {r} must be batch 1, got x of shape {tuple(sess.x.shape)}")
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


@dataclass
class _RowRun:
    session: DecodeSession
    place: RowPlace
    index: int
    stats: BaselineStats = field(default_factory=BaselineStats)
    step: int = 0

    def block(self, forward_block: int) -> int:
        """The row's own block index at the forward session's ``forward_block`` (negative: not one of its blocks)."""
        return forward_block - self.place.block_offset

    def done(self, forward_block: int) -> bool:
        blk = self.block(forward_block)
        return blk < 0 or self.session.block_finished(blk, self.step, self.session.x)

    def apply(self, forward_block: int, logits: torch.Tensor) -> None:
        """One baseline transition of the row on its ``[1, W, V]`` logits."""
        sess = self.session
        info = sess.step_info(self.block(forward_block), self.step)
        sess.x = sess.transition(sess.x, logits, info)
        self.step += 1


def run_baseline_batch(
    forward_session: DecodeSession,
    row_sessions: Sequence[DecodeSession],
    progress: Callable[[int], None] | None = None,
) -> tuple[list[BaselineStats], int]:
    """Decode every row with the baseline rule; ``row_sessions[r].x`` holds row ``r``'s final state afterwards.

    Args:
        forward_session: a prepared batch-``B`` session over the left-padded prompts (it makes every model call;
            its own rule and generator are never used).
        row_sessions: ``B`` prepared batch-1 sessions, row ``r`` = prompt ``r`` unpadded with its own generator.
        progress: called with ``1`` after every batched model call that advanced the rows.
    Returns:
        ``(per-row BaselineStats, model calls made for the whole batch)``. A row's ``nfe`` counts the calls that
        served it, which is what the same prompt decoded alone makes.
    """
    places = row_layout(forward_session, row_sessions)
    fwd = forward_session
    runs = [_RowRun(sess, place, r) for r, (sess, place) in enumerate(zip(row_sessions, places))]
    for block in range(fwd.num_blocks):
        live = [run for run in runs if run.block(block) >= 0]
        for run in live:
            run.session.begin_block_rule(run.block(block))
            run.step = 0
            fwd.x[run.index, run.place.pad :] = run.session.x[0]
        waiting = [run for run in live if not run.done(block)]
        logits = None
        if any(not is_stopped(run.session) for run in live):  # nothing left to commit or decode otherwise
            logits = fwd.begin_block(block)
            for run in live:
                run.stats.nfe += run.session.begin_block_calls(run.block(block))
        if logits is not None:  # block-start logits drive the first step of every row that has one
            for run in waiting:
                run.apply(block, logits[run.index : run.index + 1])
        while True:
            active = [run for run in live if not run.done(block)]
            if not active:
                break
            states = torch.cat([_padded_state(fwd, run) for run in active], dim=0)
            owners = torch.tensor([run.index for run in active], dtype=torch.long, device=fwd.x.device)
            out = fwd.forward_states(states, rows=owners)  # [len(active), W, V]
            for i, run in enumerate(active):
                run.stats.nfe += 1
                run.apply(block, out[i : i + 1].to(run.session.x.device))
            if progress is not None:
                progress(1)
        for run in live:
            close_block(run.session, run.block(block), run.step, run.stats)
    fwd.finish()
    for run in runs:
        run.session.finish()
    return [run.stats for run in runs], int(fwd.nfe)


def _padded_state(fwd: DecodeSession, run: _RowRun) -> torch.Tensor:
    """``[1, T]`` the row's current state behind its padding columns of the forward session."""
    pad = run.place.pad
    return torch.cat([fwd.x[run.index : run.index + 1, :pad], run.session.x.to(fwd.x.device)], dim=1)


__all__ = ["RowPlace", "is_stopped", "make_row_sessions", "row_generators", "row_layout", "run_baseline_batch"]
