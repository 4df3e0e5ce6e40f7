"""Near-tie proofs for a batched dLLM row that differs from its prompt decoded alone, and the dLLM pieces every
dLLM proof shares (recording transitions, judging the first differing one).

In float32/float64 row ``r`` of a batch equals prompt ``r`` decoded alone, token for token. In bfloat16/float16 the
batched forward computes a row with another reduction shape (left padding, more rows), so its logits differ from the
lone forward's by a few ulps, and a choice between two almost equal alternatives may flip. The rule that tells such a
flip (numerics) from a bug is the one of :mod:`spiffy.bench.fidelity` (the prompt alone is the reference, the batched
row the other run); the AR half is :mod:`spiffy.bench.batch_fidelity_ar`, a speculative path against its baseline
:mod:`spiffy.bench.spec_fidelity`. The proofs re-run the two decodes (twice: once to find the step, once to record
it), so they cost about four decodes per differing row; benchmarks run them only for rows that differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from spiffy.bench.fidelity import (
    DEVIATION_ULPS,
    NEAR_TIE_RULE,
    NearTieProof,
    confidence_bound,
    deviation_ulps,
    rounding_bound,
)
from spiffy.bench.router_fidelity import RouterRecorder, judge_router_flip, routers_of
from spiffy.decoding.batch import row_generators, run_baseline, run_baseline_batch
from spiffy.decoding.factory import make_row_sessions, make_session
from spiffy.selfspec.runtime import speculative_generate as spiffy_single
from spiffy.selfspec.runtime import speculative_generate_batch as spiffy_batch
from spiffy.torch_utils import dtype_name

#: the rule's text, as batched-row reports quote it (one rule: :data:`spiffy.bench.fidelity.NEAR_TIE_RULE`)
BATCH_NEAR_TIE_RULE = NEAR_TIE_RULE
#: the proof of a batched row: :class:`spiffy.bench.fidelity.NearTieProof` (this name kept for its callers)
BatchDivergence = NearTieProof


# --------------------------------------------------------------------------------------------------- dLLM
class _Enough(Exception):
    """Ends a recording run once the step of interest was recorded."""


@dataclass
class _Step:
    """One recorded transition (``[1, T]`` states, ``[1, W, V]`` logits on the CPU)."""

    info: Any
    x_before: torch.Tensor
    logits: torch.Tensor
    x_after: torch.Tensor
    generator_state: torch.Tensor | None
    selection: torch.Tensor | None
    selection_start: int
    replayed: torch.Tensor | None = None
    flip: float | None = None  # see TransitionRecorder._flip_fraction


class TransitionRecorder:
    """Wraps ``session.transition``: records every result, and the full step at index ``keep`` (then, with
    ``replay_logits``, also the rule replayed on those logits from the same generator state) and stops the run."""

    def __init__(self, session: Any, keep: int | None = None, replay_logits: torch.Tensor | None = None) -> None:
        self.session, self.keep, self.replay_logits = session, keep, replay_logits
        self.results: list[torch.Tensor] = []
        self.step: _Step | None = None
        self._inner = session.transition
        session.transition = self._transition

    def _transition(self, x: torch.Tensor, logits: torch.Tensor, info: Any) -> torch.Tensor:
        gen = self.session.generator
        pre = gen.get_state() if gen is not None else None
        replayed, flip = None, None
        if len(self.results) == self.keep and self.replay_logits is not None:
            other = self.replay_logits.to(logits.device, logits.dtype)
            replayed = self._inner(x, other, info).cpu()
            flip = self._flip_fraction(x, logits, other, info, pre)
            if gen is not None:
                gen.set_state(pre)
        out = self._inner(x, logits, info)
        self.results.append(out.cpu())
        if len(self.results) - 1 == self.keep:
            pub = self.session.transition_probs(logits)
            sel = None if pub is None or pub.selection is None else pub.selection.detach().double().cpu()
            self.step = _Step(info, x.cpu(), logits.detach().cpu(), out.cpu(), pre,
                              sel, 0 if pub is None else int(pub.selection_start), replayed, flip)
            raise _Enough
        return out

    def _flip_fraction(self, x: torch.Tensor, mine: torch.Tensor, other: torch.Tensor, info: Any,
                       pre: torch.Tensor | None, iterations: int = 12) -> float | None:
        """The smallest ``t`` (bisection) at which the rule on ``mine + t (other - mine)``, from the same generator
        state, leaves the result on ``mine``: how far along the rounding difference a draw flips."""
        gen = self.session.generator

        def run(t: float) -> torch.Tensor:
            if gen is not None:
                gen.set_state(pre)
            mixed = (mine.double() + t * (other.double() - mine.double())).to(mine.dtype)
            return self._inner(x, mixed, info)

        base = run(0.0)
        if torch.equal(run(1.0), base):
            return None
        lo, hi = 0.0, 1.0
        for _ in range(iterations):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if not torch.equal(run(mid), base) else (mid, hi)
        return hi


def _left_pad(batch: Sequence[Sequence[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(batch):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
        mask[r, width - len(p):] = 1
    return ids, None if bool(mask.all()) else mask


def dllm_run(model: Any, batch: Sequence[Sequence[int]], row: int, config: Any, alone: bool, graph: Any,
             budget: int | None, score: str | None, tokenizer: Any, overrides: dict[str, Any],
             keep: int | None = None, replay_logits: torch.Tensor | None = None) -> TransitionRecorder:
    """Decode prompt ``row`` alone or the whole batch (as :func:`spiffy.api.generate` does, every row seeded from
    the config) and record row ``row``'s transitions."""
    device = next(model.parameters()).device
    ids, mask = _left_pad(batch, device)
    fwd = make_session(model, ids, config, attention_mask=mask, tokenizer=tokenizer, **overrides)
    cfg = fwd.config  # type: ignore[attr-defined]
    if alone:
        session = make_session(model, ids[row : row + 1, ids.shape[1] - len(batch[row]):], cfg, tokenizer=tokenizer)
        rec = TransitionRecorder(session, keep, replay_logits)
        try:
            run_baseline(session) if graph is None else spiffy_single(session, graph, budget, score=score)
        except _Enough:
            pass
        return rec
    rows = make_row_sessions(model, ids, mask, cfg, row_generators(len(batch), device), tokenizer=tokenizer)
    rec = TransitionRecorder(rows[row], keep, replay_logits)
    try:
        run_baseline_batch(fwd, rows) if graph is None else spiffy_batch(fwd, rows, graph, budget, score=score)
    except _Enough:
        pass
    return rec


def judge_dllm_step(alone: _Step, batched: _Step, *, row: int | None, step: int, prompt_len: int,
                    dtype: torch.dtype, temperature: float, threshold: float | None,
                    compared: str = "batched row vs alone") -> NearTieProof:
    """The rule (:mod:`spiffy.bench.fidelity`) on the first differing transition of two runs: ``alone`` is the
    reference's step (with its rule replayed on the other run's logits), ``batched`` the other run's."""
    same = torch.equal(alone.x_before, batched.x_before) and (
        (alone.generator_state is None and batched.generator_state is None)
        or (alone.generator_state is not None and batched.generator_state is not None
            and torch.equal(alone.generator_state, batched.generator_state)))
    replay = alone.replayed is not None and torch.equal(alone.replayed, batched.x_after)
    dev = deviation_ulps(alone.logits, batched.logits, dtype) if alone.logits.shape == batched.logits.shape else math.inf
    x0 = alone.x_before[0]
    changed_a, changed_b = alone.x_after[0] != x0, batched.x_after[0] != x0
    ws = int(alone.info.window_start)
    la = alone.logits[0].double()
    gap = bound = None
    differs = (alone.x_after[0] != batched.x_after[0]).nonzero()
    col = int(differs[0, 0]) if differs.numel() else None
    if torch.equal(changed_a, changed_b):  # the same positions took different tokens
        kind = "greedy" if temperature == 0 else "sampled"
        if kind == "greedy" and col is not None:
            ta, tb = int(alone.x_after[0, col]), int(batched.x_after[0, col])
            a, b = float(la[col - ws, ta]), float(la[col - ws, tb])
            gap, bound = abs(a - b), rounding_bound(a, b, dtype)
        elif col is not None and alone.flip is not None:
            # a draw: the logit change (along the straight path to the batched logits, same coins) that moves it
            row_a, row_b = la[col - ws], batched.logits[0, col - ws].double()
            gap = alone.flip * float((row_b - row_a).abs().max())
            bound = rounding_bound(float(row_a.abs().max()), 0.0, dtype)
    else:
        kind = "low-confidence"
        only_a = (changed_a & ~changed_b).nonzero()
        only_b = (changed_b & ~changed_a).nonzero()
        cols = [int(t[0, 0]) for t in (only_a, only_b) if t.numel()]
        col = min(cols)
        if alone.selection is not None:
            conf = [float(alone.selection[0, c - alone.selection_start]) for c in cols]
            if len(conf) == 1 and threshold is not None:
                conf.append(float(threshold))  # one position crossed the threshold in one run only
            if len(conf) == 2:
                scale = max(float(la[c - ws].abs().max()) for c in cols)
                gap, bound = abs(conf[0] - conf[1]), confidence_bound(conf, scale, dtype)
    if gap is None and alone.flip is not None and alone.logits.shape == batched.logits.shape:
        # no closed form (a choice among sampled proposals): the logit change that flips it, as for a draw
        gap = alone.flip * float((batched.logits.double() - la[None]).abs().max())
        bound = rounding_bound(float(la.abs().max()), 0.0, dtype)
    near = same and replay and dev <= DEVIATION_ULPS and (gap is None or gap <= bound)  # type: ignore[operator]
    return NearTieProof(row=row, step=step, position=None if col is None else col - prompt_len, kind=kind, gap=gap,
                        bound=bound, deviation_ulps=dev, same_state=same, replay=replay, near_tie=bool(near),
                        dtype=dtype_name(dtype), compared=compared)


def _first_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


#: ``run(reference, keep, replay_logits)``: one recorded decode of a proof, the reference run or the other run
#: (``keep``/``replay_logits`` as :class:`TransitionRecorder` takes them)
RecordedRun = Callable[[bool, "int | None", "torch.Tensor | None"], TransitionRecorder]


def prove_dllm_runs(run: RecordedRun, dtype: torch.dtype, *, row: int | None, compared: str,
                    model: Any = None) -> NearTieProof | None:
    """The rule (:mod:`spiffy.bench.fidelity`) on two dLLM runs that must agree: find the first transition whose
    result differs, re-run both recording it (the reference replaying its rule on the other run's logits from the
    same generator state) and judge it. ``None`` when every transition agrees.

    ``model``: the model both runs call; when it routes tokens to experts, the recording runs also record every
    router (:class:`spiffy.bench.router_fidelity.RouterRecorder`), and a step whose logits differ beyond rounding
    (points 3 or 4 fail while 1 and 2 hold) is judged as a router near tie (kind ``router``) instead."""
    runs = [run(reference, None, None) for reference in (True, False)]
    k = _first_difference(runs[0].results, runs[1].results)
    if k is None:
        return None
    routed = bool(routers_of(model))
    with RouterRecorder(model) as other_routes:  # a dense model (or none given): nothing recorded
        other = run(False, k, None).step
    with RouterRecorder(model) as mine_routes:
        mine = run(True, k, None if other is None else other.logits).step
    if mine is None or other is None:  # one run took a step the other never took
        return NearTieProof(row, k, None, "schedule", None, None, None, False, False, False, dtype_name(dtype),
                            compared)
    session = runs[0].session
    cfg = session.config
    proof = judge_dllm_step(mine, other, row=row, step=k, prompt_len=int(session.prompt_len), dtype=dtype,
                            temperature=float(cfg.sampling.temperature), threshold=_threshold(session),
                            compared=compared)
    if proof.near_tie or not routed or not (proof.same_state and proof.replay):
        return proof
    flip = judge_router_flip(mine_routes, mine.logits, other_routes, other.logits, dtype)
    return replace(proof, kind="router", gap=flip.gap, bound=flip.bound, near_tie=flip.proven, layer=flip.layer,
                   note=flip.note)


def explain_dllm_batch_row(model: Any, batch: Sequence[Sequence[int]], row: int, config: Any = None, *,
                           graph: Any = None, budget: int | None = None, score: str | None = None,
                           tokenizer: Any = None, overrides: dict[str, Any] | None = None) -> NearTieProof | None:
    """Prove (or refute) that row ``row`` of the dLLM ``batch`` (token-id lists, left padded as
    :func:`spiffy.api.generate` pads them; every row seeded from the config) leaves the prompt decoded alone only
    at a near tie. ``graph``: batched Spiffy against Spiffy alone. ``None`` when the two runs agree."""
    extra = dict(overrides or {})

    def run(reference: bool, keep: int | None, replay_logits: torch.Tensor | None) -> TransitionRecorder:
        return dllm_run(model, batch, row, config, reference, graph, budget, score, tokenizer, extra, keep=keep,
                         replay_logits=replay_logits)

    return prove_dllm_runs(run, next(model.parameters()).dtype, row=row, compared="batched row vs alone",
                           model=model)


def _threshold(session: Any) -> float | None:
    """The confidence threshold a dynamic rule unmasks above (``None`` for static schedules)."""
    cfg = session.config
    if cfg.tokens_per_step != "dynamic":
        return None
    value = getattr(session, "threshold", None)
    return float(value) if value is not None else (None if cfg.threshold is None else float(cfg.threshold))


__all__ = [
    "BATCH_NEAR_TIE_RULE", "DEVIATION_ULPS", "BatchDivergence", "RecordedRun", "TransitionRecorder",
    "confidence_bound", "deviation_ulps", "dllm_run", "explain_dllm_batch_row", "judge_dllm_step", "prove_dllm_runs",
]
