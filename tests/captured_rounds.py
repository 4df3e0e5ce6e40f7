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
* :func:`guess_selector_drafts`: DFlash2 drafts (eager and static alike) that guess a known continuation.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import spiffy.arspec.batch as batch_module
from spiffy.arspec import ARSpecConfig, SamplingConfig, SelectorDraft, as_drafter, speculative_generate
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

    # the class that defines the drafter's forward (a DFlash2 model inherits DFlash's): patched there, a subclass
    # still runs its family's own forward, as the static drafter requires
    owner = next(c for c in type(drafter_model).__mro__ if "forward" in vars(c))
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(owner, "forward", paused(owner.forward))
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


def _recorded(draft: Any) -> Any:
    """A copy of one row's draft as a tuple of tensors (logits, or candidates / first / following)."""
    if draft is None:
        return None
    parts = (draft.candidates, draft.first, draft.following) if isinstance(draft, SelectorDraft) else (draft,)
    return tuple(p.clone() for p in parts)


class RecordedDrafts:
    """Every round's drafts of the eager drafters (``stages.draft``) and of the static one (``CapturedRounds.draft``),
    recorded while ``mp`` patches them (logits, or a DFlash2 drafter's selector scores)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.eager: list[list[Any]] = []
        self.static: list[list[Any]] = []
        eager_draft, static_draft = batch_module.draft, CapturedRounds.draft

        def eager(*a: Any, **k: Any) -> Any:
            out = eager_draft(*a, **k)
            self.eager.append([_recorded(d) for d in out])
            return out

        def static(rounds: Any, *a: Any, **k: Any) -> Any:
            out = static_draft(rounds, *a, **k)
            self.static.append([_recorded(d) for d in out])
            return out

        mp.setattr(batch_module, "draft", eager)
        mp.setattr(CapturedRounds, "draft", static)

    def assert_close(self, dtype: torch.dtype) -> None:
        """As many static rounds as eager ones, each row's draft of the same shapes and within the tolerance (a
        selector's candidates equal: integer tensors are compared exactly)."""
        assert self.static and len(self.static) == len(self.eager)
        for e_round, s_round in zip(self.eager, self.static):
            assert [None if d is None else [tuple(p.shape) for p in d] for d in e_round] == [
                None if d is None else [tuple(p.shape) for p in d] for d in s_round]
            for e, s in zip(e_round, s_round):
                for e_part, s_part in zip(e or (), s or ()):
                    torch.testing.assert_close(s_part, e_part, rtol=0, atol=DRAFT_TOLERANCE[dtype])


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


def guess_selector_drafts(mp: pytest.MonkeyPatch, prompt_len: int, continuation: list[int], second: set[int],
                          holes: bool) -> None:
    """Make every DFlash2 draft (eager and captured rounds alike) guess ``continuation`` (AR's output): candidate 0
    of each depth becomes the continuation's token and scores best after every parent, except at depths whose
    continuation index is in ``second``, where candidate 1 scores best (the chain misses, the tree branches).
    ``holes``: the other candidates (and candidate 1 where it does not branch) get score ``-inf`` (probability 0:
    never in a tree). Both the eager drafter's drafts and the static drafter's (the captured rounds') guess."""
    eager, static = batch_module.draft, CapturedRounds.draft

    def guessed(out: list, roots: Any) -> list:
        out = list(out)
        for b, (d, (_tok, pos)) in enumerate(zip(out, roots)):
            if not isinstance(d, SelectorDraft) or int(d.candidates.shape[1]) < 2:
                continue
            cands, first, following = d.candidates.clone(), d.first.clone(), d.following.clone()
            for depth in range(cands.shape[0]):
                i = pos + 1 + depth - prompt_len
                scores = first if depth == 0 else following[depth - 1]
                if 0 <= i < len(continuation):
                    cands[depth, 0] = continuation[i]
                    scores[..., 0] = 8.0 if i not in second else 6.0
                    scores[..., 1] = 8.0 if i in second else scores[..., 1]
                if holes:  # one candidate per depth, two where the guess branches
                    scores[..., 2 if i in second else 1 :] = float("-inf")
            out[b] = SelectorDraft(cands, first, following, d.vocab_size)
        return out

    mp.setattr(batch_module, "draft", lambda drafters, roots, depths: guessed(eager(drafters, roots, depths), roots))
    mp.setattr(CapturedRounds, "draft", lambda self, roots, depths: guessed(static(self, roots, depths), roots))
