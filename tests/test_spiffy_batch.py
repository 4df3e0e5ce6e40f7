"""Batched Spiffy: row r of a batch decodes exactly like prompt r alone (float64, tiny checkpoints, all families).

Every case compares each row with the single-prompt baseline (tokens), with single-prompt Spiffy (tokens and the
number of forwards that served the row) and with the same row of the batched baseline, over ragged left-padded
prompts (SDAR too: rows keep their own block anchoring), every cache mode, T=0 and T>0 with per-row seeds, and rules
whose blocks finish after different numbers of steps per row (threshold; SDAR stop tokens).
"""

from __future__ import annotations

import pytest
import torch

from batch_cases import BLOCK, GEN, SEEDS, dream, fast_dllm_v2, llada, llada2, llada_moe, sdar, sdar_moe  # noqa: F401 - module fixtures
from batch_cases import decode_kwargs as _kw
from batch_cases import left_pad as _left_pad
from batch_cases import ragged_prompts as _prompts
from pairwise import pairwise_params
from spiffy.api import generate
from spiffy.decoding import make_session, run_baseline
from spiffy.decoding.dream_generation import MODEL_CARD_CALLS, card_decode_options
from spiffy.errors import ConfigError
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory
from spiffy.selfspec.runtime import speculative_generate



pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _check_batch(model, prompts: list[torch.Tensor], kw: dict, graph_rows: tuple[int, ...] = (0, 1, 2),
                 same_forwards: bool = True) -> dict:
    """Alone baseline + alone Spiffy per prompt vs one batched Spiffy call; returns figures for extra checks.
    The oracle graph is calibrated on the alone trajectories of ``graph_rows``. ``same_forwards=False``: a row's
    forward count is not compared (drafts ranked at near ties may differ by rounding; the tokens never do)."""
    records, alone = [], []
    for r, (x, seed) in enumerate(zip(prompts, SEEDS)):
        s = make_session(model, x[None], **{**kw, "seed": seed})
        recs = record_trajectory(s)
        if r in graph_rows:
            records.extend(recs)
        alone.append((s.x[0, len(x) : len(x) + GEN].clone(), s.nfe))
    graph = oracle_graph_from_records(records, make_session(model, prompts[0][None], **kw).mask_id)
    budget = len(graph.nodes)
    spec_nfe = []
    for x, seed, (tokens, _) in zip(prompts, SEEDS, alone):
        s = make_session(model, x[None], **{**kw, "seed": seed})
        st = speculative_generate(s, graph, budget=budget)
        assert torch.equal(s.x[0, len(x) : len(x) + GEN], tokens)
        spec_nfe.append(st.nfe)
    ids, am = _left_pad(prompts)
    equal = all(len(x) == len(prompts[0]) for x in prompts)
    out = generate(
        model, ids, attention_mask=None if equal else am, graph=graph, budget=budget, seeds=SEEDS[: len(prompts)], **kw
    )
    rows = out.stats["rows"]
    base = generate(model, ids, attention_mask=None if equal else am, seeds=SEEDS[: len(prompts)], **kw)
    for r, (tokens, base_nfe) in enumerate(alone):
        assert out.tokens[r] == tokens.tolist(), f"row {r} differs from the prompt decoded alone for {kw}"
        assert base.tokens[r] == out.tokens[r], f"row {r} of batched Spiffy differs from the batched baseline's"
        assert base.stats["rows"][r]["nfe"] == base_nfe
        assert rows[r]["nfe"] == spec_nfe[r] or not same_forwards, f"row {r} was served by another number of forwards than alone"
        assert rows[r]["baseline_equivalent_nfe"] == base_nfe
    assert max(spec_nfe) <= out.nfe < sum(spec_nfe)  # one forward serves several rows
    assert torch.equal(base.sequences, out.sequences)
    assert sum(r["accepted_total"] for r in rows) > 0
    return {"out": out, "spec_nfe": spec_nfe, "alone": alone}


@pytest.mark.parametrize(("family", "rule", "cache", "temp"), pairwise_params(
    ["llada", "llada_moe"], ["static", "threshold"], ["none", "prefix", "dual"], [0.0, 1.0]))
def test_llada_batch_equals_alone(request, family: str, rule: str, cache: str, temp: float) -> None:
    _check_batch(request.getfixturevalue(family), _prompts([4, 7, 2]), _kw(rule, cache, temp))


@pytest.mark.parametrize(("rule", "cache", "temp"), pairwise_params(["static", "threshold"], ["none", "prefix", "dual"],
                                                                  [0.0, 1.0]))
def test_dream_batch_equals_alone(dream, rule: str, cache: str, temp: float) -> None:
    _check_batch(dream, _prompts([4, 7, 2]), _kw(rule, cache, temp, alg="entropy"))


#: (lengths, temperature). A one-block prompt (8) only at T > 0: at T = 0 this checkpoint, decoding that block from an
#: empty context (the official quirk), proposes the mask id for a position forever (the official loop never ends; the
#: session stops at its step bound). From an empty context the masked positions differ only by their positions, so
#: their confidences nearly tie: Spiffy's draft ranking may then differ by rounding between the row alone and in a
#: batch (logits equal to ~1e-15), so that case compares tokens, not forward counts.
FDV2_BATCHES = [([5, 5, 5], 0.0), ([5, 5, 5], 1.0), ([3, 11, 6], 0.0), ([3, 11, 6], 1.0), ([5, 8, 16], 1.0),
                ([3, 16, 6], 0.0)]


@pytest.mark.parametrize("threshold", [1.0, 0.05])
@pytest.mark.parametrize("lengths, temp", FDV2_BATCHES)
def test_fast_dllm_v2_batch_equals_alone(fast_dllm_v2, threshold: float, temp: float, lengths: list[int]) -> None:
    """Rows keep their own layout: a prompt of one whole block (ignored, the official quirk), an aligned prompt whose
    first block starts with the prefill's argmax (its head), unaligned prompts sharing their first block."""
    kw = dict(gen_length=GEN, block_length=BLOCK, small_block_size=4, threshold=threshold, temperature=temp,
              stop_token_ids=())
    _check_batch(fast_dllm_v2, _prompts(lengths), kw, same_forwards=8 not in lengths)
@pytest.mark.parametrize("card", list(MODEL_CARD_CALLS))
def test_dream_variant_card_calls_batch_equals_alone(dream, card: str) -> None:
    """Dream-Coder's and DiffuCoder's recommended calls (TOKEN_PER_STEP 2) on ragged left-padded prompts."""
    # one block per prompt: the oracle graph comes from one trajectory (records of two prompts would run together)
    _check_batch(dream, _prompts([4, 7, 2]), card_decode_options(card, GEN, 2), graph_rows=(0,))


@pytest.mark.parametrize(("family", "lengths", "strategy", "temp"), pairwise_params(
    ["sdar", "sdar_moe"], [[5, 5, 5], [5, 8, 13], [3, 8, 6]], ["low_confidence_static", "low_confidence_dynamic"],
    [0.0, 1.0]))
def test_sdar_batch_equals_alone(request, family: str, strategy: str, temp: float, lengths: list[int]) -> None:
    """Ragged: 5 and 13 tokens leave their last prompt block unaligned, 8 fills one block (one decode block less,
    left padded by one block beside 5); 3, 8 and 6 end in the same block (no padding, 8 starts a block later)."""
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, strategy=strategy, denoising_steps=BLOCK // 2)
    if strategy == "low_confidence_dynamic":
        kw["threshold"] = 0.05
    _check_batch(request.getfixturevalue(family), _prompts(lengths), kw)


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("lengths", [[5, 5, 5], [5, 8, 13]], ids=["equal", "ragged"])
def test_llada2_batch_equals_alone(llada2, cache: str, temp: float, lengths: list[int]) -> None:
    """LLaDA2.0 rows (SDAR's block layout: ragged prompts keep their own block anchoring) under both cache modes;
    the official rule with a low threshold so blocks finish after different numbers of steps per row."""
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, cache=cache, denoising_steps=BLOCK // 2,
              threshold=0.05)
    _check_batch(llada2, _prompts(lengths), kw)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [5, 8, 13]], ids=["equal", "ragged"])
def test_sdar_rows_stopping_early(sdar, lengths: list[int]) -> None:
    """Row 0 produces a stop token in its first block and stops; the others keep decoding."""
    prompts = _prompts(lengths)
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=0.0, denoising_steps=BLOCK)
    probe = make_session(sdar, prompts[0][None], **{**kw, "seed": SEEDS[0]})
    run_baseline(probe)
    first = int(probe.x[0, probe.block_bounds(0)[0] + BLOCK - 1])
    res = _check_batch(sdar, prompts, {**kw, "stop_token_ids": (first,)}, graph_rows=(1,))
    assert res["out"].stats["rows"][0]["steps_per_block"][-1] == 0


def test_batch_errors(llada, sdar) -> None:
    prompts = _prompts([4, 6])
    ids, am = _left_pad(prompts)
    s = make_session(llada, prompts[0][None], gen_length=GEN, block_length=BLOCK)
    graph = oracle_graph_from_records(record_trajectory(s), s.mask_id)
    with pytest.raises(ConfigError, match="seeds"):
        generate(llada, ids, attention_mask=am, graph=graph, seeds=[1], gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ConfigError, match="left"):  # right padding: SDAR rows are laid out from the left padding
        generate(sdar, ids, attention_mask=am.flip(1), graph=graph, gen_length=GEN, block_length=BLOCK)


def test_familiar_wrappers_take_batches(llada, sdar) -> None:
    """LLaDA ``generate`` (left padded, attention_mask) and SDAR ``block_diffusion_generate`` (equal lengths) with a
    graph: every row equals the prompt decoded alone by the same wrapper (LLaDA: a rule without random draws; at
    T > 0 the wrapper follows the official batch-shared stream, which Spiffy cannot: tests/test_compat_batches.py)."""
    from spiffy.compat import llada_generate, sdar_block_diffusion_generate

    prompts = _prompts([4, 6])
    ids, am = _left_pad(prompts)
    s = make_session(llada, prompts[0][None], gen_length=GEN, block_length=BLOCK)
    graph = oracle_graph_from_records(record_trajectory(s), s.mask_id)
    kw = dict(steps=GEN, gen_length=GEN, block_length=BLOCK, temperature=0.0, graph=graph)
    batched = llada_generate(llada, ids, attention_mask=am, **kw)
    for r, x in enumerate(prompts):
        alone = llada_generate(llada, x[None], **kw)
        assert torch.equal(batched[r, -GEN:], alone[0, -GEN:])
    with pytest.raises(ConfigError, match="one generator"):
        llada_generate(llada, ids, attention_mask=am, **{**kw, "temperature": 1.0})
    prompts = _prompts([5, 5])
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=1.0, seed=4, graph=graph)
    batched = sdar_block_diffusion_generate(sdar, torch.stack(prompts), **kw)
    for r, x in enumerate(prompts):
        assert torch.equal(batched[r], sdar_block_diffusion_generate(sdar, x[None], **kw)[0])
