"""What the captured AR path's tests share: host reads per captured round, and every round's drafts.

* :func:`captured_round_syncs`: host reads per captured round, outside the model forwards (the count issue 36
  bounds: at most 2 per round). It runs a generation with the target's and the drafter's forwards paused in the counter
(a forward is not the round's bookkeeping) and counts every read of the drafting stage and of
:meth:`~spiffy.arspec.captured_rounds.CapturedRounds.round` (tree build, mask, walk, commit, the drafter's next context),
closing a round at each ``round`` call.
* :class:`RecordedDrafts`: every round's drafts of the eager drafters and of a static one, to compare within a
  rounding tolerance (the static drafters' padded keys sum attention in another order).
* :data:`DRAFT_TOLERANCE`: that tolerance per dtype; :func:`prompt_ids`: a seeded random prompt.
* :func:`rejection_round_syncs`: :func:`captured_round_syncs` of a generation under the rejection rule at T > 0.
* :func:`assert_ragged_batch`: what a ragged batch's captured rows must equal (the static drafters' batch tests).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import spiffy.arspec.batch as batch_module
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.arspec.captured_rounds import CapturedRounds
from spiffy.bench.syncs import SyncCounter


class RoundCounter(SyncCounter):
    """A :class:`SyncCounter` that does not count while ``paused`` (inside the model forwards)."""

    paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def captured_round_syncs(target: Any, drafter_model: Any, generate: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``(generate()'s result, host reads of each captured round)`` with ``target``'s backbone and
    ``drafter_model``'s forwards not counted."""
    counter = RoundCounter()
    per_round: list[int] = []

    def counting(fn: Callable, closes_round: bool) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            with counter:
                out = fn(*a, **k)
            if closes_round:
                per_round.append(counter.total)
                counter.reset()
            return out
        return run

    def paused(fn: Callable) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            counter.paused = True
            try:
                return fn(*a, **k)
            finally:
                counter.paused = False
        return run

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(type(drafter_model), "forward", paused(type(drafter_model).forward))
        mp.setattr(type(target.model), "forward", paused(type(target.model).forward))
        mp.setattr(batch_module, "draft", counting(batch_module.draft, False))
        mp.setattr(CapturedRounds, "draft", counting(CapturedRounds.draft, False))
        mp.setattr(CapturedRounds, "round", counting(CapturedRounds.round, True))
        result = generate()
    finally:
        mp.undo()
    return result, per_round


#: draft logits of the static and the eager drafters (|logit| < 10 on the tiny drafters): a few ulps apart
DRAFT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-11}


def prompt_ids(seed: int, length: int) -> list[int]:
    """A random prompt of ``length`` token ids below 250 (``seed``)."""
    return torch.randint(0, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class RecordedDrafts:
    """Every round's drafts of the eager drafters (``stages.draft``) and of the static one (``CapturedRounds.draft``),
    recorded while ``mp`` patches them."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.eager: list[list[torch.Tensor | None]] = []
        self.static: list[list[torch.Tensor | None]] = []
        eager_draft, static_draft = batch_module.draft, CapturedRounds.draft

        def eager(*a: Any, **k: Any) -> Any:
            out = eager_draft(*a, **k)
            self.eager.append([None if d is None else d.clone() for d in out])
            return out

        def static(rounds: Any, *a: Any, **k: Any) -> Any:
            out = static_draft(rounds, *a, **k)
            self.static.append([None if d is None else d.clone() for d in out])
            return out

        mp.setattr(batch_module, "draft", eager)
        mp.setattr(CapturedRounds, "draft", static)

    def assert_close(self, dtype: torch.dtype) -> None:
        """As many static rounds as eager ones, each row's draft of the same shape and within the tolerance."""
        assert self.static and len(self.static) == len(self.eager)
        for e_round, s_round in zip(self.eager, self.static):
            assert [None if d is None else tuple(d.shape) for d in e_round] == [
                None if d is None else tuple(d.shape) for d in s_round]
            for e, s in zip(e_round, s_round):
                if e is not None:
                    torch.testing.assert_close(s, e, rtol=0, atol=DRAFT_TOLERANCE[dtype])


def rejection_round_syncs(target: Any, drafter_model: Any, prompt: list[int], method: str, **knobs: Any) -> list[int]:
    """Host reads of each captured round of a 12-token generation by ``method`` under the rejection rule at
    T = 0.9 (seed 4; ``knobs``: more :class:`ARSpecConfig` fields), checked to have made its 12 tokens."""
    config = ARSpecConfig(method=method, max_new_tokens=12, accept="rejection",
                          sampling=SamplingConfig(temperature=0.9, seed=4), **knobs)
    res, per_round = captured_round_syncs(target, drafter_model, lambda: speculative_generate(
        target, as_drafter(drafter_model), prompt, config, compile=True))
    assert len(res.tokens) == 12 and len(per_round) == res.rounds
    return per_round


def assert_ragged_batch(eager: list[Any], captured: list[Any], lengths: list[int], ars: list[list[int]], accept: str,
                        drafts: RecordedDrafts, static: Any, dtype: torch.dtype) -> None:
    """A ragged batch decoded captured == eager: tokens, acceptance lengths and row lengths (under the coupled rule
    also plain AR's tokens, with deep accepted paths); the drafts within :data:`DRAFT_TOLERANCE`; and rows that left
    the batch on the static path (``static``: the static drafter, its buckets ``(rows, block)``)."""
    assert [r.tokens for r in captured] == [r.tokens for r in eager]
    assert [r.acceptance_lengths for r in captured] == [r.acceptance_lengths for r in eager]
    assert [len(r.tokens) for r in captured] == lengths
    if accept == "coupled":  # (the rejection rule's tokens follow their own draws, not AR's: few guesses accepted)
        assert [r.tokens for r in captured] == ars and max(max(r.acceptance_lengths) for r in captured) > 2
    drafts.assert_close(dtype)
    rows = {rows for rows, _block in static.graphs.stats.runs}
    assert 3 in rows and min(rows) < 3  # rows left the batch on the static path
