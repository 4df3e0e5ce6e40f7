"""The near-tie rule: when two runs that must agree token for token differ, is the difference rounding or a bug?

Two kinds of pairs must agree: a batched row and its prompt decoded alone, and a speculative path and its baseline
(single-prompt Spiffy / FreeDave / SSD against the dLLM baseline; DFlash / DDTree / DEER / SpecDiff-2 against plain
AR). In float32/float64 they agree on every tested machine. In bfloat16/float16 (and on a GPU, where the matrix-product
kernel depends on how many rows a call has) the two runs compute the same logits with another reduction shape (left
padding, more rows, the 1 + D states of a verification forward, a tree of draft rows), so the logits differ by a few
units in the last place (ulps), and a choice between two almost equal alternatives may flip. Such a flip is numerics,
not logic, exactly when the rule below holds.

**The rule** (one for every pair and decision kind). Run both, recording every decision step (dLLM: each baseline
transition; AR: each verification round, or the decision of each generated token), and take the first step whose
result differs. Call the run that defines the output the *reference* (the prompt alone; the baseline; plain AR) and
the other one the *other run*:

1. both runs were in the same state there (dLLM: the same ``x`` and the same generator state; AR: the same root
   position after the same committed tokens);
2. the step is a function of its logits alone: the reference's own rule, replayed on the *other run's* logits
   (same state, same generator state / position-keyed noise), reproduces the other run's result;
3. those logits agree with the reference's within :data:`DEVIATION_ULPS` ulps of each row's largest magnitude in
   the model dtype (:func:`deviation_ulps`);
4. the choice that flipped is within that rounding, by its kind:

   * ``greedy`` (an argmax): the reference's logits of the two tokens differ by at most :func:`rounding_bound`
     (:data:`NEAR_TIE_ULPS` ulps);
   * ``low-confidence`` (which positions a dLLM step unmasks): the two positions' confidences (or a confidence and
     the threshold) differ by at most :func:`confidence_bound`;
   * ``sampled`` (a draw whose coins both runs share): position-keyed Gumbel noise (AR, coupled rule): the perturbed
     scores of the two tokens differ by at most the tempered logits' rounding bound; an acceptance test or an
     inverse-CDF draw (AR, rejection rule): the coin lies within ``(exp(4 d) - 1)`` times the threshold, or
     ``2 (exp(4 d) - 1) min(C, 1 - C)`` of the CDF value ``C``, from the boundary; a dLLM draw: the draw flips
     within a logit change no larger than the rounding bound (bisection along the straight path between the two
     runs' logits, same coins);
   * ``draft`` (batched AR rows: the drafts differ): point 3 on the drafter's logits and the tree rebuilt from the
     other run's drafter logits equal to its tree.

In a mixture-of-experts model (LLaDA-MoE, SDAR-MoE, LLaDA2.0) rounding can also flip a *router* near tie: a token
then runs through another expert and the logits move far beyond point 3's bound. The ``router`` kind
(:mod:`spiffy.bench.router_fidelity`) proves such a step in place of points 3 and 4 (points 1 and 2 still hold): in
the forward that computed the step's logits, at the first MoE layer where a token's expert set differs, the router
inputs agree within :data:`DEVIATION_ULPS` ulps, and every flipped token's experts (LLaDA2.0: or groups) lie within
rounding (:data:`NEAR_TIE_ULPS` ulps of the largest router logit, carried through the score the router ranks) of the
boundary the router uses, in both runs' scores.

A step violating any point is reported ``near_tie = False`` with the reason (:attr:`NearTieProof.reason`): a bug.
Where the rule is applied: :mod:`spiffy.bench.batch_fidelity` (batched dLLM rows, and the dLLM recording and
judging every dLLM proof shares), :mod:`spiffy.bench.batch_fidelity_ar` (batched AR rows, and the AR pieces),
:mod:`spiffy.bench.spec_fidelity` (a speculative path against its baseline, dLLM and AR). The proofs re-run the two
decodes to find and record the step (about four decodes per differing output), so callers run them only for
outputs that differ.

Why these bounds: each run rounds each logit to the dtype (a difference of two rounded values is off by up to
1 ulp), and the hidden states carry the rounding of different reduction orders; measured on the shipped tiny Qwen3
target the top-2 gap of a cached one-row decode and of a full-sequence forward differ by at most 2.5 ulps of the
top logit in bfloat16 (2.0 in float16), hence 4 ulps for a flipped choice; over every verified row and vocabulary
entry of tiny LLaDA / Dream / SDAR / Qwen3 + DFlash pairs the logits differ by at most 6 ulps, hence 16 for point 3.
A logic error moves logits and gaps by far more.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

#: point 4, greedy: the largest logit gap rounding can flip, in ulps of the larger logit
NEAR_TIE_ULPS = 4.0
#: point 3: the largest logit difference of the two runs, in ulps of the row's largest logit
DEVIATION_ULPS = 16.0

NEAR_TIE_RULE = (
    "a divergence (a batched row from its prompt alone, or a speculative path from its baseline) is a near tie when "
    "at the first differing step both runs were in the same state, the reference's rule replayed on the other run's "
    f"logits reproduces the other run's result, the logits agree within {DEVIATION_ULPS:g} ulps of each row's "
    f"largest magnitude, and the flipped choice (greedy top-2 gap within {NEAR_TIE_ULPS:g} ulps, two confidences, or "
    "a sampled draw's perturbed scores / coin) lies within that rounding; in a mixture-of-experts model, logits moved "
    "further are proven by a router near tie instead (at the first layer routing a token differently the router "
    "inputs agree within rounding and the flipped experts lie within rounding of the router's top-k boundary) "
    "(spiffy.bench.fidelity, spiffy.bench.router_fidelity; batched rows: spiffy.bench.batch_fidelity)"
)


def spacing(value: float, dtype: torch.dtype) -> float:
    """Distance between adjacent numbers of ``dtype`` at ``|value|`` (its ulp); the smallest normal's at 0."""
    info = torch.finfo(dtype)
    mag = max(abs(float(value)), float(info.tiny))
    return float(info.eps) * 2.0 ** math.floor(math.log2(mag))


def rounding_bound(logit_a: float, logit_b: float, dtype: torch.dtype, ulps: float = NEAR_TIE_ULPS) -> float:
    """The largest logit gap rounding can flip: ``ulps`` spacings of ``max(|logit_a|, |logit_b|)`` in ``dtype``."""
    return ulps * spacing(max(abs(logit_a), abs(logit_b)), dtype)


def deviation_ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """``max |a - b|`` over ``[..., V]`` rows, each in ulps (``dtype``) of that row's largest ``|a|``."""
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    worst = 0.0
    for ra, rb in zip(a64, b64):
        diff = float((ra - rb).abs().max())
        worst = max(worst, diff / spacing(float(ra.abs().max()), dtype))
    return worst


def confidence_bound(values: Sequence[float], logit_scale: float, dtype: torch.dtype) -> float:
    """The largest gap between two confidences among ``values`` that rounding can flip: each moves by at most
    ``(exp(2 d) - 1) (exp(2 d) + max |values|)`` (a probability, a margin or an entropy; ``d`` the rounding bound of
    logits of magnitude ``logit_scale``), so twice that."""
    grow = math.exp(2.0 * rounding_bound(logit_scale, 0.0, dtype))
    return 2.0 * (grow - 1.0) * (grow + max(abs(float(v)) for v in values))


@dataclass
class NearTieProof:
    """The first step where two runs that must agree differ, and the verdict of the rule (module docstring).

    Attributes:
        row: the row in its batch (``None``: a single prompt, a speculative path against its baseline).
        step: dLLM transition / AR round index of the first differing step (AR against plain AR: the other run's
            round; ``-1``: the prefill).
        position: generated-token index of the first differing token of that step.
        kind: ``greedy``, ``low-confidence``, ``sampled``, ``draft``, ``router`` (a mixture-of-experts router near
            tie, :mod:`spiffy.bench.router_fidelity`: proves points 3 and 4 instead) or ``schedule`` (one run took a
            step the other never took).
        gap, bound: the flipped choice's margin and its rounding bound (``None`` where the kind has none: a draw
            whose coin the rule does not expose is proved by the replay and the logit agreement); ``router``: the
            flipped experts' (or groups') margin at the router's boundary and its bound.
        deviation_ulps: largest logit difference of the two runs at the step, in ulps of the row's largest logit.
        same_state, replay: points 1 and 2 of the rule. near_tie: every point holds. dtype: the model dtype.
        compared: which two runs (``"batched row vs alone"``, ``"spiffy vs baseline"``, ``"ddtree vs ar"``, ...).
        layer: ``router``: the first MoE layer (forward order) whose routing differs. note: ``router``: why the
            router near tie is not proven (``""`` when it is, or for another kind).
    """

    row: int | None
    step: int
    position: int | None
    kind: str
    gap: float | None
    bound: float | None
    deviation_ulps: float | None
    same_state: bool
    replay: bool
    near_tie: bool
    dtype: str
    compared: str = "batched row vs alone"
    layer: int | None = None
    note: str = ""

    @property
    def reason(self) -> str:
        """Why the divergence is not proven a near tie (every failed point of the rule); ``""`` when it is."""
        if self.near_tie:
            return ""
        if self.kind == "schedule":
            return "one run took a decision step the other never took (their schedules differ)"
        why = []
        if not self.same_state:
            why.append("the runs were in different states at the first differing step (other tokens, positions or "
                       "random coins)")
        if not self.replay:
            why.append("the reference's rule replayed on the other run's logits does not reproduce its result")
        if self.kind == "router":  # the router kind replaces points 3 and 4 (its own note says what failed)
            why.append(self.note)
        else:
            if self.deviation_ulps is not None and self.deviation_ulps > DEVIATION_ULPS:
                why.append(f"the logits differ by {self.deviation_ulps:.3g} ulps, beyond the {DEVIATION_ULPS:g}-ulp "
                           "rounding bound")
            if self.gap is not None and self.bound is not None and self.gap > self.bound:
                why.append(f"the flipped {self.kind} choice's margin {self.gap:.4g} exceeds its rounding bound "
                           f"{self.bound:.4g}")
        return "; ".join(why) or "no point of the rule could be checked"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reason": self.reason}


def divergence_entry(proof: NearTieProof | None) -> dict[str, Any]:
    """What a report records of a divergence its caller saw: the proof's fields (``near_tie``, ``reason``, ...), or,
    when the proof's own re-run of both paths agreed (``None``: the divergence did not reproduce, so nothing about
    it is proven), an unproven entry saying so."""
    if proof is not None:
        return proof.to_dict()
    return {"near_tie": False, "kind": "unreproduced",
            "reason": "the proof's re-run of both paths did not reproduce the divergence (a run that depends on more "
                      "than its inputs: not rounding)"}


__all__ = [
    "DEVIATION_ULPS", "NEAR_TIE_RULE", "NEAR_TIE_ULPS", "NearTieProof", "confidence_bound", "deviation_ulps",
    "divergence_entry", "rounding_bound", "spacing",
]
