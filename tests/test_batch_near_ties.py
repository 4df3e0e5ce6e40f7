"""Batched rows in half precision: every row that leaves its prompt decoded alone does so at a proven near tie
(issue 29, item 4; the rule: :mod:`spiffy.bench.batch_fidelity`).

The cases below are batches (ragged, left padded) on tiny random checkpoints in bfloat16 whose rows differ from the
prompts alone. Which rows differ depends on the CPU (its matmul kernels: AVX-512 or AVX2 reduce in other orders), so
each case is a pinned batch (found on one machine) followed by a bounded search over further prompt seeds and rows
for a row of the same decision kind; each test first checks that a row does differ (so the rule is exercised), then
that the proof holds,
for every decision kind: dLLM low-confidence unmasking (T = 0 and T > 0), dLLM sampled draws (LLaDA's Gumbel noise,
Dream's multinomial), batched Spiffy, AR greedy (coupled rule), AR coupled sampling at T > 0, AR rejection sampling
and a flipped DDTree draft. The rule can fail: a batched forward that moves the row's logits by more than rounding,
and a batched row drawing other coins, are reported as not near ties. ``spiffy bench --batch-sizes`` reports the same
proofs for the rows it finds differing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig
from spiffy.bench import batch_fidelity, batch_fidelity_ar
from spiffy.bench.batch_fidelity import (
    BATCH_NEAR_TIE_RULE,
    DEVIATION_ULPS,
    confidence_bound,
    deviation_ulps,
    explain_dllm_batch_row,
)
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.bench.throughput import dllm_methods, markdown_throughput, measure, throughput_report
from spiffy.decoding import DecodeConfig
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.loading import load_model
from spiffy.selfspec.oracle import random_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _prompts(seed: int) -> list[list[int]]:
    """Three ragged prompts (lengths 1..8, ids 5..249) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (3,), generator=g).tolist()
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in lengths]


_BF16: dict[str, torch.nn.Module] = {}


def _bf16(request: pytest.FixtureRequest, family: str) -> torch.nn.Module:
    if family not in _BF16:
        _BF16[family] = load_model(request.getfixturevalue(f"tiny_{family}"), dtype=torch.bfloat16)
    return _BF16[family]


def _kw(temperature: float, cache: str | None = None, **extra) -> dict:
    kw = dict(gen_length=8, block_length=4, temperature=temperature, steps=4, **extra)
    if cache is not None:
        kw["cache"] = cache
    return kw


#: (family, prompt seed, row, decoding kwargs, kind) of batched baseline rows that differ from alone in bfloat16
DLLM_CASES = [
    ("llada", 1, 2, _kw(0.0, "prefix"), "low-confidence"),
    ("llada", 0, 2, _kw(1.0, "none"), "low-confidence"),
    pytest.param("llada", 8, 0, _kw(1.0, "dual"), "sampled", marks=pytest.mark.slow),  # Dream's sampled case: fast
    ("dream", 0, 2, _kw(1.0, "none", alg="maskgit_plus"), "sampled"),
    ("sdar", 7, 0, _kw(0.0), "low-confidence"),
]


#: how many further prompt seeds a case searches when its pinned batch does not diverge on this CPU
SEARCH_SEEDS = 40


def _candidates(seed: int, row: int) -> list[tuple[int, int]]:
    """The pinned ``(seed, row)`` first, then every row of :data:`SEARCH_SEEDS` further seeds."""
    return [(seed, row)] + [(s, r) for s in range(seed + 1, seed + 1 + SEARCH_SEEDS) for r in range(3)]


def _first_divergence(explain, candidates: list[tuple], kind: str | None):  # noqa: ANN001, ANN202
    """The first candidate's divergence of ``kind`` (any kind: ``None``); fails when the bounded search finds none.
    ``explain(*candidate)`` gives a candidate's divergence or ``None``."""
    for candidate in candidates:
        div = explain(*candidate)
        if div is not None and (kind is None or div.kind == kind):
            return div
    pytest.fail(f"no batched row of kind {kind} differs from its prompt alone in {len(candidates)} candidates on "
                "this machine (the rule is not exercised): widen SEARCH_SEEDS or pin a case for it")


def _cache_variants(kw: dict) -> list[dict]:
    """``kw`` first, then (for a rule with a cache mode) the same rule in the other cache modes: which modes put a
    decision of a given kind within rounding is the CPU's business too."""
    if "cache" not in kw:
        return [kw]
    return [kw] + [dict(kw, cache=mode) for mode in ("none", "prefix", "dual") if mode != kw["cache"]]


@pytest.mark.parametrize(("family", "seed", "row", "kw", "kind"), DLLM_CASES)
def test_dllm_batch_divergence_is_a_near_tie(request, family, seed, row, kw, kind) -> None:
    model = _bf16(request, family)
    candidates = [(variant, s, r) for variant in _cache_variants(kw) for s, r in _candidates(seed, row)]
    div = _first_divergence(lambda v, s, r: explain_dllm_batch_row(model, _prompts(s), r, None, overrides=v),
                            candidates, kind)
    assert div.kind == kind and div.same_state and div.replay
    assert div.deviation_ulps is not None and div.deviation_ulps <= DEVIATION_ULPS
    assert div.gap is not None and div.bound is not None and div.gap <= div.bound
    assert div.near_tie, div


def test_batched_spiffy_divergence_is_a_near_tie(request) -> None:
    graph = random_graph(levels=2, nodes=6, seed=1, i_max=4, j_max=3)
    kw = dict(gen_length=8, block_length=4, temperature=0.0, steps=8, cache="prefix")
    div = explain_dllm_batch_row(_bf16(request, "llada"), _prompts(4), 0, None, graph=graph, budget=3, overrides=kw)
    assert div is not None and div.kind == "low-confidence" and div.near_tie, div


def test_a_batched_forward_off_by_more_than_rounding_is_no_near_tie(request, monkeypatch) -> None:
    """Break the batched path on purpose: its forward adds 0.25 to one logit of every row (a logic error, far above
    bfloat16's rounding at these magnitudes); the proof must refuse it."""
    real = batch_fidelity.run_baseline_batch

    def skewed(fwd, rows):  # noqa: ANN001, ANN202
        inner = fwd.forward_states

        def forward_states(states, rows=None):  # noqa: ANN001, ANN202
            out = inner(states, rows=rows).clone()
            out[..., 7] += 0.25
            return out
        fwd.forward_states = forward_states
        return real(fwd, rows)

    monkeypatch.setattr(batch_fidelity, "run_baseline_batch", skewed)
    model = _bf16(request, "llada")
    div = _first_divergence(lambda s, r: explain_dllm_batch_row(model, _prompts(s), r, None, overrides=_kw(0.0, "none")),
                            _candidates(1, 2), None)
    assert div.replay and div.deviation_ulps > DEVIATION_ULPS and not div.near_tie


def test_a_batched_row_with_other_coins_is_no_near_tie(request, monkeypatch) -> None:
    """Break it another way: batched rows seeded differently from the prompts alone (the bug per-row generators
    fixed); the first differing step then starts from another generator state."""
    real = batch_fidelity.row_generators
    monkeypatch.setattr(batch_fidelity, "row_generators", lambda n, device: real(n, device, seeds=[99] * n))
    div = explain_dllm_batch_row(_bf16(request, "llada"), _prompts(8), 0, None, overrides=_kw(1.0, "dual"))
    assert div is not None and not div.same_state and not div.near_tie


def test_deviation_and_confidence_bounds() -> None:
    a = torch.tensor([[4.0, 1.0, -2.0]])
    assert deviation_ulps(a, a, torch.bfloat16) == 0.0
    assert deviation_ulps(a, a + torch.tensor([[2.0**-5, 0.0, 0.0]]), torch.bfloat16) == 1.0  # ulp at 4 = 2**-5
    # a probability moves by at most (exp(2d) - 1) (exp(2d) + c) for logits moving by d (4 ulps at scale 1: 4 * 2**-7)
    d = 4 * 2.0**-7
    grow = torch.tensor(2 * d).exp().item()
    assert confidence_bound([0.5, 0.25], 1.0, torch.bfloat16) == pytest.approx(2 * (grow - 1) * (grow + 0.5))
    assert "replayed" in BATCH_NEAR_TIE_RULE


# ---------------------------------------------------------------------------------------------------------- AR
@pytest.fixture(scope="module")
def ar_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("near_tie_ar")
    t = make_tiny_target(root / "target", seed=3, num_layers=3, with_tokenizer=False)
    d = make_tiny_dflash(root / "drafter", t, seed=4, num_layers=2, block_size=8)
    return load_target(t, torch.bfloat16, "cpu"), load_drafter(d, dtype=torch.bfloat16)


def _ar_prompts(trial: int) -> list[list[int]]:
    """The prompts of trial ``trial`` of the search that found these cases (one generator across trials)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(trial + 1):
        lengths = torch.randint(2, 9, (3,), generator=g).tolist()
        prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]
    return prompts


#: (trial, row, method, acceptance rule, temperature, kind)
AR_CASES = [
    (6, 2, "dflash", "coupled", 0.0, "greedy"),
    pytest.param(8, 0, "dflash", "coupled", 0.7, "sampled", marks=pytest.mark.slow),
    pytest.param(4, 1, "dflash", "rejection", 0.7, "sampled", marks=pytest.mark.slow),  # the heaviest three: slow tier
    pytest.param(13, 0, "ddtree", "coupled", 0.0, "draft", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("trial", "row", "method", "accept", "temperature", "kind"), AR_CASES)
def test_ar_batch_divergence_is_a_near_tie(ar_pair, trial, row, method, accept, temperature, kind) -> None:
    target, drafter = ar_pair
    cfg = ARSpecConfig(method=method, budget=8, accept=accept, max_new_tokens=24,
                       sampling=SamplingConfig(temperature=temperature, seed=trial))
    div = _first_divergence(
        lambda t, r: explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), _ar_prompts(t),
                                          r, replace(cfg, sampling=SamplingConfig(temperature=temperature, seed=t))),
        _candidates(trial, row), kind)
    assert div.kind == kind and div.same_state and div.replay and div.near_tie, div
    if kind != "draft":
        assert div.gap is not None and div.gap <= div.bound


def test_ar_batch_with_other_coins_is_no_near_tie(ar_pair, monkeypatch) -> None:
    """Break the batched AR path on purpose: its rows sample with another seed than the prompt alone."""
    target, drafter = ar_pair
    cfg = ARSpecConfig(method="dflash", accept="rejection", max_new_tokens=24,
                       sampling=SamplingConfig(temperature=0.7, seed=4))
    real = batch_fidelity_ar.speculative_generate_batch

    def reseeded(target, drafters, prompts, config, rules):  # noqa: ANN001, ANN202
        other = ARSpecConfig(method=config.method, accept=config.accept, max_new_tokens=config.max_new_tokens,
                             sampling=SamplingConfig(temperature=0.7, seed=5))
        for r in rules:
            r.inner = batch_fidelity_ar.make_rule(other)
        return real(target, drafters, prompts, config, rules=rules)

    monkeypatch.setattr(batch_fidelity_ar, "speculative_generate_batch", reseeded)
    div = explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), _ar_prompts(4), 1, cfg)
    assert div is not None and not div.near_tie


# ------------------------------------------------------------------------------------------------------- bench
def test_bench_reports_batched_divergences_with_their_proofs(request) -> None:
    model = _bf16(request, "llada")
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=4, cache="prefix")
    methods = dllm_methods(model, None, cfg, None, [], "cpu", {})
    rows = measure(methods, _prompts(1), [1, 3], "cpu", warmup=0)
    batched = next(r for r in rows if r["batch_size"] == 3)
    assert batched["identical_to_batch_1"] < 1.0
    assert batched["divergences"] and batched["all_divergences_near_ties"]
    assert all(d["near_tie"] and d["kind"] == "low-confidence" for d in batched["divergences"])
    md = markdown_throughput(throughput_report("dllm", rows, model=model, device="cpu", meta={"prompts": 3}))
    assert "near tie" in md and "spiffy.bench.batch_fidelity" in md
