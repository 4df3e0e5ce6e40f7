"""Draft ranks follow the baseline's own choice of positions (spiffy.selfspec.formulas.selection_order): the order
in which the families' selection rules, applied one step at a time, pick positions from fixed confidences, ties and
half-precision roundings included; and the sessions publish the confidences their rule ranked."""

from __future__ import annotations

import pytest
import torch

from spiffy.decoding import StepRecord, make_session, run_baseline
from spiffy.decoding.schedules import topk_transfer
from spiffy.decoding.sdar_rule import select_transfer
from spiffy.decoding.session import TransitionProbs
from spiffy.embedded import embedded_model_path
from spiffy.models.loading import load_model, load_tokenizer
from spiffy.selfspec.formulas import rank_state, selection_order

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _sdar_rule(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    return select_transfer(masked[None], conf[None], None, 1, "low_confidence_static", 0.9, 0.35)[0]


def _topk_rule(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:  # LLaDA / Fast-dLLM / Dream
    return topk_transfer(torch.where(masked, conf, -torch.inf)[None], [1])[0]


def _baseline_picks(rule, conf: torch.Tensor, candidates: torch.Tensor, count: int) -> list[int]:
    """Apply ``rule`` step after step on unchanging confidences: the positions in the order it unmasks them."""
    masked = candidates.clone()
    picks = []
    for _ in range(count):
        (idx,) = rule(conf, masked).nonzero(as_tuple=True)
        assert idx.numel() == 1
        picks.append(int(idx))
        masked[idx] = False
    return picks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rule", [_sdar_rule, _topk_rule], ids=["sdar", "topk"])
def test_order_is_the_order_the_baseline_picks_in(dtype, rule):
    gen = torch.Generator().manual_seed(0)
    levels = torch.tensor([1.0, 0.999, 0.75, 0.5, -torch.inf])  # few levels: many exact ties (0.999 is 1.0 in bf16)
    for _ in range(30):
        width = int(torch.randint(4, 40, (1,), generator=gen))
        conf = levels[torch.randint(0, 4, (width,), generator=gen)].to(dtype)
        candidates = torch.rand(width, generator=gen) < 0.8
        candidates[int(torch.randint(0, width, (1,), generator=gen))] = True
        cols = candidates.nonzero()[:, 0]
        count = int(cols.numel())
        order = selection_order(torch.where(candidates, conf, -torch.inf), cols, count)
        assert cols[order].tolist() == _baseline_picks(rule, conf, candidates, count)
        # a shorter request is a prefix of the full order
        assert torch.equal(selection_order(torch.where(candidates, conf, -torch.inf), cols, count // 2),
                           order[: count // 2])


def test_candidates_at_minus_infinity_come_last_and_once():
    scores = torch.tensor([0.5, -torch.inf, 0.9, -torch.inf, -torch.inf, 0.5])
    cols = torch.tensor([0, 1, 2, 4, 5])  # column 3 is not a candidate
    order = selection_order(scores, cols, 5)
    picked = cols[order].tolist()
    assert picked[0] == 2 and set(picked[1:3]) == {0, 5} and sorted(picked[3:]) == [1, 4]


def test_rank_state_orders_by_the_published_selection():
    v, w = 6, 8
    logits = torch.zeros(w, v)
    logits[:, 2] = 30.0  # every row saturated on token 2: equal confidences, in any dtype
    x = torch.full((w,), 99)
    x[[1, 4]] = 7  # decoded rows
    masked = (x == 99)
    selection = torch.where(masked, torch.ones(w), -torch.inf)
    plain = rank_state(logits, x, 0, w, 0, w, 2, mask_id=99)
    assert plain.rows.tolist() == masked.nonzero()[:, 0].tolist()  # without it: ties go to the lower row
    ranked = rank_state(logits, x, 0, w, 0, 3, 2, mask_id=99, probs=TransitionProbs(selection=selection[None]))
    expected = _baseline_picks(_topk_rule, torch.ones(w), masked, 3)
    assert ranked.rows.tolist() == expected and ranked.token_ids[:, 0].tolist() == [2, 2, 2]
    # the selection frame may start before the block (LLaDA without cache ranks the whole sequence); the ties then
    # fall as the baseline's topk breaks them on that longer vector
    shifted = torch.cat([torch.full((5,), -torch.inf), selection])
    again = rank_state(logits, x, 0, w, 0, 3, 2, mask_id=99, probs=TransitionProbs(selection=shifted, selection_start=-5))
    frame_masked = torch.cat([torch.zeros(5, dtype=torch.bool), masked])
    assert again.rows.tolist() == [p - 5 for p in _baseline_picks(_topk_rule, torch.ones(w + 5), frame_masked, 3)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdar_session_publishes_the_confidences_its_rule_ranked(temperature):
    path = embedded_model_path("dllm")
    model, tok = load_model(path, dtype="bfloat16"), load_tokenizer(path)
    ids = torch.tensor([tok("def add(a, b):\n", add_special_tokens=False)["input_ids"]])
    session = make_session(model, ids, None, tokenizer=tok, gen_length=32, block_length=32, steps=32,
                           temperature=temperature, seed=0)
    records: list[StepRecord] = []
    run_baseline(session, observer=records.append)
    for rec in records[:4]:
        published = rec.probs
        if temperature > 0:
            assert published is None or published.selection is None
            continue
        sel = published.selection
        start, end = rec.info.block_start, rec.info.block_end
        assert sel.dtype == torch.bfloat16 and sel.shape == (1, end - start) and published.selection_start == start
        masked = rec.x_before[0, start:end] == session.mask_id
        assert bool(torch.isinf(sel[0][~masked]).all()) and bool(torch.isfinite(sel[0][masked]).all())
        chosen = (rec.x_before[0, start:end] != rec.x_after[0, start:end]).nonzero()[:, 0]
        assert chosen.tolist() == [int(torch.topk(sel[0], 1).indices)]  # what the rule picked from it
