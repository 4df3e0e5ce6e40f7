"""The near-tie rule's router kind (:mod:`spiffy.bench.router_fidelity`): a mixture-of-experts divergence whose
logits move beyond rounding is proven only when it starts at a router near tie.

A real case first: on the tiny MoE checkpoints in bfloat16, batched rows whose divergence starts at a router flip
(their logits differ by 18 to 118 ulps) are pinned (found on one machine; which rows flip is the CPU's business, so
a bounded search over further prompt seeds follows) and proven. The forced cases tie two experts' router rows on
purpose (equal gate weights and bias: equal scores for every token, so which of the two a top-k keeps is a pure
tie-break) and, in the batched forward only, break each straddling tie
the other way, exactly as a rounding difference would; the token then runs through another expert and its logits
move far beyond rounding, yet the proof holds (kind ``router``, margin 0 or within its bound). Broken on purpose, the
proof refuses: a batched router that sends every token's first choice to its worst-scored expert (a large gap at the
boundary), router inputs that differ beyond rounding, and logits that move without any router flip.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spiffy.api import generate
from spiffy.bench.batch_fidelity import DEVIATION_ULPS, explain_dllm_batch_row
from spiffy.bench.fidelity import rounding_bound
from spiffy.bench.router_fidelity import (
    RecordedForward,
    RouterCall,
    RouterRecorder,
    choice_scores,
    flip_margin,
    judge_router_flip,
    kept_groups,
    routers_of,
)
from spiffy.models.llada2 import LLaDA2MoeConfig, LLaDA2MoeGate
from spiffy.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROUTED = ["llada_moe", "sdar_moe", "llada2"]
#: the tied pair: experts 0 and 2 (on LLaDA2.0's tiny model, in groups 0 and 1 of its four groups of two)
E1, E2 = 0, 2
#: a prompt seed (two prompts, lengths 3 and 6) whose row 0 diverges under the forced tie flip, per family
PINNED = {"llada_moe": 2, "sdar_moe": 2, "llada2": 2}


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in (3, 6)]


def _kw(family: str) -> dict:
    kw = dict(gen_length=8, block_length=4, temperature=0.0, steps=4)
    if family == "llada2":
        kw["threshold"] = 1.0  # LLaDA2's rule is always thresholded: 1.0 is never crossed, the schedule decides
    return kw


def _tied(request: pytest.FixtureRequest, family: str) -> nn.Module:
    """A fresh bfloat16 copy of the tiny ``family`` model whose routers score experts E1 and E2 identically."""
    model = load_model(request.getfixturevalue(f"tiny_{family}"), dtype=torch.bfloat16)
    with torch.no_grad():
        for r in routers_of(model):
            weight = r.weight if isinstance(r, LLaDA2MoeGate) else r.gate.weight
            weight[E2] = weight[E1]
            bias = getattr(r, "expert_bias", None)
            if bias is not None:
                bias[E2] = bias[E1]
    return model


def _router_logits(router: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if isinstance(router, LLaDA2MoeGate):
        return F.linear(h.float(), router.weight.float())
    return router.gate(h)


def _flip(router: nn.Module, chosen: torch.Tensor, logits: torch.Tensor, far: bool) -> torch.Tensor:
    """``chosen [T, k]`` with each straddling E1/E2 tie broken the other way (``far``: every token's first choice
    replaced by its worst-scored expert instead)."""
    chosen = chosen.clone()
    if far:
        chosen[:, 0] = choice_scores(router, logits).argmin(-1).to(chosen.device)
        return chosen
    straddle = (chosen == E1).any(-1) ^ (chosen == E2).any(-1)
    if isinstance(router, LLaDA2MoeGate):  # both experts' groups kept: the tie is at the expert boundary
        scores = choice_scores(router, logits.detach())
        straddle &= torch.tensor([{E1 // 2, E2 // 2} <= kept_groups(router, s)[0] for s in scores])
    a, b = straddle[:, None] & (chosen == E1), straddle[:, None] & (chosen == E2)
    chosen[a], chosen[b] = E2, E1
    return chosen


@contextmanager
def _batched_flips(model: nn.Module, far: bool) -> Iterator[None]:
    """Every router of ``model`` flips (:func:`_flip`) in forwards over more than one row (the batched run) only.
    Equal scores keep the weights right after a tie flip, so a tie flip is exactly what rounding could do."""
    batched = {"on": False}

    def watch(module: nn.Module, args: tuple, kwargs: dict) -> None:
        batched["on"] = (args[0] if args else kwargs["input_ids"]).shape[0] > 1

    hooks = [model.register_forward_pre_hook(watch, with_kwargs=True)]
    for router in routers_of(model):
        if isinstance(router, LLaDA2MoeGate):
            def after(gate: nn.Module, args: tuple, out: tuple) -> tuple:
                if not batched["on"]:
                    return out
                return _flip(gate, out[0], _router_logits(gate, args[0]), far), out[1]
            hooks.append(router.register_forward_hook(after))
        else:
            def route(h: torch.Tensor, inner=router.route, block=router) -> tuple[torch.Tensor, torch.Tensor]:
                weights, chosen = inner(h)
                if batched["on"]:
                    chosen = _flip(block, chosen, _router_logits(block, h), far)
                return weights, chosen
            router.route = route
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for router in routers_of(model):
            vars(router).pop("route", None)


def _diverging_row(model: nn.Module, family: str, seed: int) -> bool:
    """Whether row 0 of the batch of ``_prompts(seed)`` differs from its prompt decoded alone."""
    prompts = _prompts(seed)
    ids = torch.zeros((2, 6), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, 6 - len(p):] = torch.tensor(p)
        mask[r, 6 - len(p):] = 1
    batched = generate(model, ids, attention_mask=mask, **_kw(family)).tokens[0]
    return batched != generate(model, torch.tensor([prompts[0]]), **_kw(family)).tokens[0]


@pytest.mark.parametrize("family", ROUTED)
def test_forced_router_tie_flip_is_proven(request, family) -> None:
    model = _tied(request, family)
    with _batched_flips(model, far=False):
        # the pinned prompts first; which prompts' tokens the flip changes depends on the CPU's kernels: a bounded
        # search over further seeds
        seed = next((s for s in [PINNED[family], *range(100, 100 + SEARCH_SEEDS)] if _diverging_row(model, family, s)),
                    None)
        assert seed is not None, "the forced tie flip must change a row's tokens"
        div = explain_dllm_batch_row(model, _prompts(seed), 0, None, overrides=_kw(family))
    assert div is not None and div.kind == "router", div
    assert div.deviation_ulps > DEVIATION_ULPS  # the logit rule alone would refuse: the expert moved the logits
    assert div.same_state and div.replay and div.layer is not None
    assert div.gap is not None and div.bound is not None and div.gap <= div.bound
    assert div.near_tie and div.reason == "", div.reason
    assert div.to_dict()["kind"] == "router"


@pytest.mark.parametrize("family", ROUTED)
def test_router_flipped_far_beyond_rounding_is_refused(request, family) -> None:
    model = _tied(request, family)
    with _batched_flips(model, far=True):
        div = explain_dllm_batch_row(model, _prompts(PINNED[family]), 0, None, overrides=_kw(family))
    assert div is not None and div.kind == "router" and not div.near_tie, div
    assert div.same_state and div.replay  # points 1 and 2 hold: only the router's choice is wrong
    assert div.gap is not None and div.bound is not None and div.gap > 10 * div.bound
    assert "beyond its rounding bound" in div.reason


def test_router_recorder_restores_the_routers(request) -> None:
    """Recording changes no output and leaves no wrapper behind."""
    model = load_model(request.getfixturevalue("tiny_llada_moe"), dtype=torch.bfloat16)
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model(ids).logits
    with RouterRecorder(model) as rec:
        recorded = model(ids).logits
    assert torch.equal(plain, recorded)
    assert len(rec.forwards) == 1 and len(rec.forwards[0].calls) == len(routers_of(model)) == 2
    assert all("route" not in vars(r) for r in routers_of(model))
    assert rec.forwards[0].calls[0].chosen.shape == (4, 2)


#: the CPU capability (torch.backends.cpu.get_cpu_capability()) the real flips below were found on
PINNED_ON = "AVX2"
#: real bfloat16 router flips (family, decoding options, prompt seed, row), found on a PINNED_ON CPU
REAL_FLIPS = [
    ("llada2", dict(gen_length=8, block_length=4, temperature=0.0, steps=4, threshold=1.0, cache="prefix"), 12, 0),
    ("llada_moe", dict(gen_length=8, block_length=4, temperature=0.0, steps=4, cache="none"), 24, 0),
    ("sdar_moe", dict(gen_length=8, block_length=4, temperature=0.0, steps=4), 28, 0),
]
#: further prompt seeds the bounded search tries (per family) when no pinned row flips on this machine
SEARCH_SEEDS = 6


def _ragged(seed: int) -> list[list[int]]:
    """Three ragged prompts (lengths 1..8, ids 5..249) from ``seed`` (as tests/test_batch_near_ties.py draws them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (3,), generator=g).tolist()
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in lengths]


def test_real_bfloat16_router_flip_is_proven(request) -> None:
    """A batched row of an unmodified tiny MoE model that leaves its prompt alone at a router flip: proven by the
    router kind (the logit rule alone would refuse it). Every divergence met on the way is proven too."""
    models = {f: load_model(request.getfixturevalue(f"tiny_{f}"), dtype=torch.bfloat16) for f, *_ in REAL_FLIPS}
    candidates = [(f, kw, seed, row) for f, kw, seed, row in REAL_FLIPS]
    candidates += [(f, kw, s, r) for f, kw, seed, _ in REAL_FLIPS
                   for s in range(seed + 1, seed + 1 + SEARCH_SEEDS) for r in range(3)]
    for family, kw, seed, row in candidates:
        div = explain_dllm_batch_row(models[family], _ragged(seed), row, None, overrides=kw)
        if div is None:
            continue
        assert div.near_tie, f"{family} seed {seed} row {row}: {div.reason}"
        if div.kind == "router":
            assert div.deviation_ulps > DEVIATION_ULPS and div.layer is not None
            assert div.gap is not None and div.bound is not None and div.gap <= div.bound
            return
    message = (f"no batched row of a tiny MoE model left its prompt at a router flip in {len(candidates)} "
               "candidates on this machine (the router kind is not exercised): widen SEARCH_SEEDS or pin a case")
    here = torch.backends.cpu.get_cpu_capability()
    if here != PINNED_ON:  # other kernels round other rows: no flip among these seeds is no fault of the rule
        pytest.skip(f"{message}; the cases were pinned on a {PINNED_ON} CPU and this one is {here}")
    pytest.fail(message)


# ------------------------------------------------------------------------- the judge on synthetic forwards
def _gate(n_group: int = 4, topk_group: int = 2, top_k: int = 2, experts: int = 8) -> LLaDA2MoeGate:
    cfg = LLaDA2MoeConfig(hidden_size=4, num_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                          topk_group=topk_group)
    gate = LLaDA2MoeGate(cfg)
    nn.init.normal_(gate.weight)
    return gate


class _Softmax(nn.Module):
    """A stand-in softmax router (no bias): ranks its logits."""

    expert_bias = None


def _forward(inputs: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, router: nn.Module) -> RouterRecorder:
    """A recorder holding one forward of one row: ``inputs [L, H]``, ``logits [L, E]``, ``chosen [L, k]``; its
    output logits ``[1, L, 3]`` are the inputs' first three columns (the step's window: all of it)."""
    rec = RouterRecorder(None)
    fwd = RecordedForward((1, inputs.shape[0]), [RouterCall(0, inputs, logits, chosen, router)], inputs[None, :, :3])
    rec.forwards.append(fwd)
    return rec


def test_judge_refuses_router_inputs_beyond_rounding() -> None:
    """(a): a flip whose router inputs already differ beyond rounding is not a router near tie."""
    h = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    tied = torch.tensor([[1.0, 1.0, 0.0]])
    ref = _forward(h, tied, torch.tensor([[0]]), _Softmax())
    near = _forward(h, tied, torch.tensor([[1]]), _Softmax())
    flip = judge_router_flip(ref, h[None, :, :3], near, h[None, :, :3], torch.bfloat16)
    assert flip.proven and flip.gap == 0.0 and flip.input_ulps == 0.0
    h2 = h * 1.5  # the states reaching the router differ by far more than rounding
    moved = _forward(h2, tied, torch.tensor([[1]]), _Softmax())
    flip = judge_router_flip(ref, h[None, :, :3], moved, h2[None, :, :3], torch.bfloat16)
    assert not flip.proven and flip.layer == 0 and "router inputs" in flip.note


def test_judge_refuses_logits_moved_without_a_flip() -> None:
    h = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    ref = _forward(h, logits, torch.tensor([[0]]), _Softmax())
    other = _forward(h, logits, torch.tensor([[0]]), _Softmax())
    flip = judge_router_flip(ref, h[None, :, :3], other, h[None, :, :3], torch.bfloat16)
    assert not flip.proven and flip.layer is None and "same experts" in flip.note
    lost = judge_router_flip(ref, h[None, :, :3] + 1, other, h[None, :, :3], torch.bfloat16)
    assert not lost.proven and "not recorded" in lost.note


def test_softmax_margin_is_the_logit_gap_within_the_rule_bound() -> None:
    router = _Softmax()
    one_ulp = rounding_bound(2.0, 2.0, torch.bfloat16, ulps=1.0)
    ref = torch.tensor([2.0 + one_ulp, 2.0, -1.0])
    gap, bound, what = flip_margin(router, ref, ref, [0], [1], torch.bfloat16)
    assert what == "experts" and gap == pytest.approx(one_ulp) and bound == rounding_bound(2.0, 0.0, torch.bfloat16)
    far = torch.tensor([2.0, -1.0, 0.0])
    gap, bound, _ = flip_margin(router, far, far, [0], [1], torch.bfloat16)
    assert gap == pytest.approx(3.0) and gap > bound


def test_llada2_group_flip_is_judged_on_group_scores() -> None:
    """Group-limited top-k: a flipped group set is judged on the boundary between group scores (sum of the two best
    experts of each group), with twice an expert's bound; a far group is refused."""
    gate = _gate()
    # groups (0,1) (2,3) (4,5) (6,7); scores: group 0 and group 1 tied, group 2 best, group 3 worst
    lg = torch.tensor([0.2, 0.1, 0.2, 0.1, 1.0, 0.9, -3.0, -3.0])
    kept, group_scores = kept_groups(gate, choice_scores(gate, lg[None])[0])
    assert len(kept) == 2 and 2 in kept and group_scores[0] == group_scores[1]
    swap = ({0, 1} - kept).pop()  # the tied group the tie-break dropped
    other_groups = {2, swap}
    ref_pick = [4, 5]
    bumped = lg.clone()
    bumped[2 * swap] += rounding_bound(1.0, 0.0, torch.bfloat16, ulps=1.0)  # one ulp lifts the other tied group
    kept_b, _ = kept_groups(gate, choice_scores(gate, bumped[None])[0])
    assert kept_b == other_groups
    gap, bound, what = flip_margin(gate, lg, bumped, ref_pick, ref_pick, torch.bfloat16)
    assert what == "groups" and gap <= bound
    wide = lg.clone()
    wide[6:] = 3.0  # group 3 leaps ahead: a flip no rounding makes
    gap, bound, what = flip_margin(gate, lg, wide, ref_pick, [4, 6], torch.bfloat16)
    assert what == "groups" and gap > bound
