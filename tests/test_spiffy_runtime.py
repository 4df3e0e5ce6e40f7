"""Spiffy speculative decoding reproduces the baseline token for token (float64, tiny checkpoints, all families).

Matrix: family x rule (1 token/step, several per step, threshold / dynamic) x cache mode x temperature (0 and 1.0
seeded) with two edge graphs: an oracle graph calibrated on the baseline's own trajectory (much accepted: the NFE
drop must equal the accepted drafts plus reused no-op steps, and be > 0) and a random graph (little accepted).
"""

from __future__ import annotations

import pytest
import torch

from conftest import load_f64
from pairwise import pairwise_params
from spiffy.decoding.dream_generation import MODEL_CARD_CALLS, card_decode_options
from spiffy.decoding import make_session, run_baseline
from spiffy.api import generate
from spiffy.errors import ConfigError
from spiffy.selfspec.oracle import oracle_graph_from_records, random_graph, record_trajectory
from spiffy.selfspec.runtime import STAGES, speculative_generate

GEN, BLOCK, PROMPT = 16, 8, 4


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 250, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _threshold(model, family: str) -> float:
    """A confidence threshold crossing a few positions per step on this random model (90th percentile)."""
    kw = dict(gen_length=GEN, block_length=BLOCK)
    s = make_session(model, _prompt(), **kw)
    recs = record_trajectory(s)
    conf = torch.cat([r.logits[0].softmax(-1).max(-1).values for r in recs])
    return float(torch.quantile(conf, torch.tensor(0.9, dtype=conf.dtype)))


@pytest.fixture(scope="module")
def llada(tiny_llada):
    m = load_f64(tiny_llada, cached=True)
    return m, _threshold(m, "llada")


@pytest.fixture(scope="module")
def llada_moe(tiny_llada_moe):
    m = load_f64(tiny_llada_moe, cached=True)
    return m, _threshold(m, "llada_moe")


@pytest.fixture(scope="module")
def dream(tiny_dream):
    m = load_f64(tiny_dream, cached=True)
    return m, _threshold(m, "dream")


@pytest.fixture(scope="module")
def fast_dllm_v2(tiny_fast_dllm_v2):
    m = load_f64(tiny_fast_dllm_v2, cached=True)
    return m, _threshold(m, "fast_dllm_v2")


@pytest.fixture(scope="module")
def sdar(tiny_sdar):
    m = load_f64(tiny_sdar, cached=True)
    return m, _threshold(m, "sdar")


@pytest.fixture(scope="module")
def sdar_moe(tiny_sdar_moe):
    m = load_f64(tiny_sdar_moe, cached=True)
    return m, _threshold(m, "sdar_moe")


def _check(model, kw: dict, *, random_seed: int = 0, prompt: torch.Tensor | None = None) -> dict:
    """Baseline vs Spiffy with an oracle graph (all nodes kept) and a random graph (budget 3)."""
    prompt = _prompt() if prompt is None else prompt
    base = make_session(model, prompt, **kw)
    records = record_trajectory(base)
    x_base, nfe_base = base.x.clone(), base.nfe
    assert len(records) > 0

    graph = oracle_graph_from_records(records, base.mask_id)
    s = make_session(model, prompt, **kw)
    st = speculative_generate(s, graph, budget=len(graph.nodes))
    assert torch.equal(s.x, x_base), f"oracle graph changed the output for {kw}"
    assert st.steps == len(records)
    assert nfe_base - st.nfe == st.accepted_total + st.reused_steps
    assert st.accepted_total > 0, f"oracle graph accepted nothing for {kw}"
    assert st.baseline_equivalent_nfe == nfe_base

    s = make_session(model, prompt, **kw)
    st2 = speculative_generate(s, random_graph(3, 10, seed=random_seed, i_max=4, j_max=3), budget=3)
    assert torch.equal(s.x, x_base), f"random graph changed the output for {kw}"
    assert st2.nfe <= nfe_base
    assert nfe_base - st2.nfe == st2.accepted_total + st2.reused_steps
    return {"base": nfe_base, "oracle": st, "random": st2}


RULES = ["one_per_step", "several_per_step", "threshold"]
TEMPS = [0.0, 1.0]


def _bidir_kw(rule: str, cache: str, temp: float, thr: float, **extra) -> dict:
    kw = dict(gen_length=GEN, block_length=BLOCK, cache=cache, temperature=temp, seed=7, **extra)
    if rule == "one_per_step":
        kw["steps"] = GEN
    elif rule == "several_per_step":
        kw["steps"] = GEN // 2
    else:
        kw["threshold"] = thr
    return kw


@pytest.mark.parametrize(("family", "rule", "cache", "temp"),
                         pairwise_params(["llada", "llada_moe"], RULES, ["none", "prefix", "dual"], TEMPS))
def test_llada_lossless(request, family: str, rule: str, cache: str, temp: float) -> None:
    model, thr = request.getfixturevalue(family)
    _check(model, _bidir_kw(rule, cache, temp, thr))


@pytest.mark.parametrize("temp", TEMPS)
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", RULES)
def test_dream_lossless(dream, rule: str, cache: str, temp: float) -> None:
    model, thr = dream
    alg = {"one_per_step": "maskgit_plus", "several_per_step": "entropy", "threshold": "topk_margin"}[rule]
    _check(model, _bidir_kw(rule, cache, temp, thr, alg=alg))


@pytest.mark.parametrize("tokens_per_step", [1, 2])
@pytest.mark.parametrize("card", list(MODEL_CARD_CALLS))
def test_dream_variant_card_calls_lossless(dream, card: str, tokens_per_step: int) -> None:
    """Dream-Coder's and DiffuCoder's recommended calls (entropy, alg_temp 0, top_p 0.95, the model config's
    top_k 50, T 0.1 to 0.4, TOKEN_PER_STEP 1 or 2)."""
    model, _ = dream
    _check(model, dict(card_decode_options(card, GEN, tokens_per_step), seed=7))


@pytest.mark.parametrize("family", ["llada", "llada_moe"])
def test_llada_random_remasking(request, family: str) -> None:
    model, thr = request.getfixturevalue(family)
    _check(model, _bidir_kw("several_per_step", "none", 0.0, thr, remasking="random"))


def test_dream_origin_alg_and_reused_steps(dream) -> None:
    model, thr = dream
    out = _check(model, _bidir_kw("one_per_step", "none", 1.0, thr, alg="origin"))
    # Dream's schedule gives some steps zero tokens: their known logits are reused instead of a forward
    out2 = _check(model, _bidir_kw("one_per_step", "none", 0.0, thr))
    assert out["oracle"].reused_steps + out2["oracle"].reused_steps > 0


SDAR_RULES = {
    "one_per_step": dict(strategy="low_confidence_static", denoising_steps=BLOCK),
    "several_per_step": dict(strategy="low_confidence_static", denoising_steps=BLOCK // 2),
    "sequential": dict(strategy="sequential", denoising_steps=BLOCK),
    "threshold": dict(strategy="low_confidence_dynamic", denoising_steps=BLOCK),
    "entropy_bounded": dict(strategy="entropy_bounded", denoising_steps=BLOCK, eb_threshold=1e-3),
}


@pytest.mark.parametrize(("family", "rule", "temp"), pairwise_params(["sdar", "sdar_moe"], list(SDAR_RULES), TEMPS))
def test_sdar_lossless(request, family: str, rule: str, temp: float) -> None:
    model, thr = request.getfixturevalue(family)
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, seed=7, **SDAR_RULES[rule])
    if rule == "threshold":
        kw["threshold"] = thr
    _check(model, kw)


@pytest.fixture(scope="module")
def llada2(tiny_llada2):
    m = load_f64(tiny_llada2, cached=True)
    return m, _threshold(m, "llada2")


@pytest.mark.parametrize(("rule", "cache", "temp"),
                         pairwise_params(["one_per_step", "several_per_step", "threshold"], ["none", "prefix"], TEMPS))
def test_llada2_lossless(llada2, rule: str, cache: str, temp: float) -> None:
    """LLaDA2.0's official rule (confidence above the threshold, at least the schedule's count): ``threshold=1.0``
    never crosses, so the schedule alone decides (one or two rows per step); the tuned threshold crosses."""
    model, thr = llada2
    steps = {"one_per_step": BLOCK, "several_per_step": BLOCK // 2, "threshold": BLOCK}[rule]
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=temp, seed=7, cache=cache, denoising_steps=steps,
              threshold=thr if rule == "threshold" else 1.0)
    _check(model, kw)


def test_sdar_fused_commit(sdar) -> None:
    model, _ = sdar
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=1.0, seed=3, fuse_commit=True)
    out = _check(model, kw)
    plain = make_session(model, _prompt(), **{**kw, "fuse_commit": False})
    run_baseline(plain)
    assert out["base"] < plain.nfe  # fusing saves one call per block for the baseline and Spiffy alike


def test_budget_zero_is_baseline_cost(llada) -> None:
    model, _ = llada
    kw = _bidir_kw("one_per_step", "none", 1.0, 0.5)
    base = make_session(model, _prompt(), **kw)
    records = record_trajectory(base)
    graph = oracle_graph_from_records(records, base.mask_id)
    s = make_session(model, _prompt(), **kw)
    st = speculative_generate(s, graph, budget=0)
    assert torch.equal(s.x, base.x)
    assert st.nfe == base.nfe and st.accepted_total == 0 and st.drafts_evaluated == 0
    s = make_session(model, _prompt(), **kw)
    st = speculative_generate(s, None)
    assert torch.equal(s.x, base.x) and st.nfe == base.nfe


def test_observer_sees_the_baseline_trajectory(llada) -> None:
    model, _ = llada
    kw = _bidir_kw("one_per_step", "prefix", 1.0, 0.5)
    base = make_session(model, _prompt(1), **kw)
    records = record_trajectory(base)
    graph = oracle_graph_from_records(records, base.mask_id)
    seen = []
    ticks = []
    s = make_session(model, _prompt(1), **kw)
    st = speculative_generate(s, graph, budget=len(graph.nodes), observer=seen.append, progress=ticks.append)
    assert st.accepted_total > 0
    assert len(seen) == len(records) == sum(ticks) == st.steps
    for a, b in zip(records, seen):
        assert a.info == b.info
        assert torch.equal(a.x_before, b.x_before) and torch.equal(a.x_after, b.x_after)
        # a draft row of the batched verification forward is the baseline's own forward (up to the summation
        # order a larger batch may choose: a tolerance, not bitwise, so the test holds on every CPU)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-12)


def test_stats_are_consistent(llada) -> None:
    model, thr = llada
    out = _check(model, _bidir_kw("one_per_step", "dual", 0.0, thr))
    for st in (out["oracle"], out["random"]):
        assert sum(st.accepted_per_forward.values()) == st.forwards
        assert sum(k * v for k, v in st.accepted_per_forward.items()) == st.accepted_total
        assert sum(st.accepted_per_level.values()) == st.accepted_total
        assert set(st.stage_times) == set(STAGES) and all(v >= 0 for v in st.stage_times.values())
        d = st.to_dict()
        assert d["nfe_reduction"] == pytest.approx(st.baseline_equivalent_nfe / st.nfe)
    assert out["oracle"].nfe_reduction > 1.0


def test_generate_api_routes_to_spiffy(llada) -> None:
    model, _ = llada
    kw = _bidir_kw("one_per_step", "none", 1.0, 0.5)
    base = generate(model, _prompt(2), **kw)
    s = make_session(model, _prompt(2), **kw)
    graph = oracle_graph_from_records(record_trajectory(s), s.mask_id)
    spec = generate(model, _prompt(2), graph=graph, budget=len(graph.nodes), **kw)
    assert spec.tokens == base.tokens
    assert spec.nfe < base.nfe
    assert spec.stats["accepted_total"] == base.nfe - spec.nfe


def test_errors(llada) -> None:
    model, _ = llada
    graph = random_graph(2, 4, seed=0)
    s = make_session(model, _prompt().repeat(2, 1), gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ConfigError, match="batch-1"):
        speculative_generate(s, graph)
    s = make_session(model, _prompt(), gen_length=GEN, block_length=BLOCK)
    with pytest.raises(ConfigError, match="budget"):
        speculative_generate(s, graph, budget=-1)
    with pytest.raises(ConfigError, match="score"):
        speculative_generate(s, graph, score="bogus")


@pytest.mark.parametrize("score", ["gm", "product", "local", "count"])
def test_scores_are_lossless_with_small_budget(llada, score: str) -> None:
    model, thr = llada
    kw = _bidir_kw("one_per_step", "none", 0.0, thr)
    base = make_session(model, _prompt(3), **kw)
    records = record_trajectory(base)
    graph = oracle_graph_from_records(records, base.mask_id)
    s = make_session(model, _prompt(3), **kw)
    st = speculative_generate(s, graph, budget=2, score=score)
    assert torch.equal(s.x, base.x)
    assert base.nfe - st.nfe == st.accepted_total + st.reused_steps


@pytest.mark.parametrize("family", ["llada", "llada_moe", "dream"])
def test_calibrated_graph_end_to_end(request, family: str) -> None:
    """A graph calibrated on some prompts (spiffy.selfspec.calibrate) decodes other prompts losslessly."""
    from spiffy.decoding import DecodeConfig
    from spiffy.models import load_tokenizer
    from spiffy.selfspec.calibrate import calibrate

    path = request.getfixturevalue(f"tiny_{family}")
    model = load_f64(path, cached=True)
    tok = load_tokenizer(path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 250, (6,), generator=g).tolist() for _ in range(5)]
    cfg = DecodeConfig(gen_length=GEN, block_length=BLOCK, cache="dual", temperature=1.0, seed=5)
    graph = calibrate(model, tok, prompts[:3], cfg, nodes=10, progress=False, chat=False)
    saved = 0
    for p in prompts[3:]:
        base = generate(model, torch.tensor([p]), cfg)
        spec = generate(model, torch.tensor([p]), cfg, graph=graph, budget=3)
        assert spec.tokens == base.tokens
        assert base.nfe - spec.nfe == spec.stats["accepted_total"] + spec.stats["reused_steps"]
        saved += base.nfe - spec.nfe
    # lossless is not enough: a graph calibrated on this model must also save forwards on other prompts
    assert saved > 0


def test_random_graph_is_valid_and_deterministic() -> None:
    a = random_graph(3, 12, seed=4, i_max=5, j_max=3)
    b = random_graph(3, 12, seed=4, i_max=5, j_max=3)
    a.validate()
    assert [(n.level, n.pairs, n.parents) for n in a.nodes] == [(n.level, n.pairs, n.parents) for n in b.nodes]
    assert all(n.level == 1 or n.parents for n in a.nodes)


def test_llada_cfg_and_eos_options(llada) -> None:
    model, thr = llada
    _check(model, _bidir_kw("one_per_step", "none", 1.0, thr, cfg_scale=1.0))
    _check(model, _bidir_kw("several_per_step", "prefix", 0.0, thr, logits_eos_inf=True, confidence_eos_eot_inf=True))


def test_sdar_stop_tokens(sdar) -> None:
    model, _ = sdar
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=0.0, seed=7, denoising_steps=BLOCK)
    probe = make_session(model, _prompt(), **kw)
    run_baseline(probe)
    first = int(probe.x[0, probe.block_bounds(0)[0] + BLOCK - 1])  # a token of the first decoded block
    out = _check(model, {**kw, "stop_token_ids": (first,)})
    assert out["oracle"].steps_per_block[-1] == 0  # the generation stopped after the first block


@pytest.mark.parametrize("temp", TEMPS)
@pytest.mark.parametrize("rule", ["one_per_step", "threshold"])
@pytest.mark.parametrize("prompt_len", [4, 8, 11, 16])
def test_fast_dllm_v2_lossless(fast_dllm_v2, rule: str, temp: float, prompt_len: int) -> None:
    """Prompt lengths: inside the first block, one whole block (the official quirk: the prompt is ignored), unaligned
    over a prefilled block, aligned (the first block starts with the prefill's argmax)."""
    model, thr = fast_dllm_v2
    kw = dict(gen_length=GEN, block_length=BLOCK, small_block_size=4, temperature=temp, seed=7, stop_token_ids=(),
              threshold=1.0 if rule == "one_per_step" else thr)
    prompt = torch.randint(5, 250, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    _check(model, kw, prompt=prompt)


def test_fast_dllm_v2_stop_tokens(fast_dllm_v2) -> None:
    model, _ = fast_dllm_v2
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=0.0, seed=7, stop_token_ids=())
    probe = make_session(model, _prompt(), **kw)
    run_baseline(probe)
    first = int(probe.x[0, BLOCK - 2])  # a token generated in the first block
    out = _check(model, {**kw, "stop_token_ids": (first,)})
    assert out["oracle"].steps_per_block[-1] == 0  # the generation stopped in the first block


def test_fast_dllm_v2_sub_block_cache(fast_dllm_v2) -> None:
    """cache="dual" (the official use_block_cache): the baseline and Spiffy without drafts agree; drafts are refused
    (a state's logits depend on which earlier state refreshed the block cache)."""
    model, _ = fast_dllm_v2
    kw = dict(gen_length=GEN, block_length=BLOCK, small_block_size=4, threshold=0.5, cache="dual", seed=7)
    base = make_session(model, _prompt(), **kw)
    run_baseline(base)
    plain = make_session(model, _prompt(), **{**kw, "cache": "prefix"})
    run_baseline(plain)
    assert base.nfe == plain.nfe and not torch.equal(base.x, plain.x)  # same calls, stale K/V: other tokens
    s = make_session(model, _prompt(), **kw)
    speculative_generate(s, None, budget=0)
    assert torch.equal(s.x, base.x)
    s = make_session(model, _prompt(), **kw)
    with pytest.raises(ConfigError, match="sub-block cache"):
        speculative_generate(s, random_graph(3, 10, seed=0, i_max=4, j_max=3), budget=3)
