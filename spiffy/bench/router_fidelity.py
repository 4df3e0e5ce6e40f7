"""The near-tie rule's router kind: a divergence of a mixture-of-experts model proven to start at a router near tie.

A mixture-of-experts layer sends each token to the ``k`` experts its router scores highest. When two experts' scores
lie within rounding of the ``k``-th / ``(k+1)``-th boundary, the rounding of a batched forward (another reduction
shape) can flip which one is chosen; the token then runs through another expert, so its hidden state, and the logits
of every position that attends to it, move by far more than rounding. Point 3 of the rule
(:mod:`spiffy.bench.fidelity`: logits within :data:`~spiffy.bench.fidelity.DEVIATION_ULPS` ulps) then fails although
the cause is numerics. The router kind proves such a step instead of points 3 and 4 (points 1 and 2, the same state
and the reference's rule replayed, still apply):

(a) in the forward that computed the first differing step's logits (found in both runs by those logits), take the
    first MoE layer in forward order where some token of the row is sent to another expert set; the router inputs
    of that layer (the normalised hidden states ``[tokens, H]`` the router reads) agree within
    :data:`~spiffy.bench.fidelity.DEVIATION_ULPS` ulps of each token's largest magnitude (:func:`deviation_ulps`):
    every earlier layer routed every token identically and the states reaching the flip are equal up to rounding;
(b) for every token whose expert set differs there, the flipped experts' scores lie within rounding of the boundary
    the router actually uses, in both runs: an expert only the reference chose outscores one only the other run
    chose by at most the bound in the reference's scores, and the reverse in the other run's (:func:`flip_margin`).

The bound is the rule's: :data:`~spiffy.bench.fidelity.NEAR_TIE_ULPS` ulps (in the model dtype) of the token's largest
router logit, ``d``, carried through the score the router ranks (:func:`router_bound`): softmax routers rank the
logits themselves (a monotone map), so the gap is a logit gap with bound ``d``; a softmax plus an expert bias ranks
``p + b``, whose ``p`` moves by at most ``(exp(2 d) - 1) p``; LLaDA2.0's sigmoid plus bias moves by at most ``d / 4``
(the sigmoid's slope), and its group-limited top-k first keeps ``topk_group`` groups ranked by the sum of their two
best scores, so a flipped group is judged on group scores (bound: twice an expert's, per run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from spiffy.bench.fidelity import DEVIATION_ULPS, deviation_ulps, rounding_bound, spacing
from spiffy.models.llada2 import LLaDA2MoeGate
from spiffy.models.llada_moe import LLaDAMoESparseMoeBlock
from spiffy.models.qwen_moe import SparseMoeBlock

#: how many of the latest forwards a recorder keeps (the step's forward is the last one, or a verification
#: forward a few transitions back): bounds the memory at real size
KEEP_FORWARDS = 4


@dataclass
class RouterCall:
    """One MoE layer's routing in one forward.

    Attributes:
        layer: index of the MoE layer in forward order.
        inputs: ``[B * L, H]`` the router's input (model dtype).
        logits: ``[B * L, E]`` router logits (the model dtype for softmax routers, float32 for LLaDA2.0's).
        chosen: ``[B * L, k]`` chosen experts.
        router: the module whose rule ranked them (for :func:`choice_scores`).
    """

    layer: int
    inputs: torch.Tensor
    logits: torch.Tensor
    chosen: torch.Tensor
    router: nn.Module


@dataclass
class RecordedForward:
    """One model forward: ``shape`` ``(B, L)`` of its ``input_ids``, its routing per MoE layer, its ``logits
    [B, L, V]``."""

    shape: tuple[int, int]
    calls: list[RouterCall] = field(default_factory=list)
    logits: torch.Tensor | None = None


def routers_of(model: nn.Module | None) -> list[nn.Module]:
    """The MoE routers of ``model`` in module order (= forward order): softmax blocks (LLaDA-MoE, SDAR-MoE) and
    LLaDA2.0 gates; ``[]`` for a dense model (or ``None``)."""
    if model is None:
        return []
    return [m for m in model.modules() if isinstance(m, (LLaDAMoESparseMoeBlock, SparseMoeBlock, LLaDA2MoeGate))]


class RouterRecorder:
    """Context manager recording every MoE router call of ``model``'s forwards (the latest :data:`KEEP_FORWARDS`).

    Softmax blocks: their ``route`` is wrapped on the instance (whatever ``route`` is there, so a test's patched
    router is what gets recorded) and their ``gate`` linear's output read by a hook; LLaDA2.0 gates: a forward hook
    (the float32 logits recomputed with the gate's own operation). Everything is removed on exit.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.forwards: list[RecordedForward] = []
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> RouterRecorder:
        routers = routers_of(self.model)
        if self.model is None or not routers:
            return self
        hooks = [self.model.register_forward_pre_hook(self._start, with_kwargs=True),
                 self.model.register_forward_hook(self._finish)]
        self._undo += [h.remove for h in hooks]
        for layer, router in enumerate(routers):
            if isinstance(router, LLaDA2MoeGate):
                h = router.register_forward_hook(self._gate_hook(layer))
                self._undo.append(h.remove)
            else:
                self._wrap_route(layer, router)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        self.forwards.append(RecordedForward((int(ids.shape[0]), int(ids.shape[1]))))
        del self.forwards[:-KEEP_FORWARDS]

    def _finish(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self.forwards:
            self.forwards[-1].logits = (out.logits if hasattr(out, "logits") else out[0]).detach()

    def _add(self, call: RouterCall) -> None:
        if self.forwards:  # a router called outside a model forward (a test calling a block) is not recorded
            self.forwards[-1].calls.append(call)

    def _wrap_route(self, layer: int, block: nn.Module) -> None:
        inner = block.route
        seen: dict[str, torch.Tensor] = {}
        hook = block.gate.register_forward_hook(lambda m, a, out: seen.__setitem__("logits", out.detach()))

        def route(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, chosen = inner(h)
            self._add(RouterCall(layer, h.detach(), seen.pop("logits"), chosen.detach(), block))
            return weights, chosen

        had = "route" in vars(block)
        block.route = route  # type: ignore[method-assign]

        def undo() -> None:
            hook.remove()
            if had:
                block.route = inner  # type: ignore[method-assign]
            else:
                del block.route

        self._undo.append(undo)

    def _gate_hook(self, layer: int) -> Callable[..., None]:
        def hook(gate: nn.Module, args: tuple, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            h = args[0].detach()
            rdt = torch.float64 if h.dtype == torch.float64 else torch.float32  # the gate's own float32 logits
            logits = F.linear(h.to(rdt), gate.weight.detach().to(rdt))
            self._add(RouterCall(layer, h, logits, out[0].detach(), gate))
        return hook


def find_step_forward(forwards: list[RecordedForward], logits: torch.Tensor) -> tuple[RecordedForward, int, int] | None:
    """The latest recorded forward whose output holds the step's ``logits [1, W, V]`` (a window of one batch row):
    ``(forward, row, first column)``; ``None`` when none does (logits combined from several forwards)."""
    want = logits[0].cpu()
    w = want.shape[0]
    for fwd in reversed(forwards):
        if fwd.logits is None or fwd.logits.shape[-1] != want.shape[-1]:
            continue
        out = fwd.logits.cpu()
        for b in range(out.shape[0]):
            for col in range(out.shape[1] - w + 1):
                if torch.equal(out[b, col : col + w], want):
                    return fwd, b, col
    return None


def choice_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, E]`` -> ``[N, E]`` scores the router ranks, computed as the router computes them (so ties and
    group choices come out as in the model): the logits themselves for a softmax router (softmax is monotone),
    ``softmax`` in float32 ``+ expert_bias`` with a bias, float32 ``sigmoid + expert_bias`` for LLaDA2.0."""
    if isinstance(router, LLaDA2MoeGate):
        return torch.sigmoid(logits) + router.expert_bias.detach().to(logits.device)
    bias = getattr(router, "expert_bias", None)
    if bias is None:
        return logits
    return F.softmax(logits, dim=-1, dtype=torch.float32) + bias.detach().to(logits.device)


def router_bound(router: nn.Module, logits: torch.Tensor, flipped: list[int], dtype: torch.dtype,
                 groups: bool = False) -> float:
    """The largest gap between two of the ``flipped`` experts' scores (:func:`choice_scores`) that rounding can
    flip, for one token's router ``logits [E]`` (module docstring): ``d`` (:data:`~spiffy.bench.fidelity.NEAR_TIE_ULPS`
    ulps in ``dtype`` of the largest logit) carried through the ranked score, each of the two scores moving; a
    float32 ulp of the scores added where the router ranks float32 values it computed. ``groups``: a gap between
    LLaDA2.0 group scores (the sum of two experts' scores)."""
    lg = logits.double()
    d = rounding_bound(float(lg.abs().max()), 0.0, dtype)  # the rule's bound on one router logit
    if isinstance(router, LLaDA2MoeGate):
        scores = choice_scores(router, logits[None])[0]
        per = d / 4.0 + spacing(float(scores.abs().max()), torch.float32)
        return 2.0 * (2.0 * per if groups else per)
    if getattr(router, "expert_bias", None) is None:
        return d
    probs = torch.softmax(lg, dim=-1)
    top = max(float(probs[e]) for e in flipped)
    scores = choice_scores(router, logits[None])[0]
    return 2.0 * ((math.exp(2.0 * d) - 1.0) * top + spacing(float(scores.abs().max()), torch.float32))


def kept_groups(router: nn.Module, scores: torch.Tensor) -> tuple[set[int], torch.Tensor]:
    """LLaDA2.0's group-limited top-k on one token's choice ``scores [E]``: the kept groups and every group's
    score (the sum of its two best experts); ``(set(), empty)`` for a router without groups."""
    if not isinstance(router, LLaDA2MoeGate) or router.n_group <= 1:
        return set(), scores.new_zeros(0)
    gs = scores.view(router.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    return set(torch.topk(gs, router.topk_group)[1].tolist()), gs


def _pair_gap(first: torch.Tensor, second: torch.Tensor, only_first: set[int], only_second: set[int]) -> float:
    """How far the flip reaches: an item only the first run kept outscores one only the second kept by at most this
    in ``first``'s scores, and the reverse in ``second``'s (both >= 0 for a genuine swap)."""
    a = max(float(first[e]) for e in only_first) - min(float(first[f]) for f in only_second)
    b = max(float(second[f]) for f in only_second) - min(float(second[e]) for e in only_first)
    return max(a, b)


def flip_margin(router: nn.Module, ref_logits: torch.Tensor, other_logits: torch.Tensor, ref_chosen: list[int],
                other_chosen: list[int], dtype: torch.dtype) -> tuple[float, float, str]:
    """One token's flip at one router: ``(gap, bound, what)`` (``what``: ``"experts"`` or ``"groups"``), from both
    runs' ``logits [E]`` and chosen experts. A flipped LLaDA2.0 group set is judged on the group boundary (the
    experts then follow from the groups kept); otherwise the experts' ``k``-th / ``(k+1)``-th boundary."""
    sa, sb = choice_scores(router, ref_logits[None])[0], choice_scores(router, other_logits[None])[0]
    ga, gsa = kept_groups(router, sa)
    gb, gsb = kept_groups(router, sb)
    if ga != gb:
        gap = _pair_gap(gsa, gsb, ga - gb, gb - ga)
        flipped = sorted(set(ref_chosen) ^ set(other_chosen))
        bound = max(router_bound(router, lg, flipped, dtype, groups=True) for lg in (ref_logits, other_logits))
        return gap, bound, "groups"
    only_a, only_b = set(ref_chosen) - set(other_chosen), set(other_chosen) - set(ref_chosen)
    gap = _pair_gap(sa, sb, only_a, only_b)
    flipped = sorted(only_a | only_b)
    bound = max(router_bound(router, lg, flipped, dtype) for lg in (ref_logits, other_logits))
    return gap, bound, "experts"


@dataclass
class RouterFlip:
    """The router kind's verdict on one step (module docstring).

    Attributes:
        proven: (a) and (b) hold. layer: the first MoE layer (forward order) whose routing differs, ``None`` when
            none does. column: the flipped token's column in the reference's forward (the worst one of that layer).
        gap, bound: that token's flip margin and its rounding bound (:func:`flip_margin`); the margin reported is
            the token with the largest ``gap / bound``. input_ulps: (a)'s router-input difference at that layer.
        note: why the flip is not proven (``""`` when it is).
    """

    proven: bool
    layer: int | None = None
    column: int | None = None
    gap: float | None = None
    bound: float | None = None
    input_ulps: float | None = None
    note: str = ""


def _sets(chosen: torch.Tensor, tokens: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(row) for row in chosen[tokens].cpu().tolist()]


def judge_router_flip(reference: RouterRecorder, ref_logits: torch.Tensor, other: RouterRecorder,
                      other_logits: torch.Tensor, dtype: torch.dtype) -> RouterFlip:
    """Points (a) and (b) of the router kind on the step whose logits were ``ref_logits`` / ``other_logits``
    (``[1, W, V]``) in the two recorded runs. The row's tokens are aligned between the two forwards by where the
    step's window sits in each (the other run's row may carry left padding)."""
    found = [find_step_forward(rec.forwards, lg) for rec, lg in ((reference, ref_logits), (other, other_logits))]
    if found[0] is None or found[1] is None:
        return RouterFlip(False, note="the forward that computed the step's logits was not recorded in both runs "
                                      "(router near ties are proven on one forward per run)")
    (fa, ra, ca), (fb, rb, cb) = found  # type: ignore[misc]
    if len(fa.calls) != len(fb.calls) or not fa.calls:
        return RouterFlip(False, note=f"the two forwards ran {len(fa.calls)} and {len(fb.calls)} router calls")
    (_, la), (_, lb) = fa.shape, fb.shape
    shift = cb - ca  # reference column j is the other run's column j + shift of its row
    cols = torch.arange(max(0, -shift), min(la, lb - shift))
    tok_a, tok_b = ra * la + cols, rb * lb + cols + shift
    for call_a, call_b in zip(fa.calls, fb.calls):
        set_a, set_b = _sets(call_a.chosen, tok_a), _sets(call_b.chosen, tok_b)
        flipped = [i for i, (x, y) in enumerate(zip(set_a, set_b)) if x != y]
        if not flipped:
            continue
        # (a): what reached the first flipped layer is the same up to rounding (then so were all earlier routings)
        ulps = deviation_ulps(call_a.inputs[tok_a].cpu(), call_b.inputs[tok_b].cpu(), dtype)
        worst: tuple[float, float, float, int, str] | None = None
        for i in flipped:
            gap, bound, what = flip_margin(call_a.router, call_a.logits[tok_a[i]].cpu(), call_b.logits[tok_b[i]].cpu(),
                                           sorted(set_a[i]), sorted(set_b[i]), dtype)
            ratio = gap / bound if bound > 0 else math.inf
            if worst is None or ratio > worst[0]:
                worst = (ratio, gap, bound, int(cols[i]), what)
        ratio, gap, bound, col, what = worst  # type: ignore[misc]  # flipped is not empty
        why = []
        if ulps > DEVIATION_ULPS:
            why.append(f"the router inputs of MoE layer {call_a.layer} (the first whose routing differs) differ by "
                       f"{ulps:.3g} ulps, beyond the {DEVIATION_ULPS:g}-ulp rounding bound")
        if ratio > 1.0:
            why.append(f"the flipped {what} of the token at column {col} are {gap:.4g} apart at the router's "
                       f"boundary, beyond its rounding bound {bound:.4g}")
        return RouterFlip(not why, call_a.layer, col, gap, bound, ulps, "; ".join(why))
    return RouterFlip(False, note="every token of the row is routed to the same experts in both forwards of the step "
                                  "(the logits differ beyond rounding without a router flip)")


__all__ = [
    "KEEP_FORWARDS", "RecordedForward", "RouterCall", "RouterFlip", "RouterRecorder", "choice_scores",
    "find_step_forward", "flip_margin", "judge_router_flip", "kept_groups", "router_bound", "routers_of",
]
