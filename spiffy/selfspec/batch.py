"""Batched Spiffy: several prompts decoded side by side, one model call per iteration for all of them.

Two kinds of session share the work:

* one **forward session** holds the whole left-padded batch (``[B, T]``, its padding mask, positions and caches)
  and makes every model call: the block-start refresh/commit forward for all rows at once, and each iteration's
  verification forward, in which row ``r``'s real state and its drafts are packed together with every other
  row's (``forward_states(states, rows=...)`` reads row ``r``'s padding, positions and cache rows for each state);
* one **row session** per prompt, batch 1 and unpadded, exactly the session the prompt would get alone. It never
  calls the model; it holds the row's state, its random generator, its block schedule and its stop flag, and it
  applies the baseline rule (``transition``) to the logits the forward session computed for that row.

Every row keeps its own latest distribution, ranks its own formulas, keeps its own drafts and walks them with
:func:`spiffy.verify.backend.follow` exactly like the single-prompt runtime; a row that accepts more drafts simply
takes part in fewer verification forwards. Rows whose block is finished wait (they add nothing to the forwards) until
every row has finished the block: **block starts are synchronised** across rows, so the forward session's block-start
call (the prefix/dual cache refresh, SDAR's K/V commit) stays one batched call computed exactly as the baseline's, and
each row's cache rows are always those of its own current state. Rows are independent in that call (padding is
masked out), so synchronising changes no output, only how long a fast row idles at a block end.

Layout, seeds and block-start accounting are the batched baseline's (:mod:`spiffy.decoding.batch`): a row lines up
with the forward session by its left padding (:func:`~spiffy.decoding.batch.row_layout`; an SDAR row whose prompt
fills whole blocks starts one batch block later than rows whose prompt ends inside a block), so batched Spiffy's rows
equal the batched baseline's.

Exactness: row ``r`` sees the same logits (up to the floating-point effect of padding; float64 tests compare
tokens) and consumes its own generator in the same order as the prompt decoded alone, so its tokens equal the
single-prompt Spiffy run and therefore the single-prompt baseline, at any temperature. Per-row seeds map to
generators one to one: row ``r``'s generator is the one the single-prompt session would create for ``seeds[r]``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from spiffy.decoding.batch import RowPlace, is_stopped, row_layout
from spiffy.decoding.session import DecodeSession, close_block
from spiffy.selfspec.formulas import rank_state, window_covers
from spiffy.selfspec.pruning import prune, resolve_budget, resolve_score
from spiffy.selfspec.runtime import SpeculativeStats, _instantiate_dedup, _Plan, _Walk, record_walk
from spiffy.verify.backend import follow


class _Row:
    """Per-row progress: the row session, its left padding in the forward session and its counters."""

    def __init__(self, index: int, session: DecodeSession, place: RowPlace, budget: int, score: str) -> None:
        self.index = index  # batch row in the forward session
        self.session = session
        self.pad = place.pad
        self.block_offset = place.block_offset
        self.stats = SpeculativeStats(budget=budget, score=score)
        self.P: torch.Tensor | None = None  # [1, W, V] latest distribution
        self.P_start = 0
        self.step = 0
        self.nfe = 0  # forwards that served this row (what the row alone would have made)

    @property
    def stopped(self) -> bool:
        """The row's generation ended before its last block (SDAR stop tokens)."""
        return is_stopped(self.session)

    def block(self, forward_block: int) -> int:
        """The row's own block at the forward session's ``forward_block`` (negative: the row's prompt still covers
        that block, as an SDAR row with a block-aligned prompt beside unaligned ones)."""
        return forward_block - self.block_offset

    def done(self, forward_block: int) -> bool:
        blk = self.block(forward_block)
        return blk < 0 or self.session.block_finished(blk, self.step, self.session.x)


def speculative_generate_batch(
    forward_session: DecodeSession,
    row_sessions: Sequence[DecodeSession],
    graph: Any,
    budget: int | None = None,
    *,
    score: str | None = None,
) -> tuple[list[SpeculativeStats], int]:
    """Decode every row with Spiffy self-speculation; ``row_sessions[r].x`` holds row ``r``'s final state.

    Args:
        forward_session: a prepared batch-``B`` session over the left-padded prompts (it makes every model call;
            its own rule and generator are never used).
        row_sessions: ``B`` prepared batch-1 sessions, row ``r`` = prompt ``r`` unpadded with its own generator.
        graph: the calibrated draft graph (``None`` = no drafts).
        budget: drafts kept per row and step (``None`` = the graph's tuned ``D*``, else 3; ``0`` = none).
        score: pruning score; ``None`` = the graph's recorded one, else ``"gm"``
            (:func:`~spiffy.selfspec.pruning.resolve_score`).
    Returns:
        ``(per-row SpeculativeStats, model calls made for the whole batch)``. A row's ``nfe`` counts the forwards
        that served it, which is what the same prompt decoded alone makes.
    Raises:
        ConfigError: mismatched layouts, ``budget < 0``, unknown score.
    """
    budget = resolve_budget(budget, graph)
    score = resolve_score(score, graph)
    places = row_layout(forward_session, row_sessions)
    plan = _Plan(graph)
    use_drafts = budget > 0 and bool(plan.nodes)
    rows = [_Row(i, s, p, budget, score) for i, (s, p) in enumerate(zip(row_sessions, places))]
    fwd = forward_session
    for block in range(fwd.num_blocks):
        live = [row for row in rows if row.block(block) >= 0]  # rows with a block of their own here
        for row in live:
            row.session.begin_block_rule(row.block(block))
            row.step = 0
            fwd.x[row.index, row.pad :] = row.session.x[0]
        running = [not row.done(block) for row in live]
        logits = None
        if not all(row.stopped for row in live):  # once every row stopped nothing is left to commit or decode
            logits = fwd.begin_block(block)
            for row in live:  # what the row alone makes at its block start (none once it stopped)
                row.nfe += row.session.begin_block_calls(row.block(block))
        if logits is not None:  # block-start logits: a plain baseline step for every running row
            for row, run in zip(live, running):
                if run:
                    _plain_step(row, block, logits[row.index : row.index + 1])
        while True:
            active = [row for row in live if not row.done(block)]
            if not active:
                break
            _iterate(fwd, active, block, plan, use_drafts, budget, score)
        for row in live:
            close_block(row.session, row.block(block), row.step, row.stats)
    fwd.finish()
    for row in rows:
        row.session.finish()
        row.stats.nfe = row.nfe
        row.stats.baseline_equivalent_nfe = row.nfe + row.stats.accepted_total + row.stats.reused_steps
    return [row.stats for row in rows], int(fwd.nfe)


def _plain_step(row: _Row, block: int, logits: torch.Tensor) -> None:
    t0 = time.perf_counter()
    info = row.session.step_info(row.block(block), row.step)
    row.session.x = row.session.transition(row.session.x, logits, info)
    row.P, row.P_start = logits, info.window_start
    row.step += 1
    row.stats.stage_times["walk"] += time.perf_counter() - t0


def _iterate(
    fwd: DecodeSession, active: list[_Row], block: int, plan: _Plan, use_drafts: bool, budget: int, score: str
) -> None:
    """One verification forward for every active row's real state and drafts, then each row's walk."""
    packed: list[torch.Tensor] = []
    owners: list[int] = []
    drafts: list[tuple[torch.Tensor, dict[int, int]]] = []
    for idx, row in enumerate(active):
        sess = row.session
        info = sess.step_info(row.block(block), row.step)
        x = sess.x
        draft_states: torch.Tensor | None = None
        row_of: dict[int, int] = {}
        if use_drafts and row.P is not None and window_covers(row.P_start, int(row.P.shape[1]), info.block_start, info.block_end):
            t0 = time.perf_counter()
            ranking = rank_state(
                row.P[0], x[0], info.block_start, info.block_end, row.P_start, plan.i_max, plan.j_max,
                mask_id=sess.mask_id, probs=sess.transition_probs(row.P),
            )
            t1 = time.perf_counter()
            kept = prune(plan.graph, ranking, budget, score)
            t2 = time.perf_counter()
            if kept:
                draft_states, row_of = _instantiate_dedup(x, [plan.nodes[k].pairs for k in kept], kept, ranking)
            times = row.stats.stage_times
            times["rank"] += t1 - t0
            times["prune"] += t2 - t1
            times["instantiate"] += time.perf_counter() - t2
        states = x if draft_states is None else torch.cat([x, draft_states], dim=0)
        drafts.append((states, row_of))
        r = row.index
        pad_ids = fwd.x[r : r + 1, : row.pad].expand(states.shape[0], row.pad)
        packed.append(torch.cat([pad_ids, states.to(fwd.x.device)], dim=1))
        owners.extend([r] * int(states.shape[0]))
    t0 = time.perf_counter()
    batch_rows = torch.tensor(owners, dtype=torch.long, device=fwd.x.device)
    for row in active:  # ranked already: not held during the forward
        row.session.forget_transition_probs()
    out = fwd.forward_states(torch.cat(packed, dim=0), rows=batch_rows)  # [sum N_r, W, V]
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    verify_time = time.perf_counter() - t0
    offset = 0
    for row, (states, row_of) in zip(active, drafts):
        n = int(states.shape[0])
        row_out = out[offset : offset + n].to(states.device)
        offset += n
        st = row.stats
        st.stage_times["verify"] += verify_time / len(active)
        st.forwards += 1
        st.drafts_evaluated += n - 1
        row.nfe += 1
        t1 = time.perf_counter()
        walk = _Walk(row.session, row.block(block), row.step, states, row_out, row_of, plan, None, None)
        path, _ = follow((None, 0), walk.next_state, walk.child_matching)
        row.session.x = walk.x
        row.P, row.P_start = walk.last_logits, walk.last_window_start
        row.step = walk.step
        record_walk(st, path, plan)
        st.stage_times["walk"] += time.perf_counter() - t1


__all__ = ["speculative_generate_batch"]
