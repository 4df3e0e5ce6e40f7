"""SDAR baseline decoder: parity with the official block_diffusion_generate semantics (tests/reference_sdar.py),
cache exactness, fused commits, NFE accounting, stop tokens and validation. float64, tiny checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from reference_sdar import reference_block_diffusion_generate as reference
from spiffy.compat import sdar_block_diffusion_generate
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.batch import run_baseline
from spiffy.decoding.factory import make_session
from spiffy.decoding.sdar import SDARDecodeConfig, SDARSession, num_transfer_tokens, sdar_sample, select_transfer
from spiffy.errors import ConfigError, MissingTokenError, PromptTooLongError
from spiffy.models.sdar import block_causal_mask

STRATEGIES = ["sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"]


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def sdar(tiny_sdar):
    from conftest import load_f64
    from spiffy.models import load_tokenizer, mask_token_id

    model = load_f64(tiny_sdar).eval()
    tok = load_tokenizer(tiny_sdar)
    mask = mask_token_id(model, tok)
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(1234)
    specials = set(tok.all_special_ids) | {mask}
    ordinary = torch.tensor([i for i in range(vocab) if i not in specials])
    prompts = {n: ordinary[torch.randint(0, len(ordinary), (1, n), generator=g)] for n in (5, 7, 8)}
    return {"model": model, "tok": tok, "mask": mask, "prompts": prompts, "rule_params": {}}


def _rule_params(sdar, temperature, top_k, top_p) -> tuple[float, float]:
    """A confidence threshold and an entropy budget scaled to this random model and sampling setting, so that the
    dynamic rules unmask a variable number of rows per step (checked in test_dynamic_rules_are_exercised): the
    median confidence of the sampled tokens and 2.5x the median entropy over a static greedy trajectory."""
    key = (temperature, top_k, top_p)
    if key not in sdar["rule_params"]:
        confs: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []

        def observe(rec):
            rows = rec.x_before[0, rec.info.block_start : rec.info.block_end] == sdar["mask"]
            _, p, probs = sdar_sample(rec.logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
            confs.append(p[0][rows])
            ents.append(-(probs[0] * probs[0].clamp_min(1e-12).log()).sum(-1)[rows])

        cfg = SDARDecodeConfig(gen_length=12, block_length=4, strategy="low_confidence_static")
        run_baseline(make_session(sdar["model"], sdar["prompts"][8], cfg, mask_id=sdar["mask"]), observer=observe)
        sdar["rule_params"][key] = (float(torch.cat(confs).median()), float(2.5 * torch.cat(ents).median()))
    return sdar["rule_params"][key]


def _kw(sdar, strategy, temperature, steps=4, top_k=0, top_p=1.0, gen_length=12, block_length=4):
    threshold, eb = _rule_params(sdar, temperature, top_k, top_p)
    return dict(
        gen_length=gen_length,
        block_length=block_length,
        denoising_steps=steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        remasking_strategy=strategy,
        confidence_threshold=threshold,
        eb_threshold=eb,
    )


SAMPLING = [
    pytest.param(0.0, 0, 1.0, id="greedy"),
    pytest.param(1.0, 0, 1.0, id="T1"),
    pytest.param(0.7, 20, 0.9, id="T0.7-topk-topp"),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("plen,steps", [(8, 4), (7, 2)], ids=["aligned-1tok", "unaligned-2tok"])
def test_matches_reference(sdar, strategy, temperature, top_k, top_p, plen, steps):
    kw = _kw(sdar, strategy, temperature, steps=steps, top_k=top_k, top_p=top_p)
    prompt = sdar["prompts"][plen]
    x_ref, calls = reference(sdar["model"], {"input_ids": prompt}, sdar["mask"], generator=torch.Generator().manual_seed(7), **kw)
    if plen == 7:  # the uncached oracle (full forwards under the block-causal mask) on the unaligned layout
        x_full, _ = reference(
            sdar["model"], prompt, sdar["mask"], generator=torch.Generator().manual_seed(7), use_cache=False, **kw
        )
        assert torch.equal(x_ref, x_full), "cached reference differs from the uncached one"
    x, stats = sdar_block_diffusion_generate(sdar["model"], {"input_ids": prompt}, sdar["mask"], seed=7, return_stats=True, **kw)
    assert x.shape == (1, math.ceil((plen + 12) / 4) * 4)
    assert torch.equal(x, x_ref), "decoder differs from the reference semantics"
    assert not bool((x == sdar["mask"]).any())
    assert torch.equal(x[:, :plen], prompt)
    # NFE: the reference's calls minus its useless commit of the last block
    assert stats.nfe == calls - 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("temperature,plen", [(0.0, 5), (1.0, 8)])
def test_fuse_commit_same_tokens_fewer_calls(sdar, strategy, temperature, plen):
    kw = _kw(sdar, strategy, temperature, steps=2)
    prompt = sdar["prompts"][plen]
    x, st = sdar_block_diffusion_generate(sdar["model"], prompt, sdar["mask"], seed=3, return_stats=True, **kw)
    xf, stf = sdar_block_diffusion_generate(
        sdar["model"], prompt, sdar["mask"], seed=3, return_stats=True, fuse_commit=True, **kw
    )
    assert torch.equal(x, xf)
    assert stf.steps == st.steps
    num_blocks = len(st.steps_per_block)
    prefill = 1 if plen >= 4 else 0
    assert st.nfe == prefill + st.steps + (num_blocks - 1)  # prefill + one forward per step + commits
    assert stf.nfe == st.steps  # every commit (and the prefill) rides on a denoising forward
    assert stf.nfe == st.nfe - (num_blocks - 1) - prefill


def test_nfe_counting_static(sdar):
    # aligned prompt of 8 = 2 prefill blocks; 12 generated = 3 blocks of 4 with 2 steps each
    x, st = sdar_block_diffusion_generate(
        sdar["model"], sdar["prompts"][8], sdar["mask"], seed=0, return_stats=True, **_kw(sdar, "low_confidence_static", 0.0, steps=2)
    )
    assert st.steps_per_block == [2, 2, 2]
    assert st.nfe == 1 + 6 + 2


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("strategy", ["low_confidence_dynamic", "entropy_bounded"])
def test_dynamic_rules_are_exercised(sdar, strategy, temperature, top_k, top_p):
    """The parity tests must cover steps that unmask more rows than the static schedule (1 per step here)."""
    counts: list[int] = []
    kw = _kw(sdar, strategy, temperature, top_k=top_k, top_p=top_p)
    cfg = SDARDecodeConfig(
        gen_length=12, block_length=4, denoising_steps=4, strategy=strategy, temperature=temperature,
        top_k=top_k or None, top_p=top_p if top_p < 1 else None, threshold=kw["confidence_threshold"],
        eb_threshold=kw["eb_threshold"], seed=7,
    )
    run_baseline(
        make_session(sdar["model"], sdar["prompts"][8], cfg, mask_id=sdar["mask"]),
        observer=lambda r: counts.append(int((r.x_before != r.x_after).sum())),
    )
    assert max(counts) > 1, f"{strategy}: every step unmasked one row; the test parameters are too weak"
    assert min(counts) >= 1


def test_cached_block_forward_equals_full_forward(sdar):
    """forward_states on the committed prefix == the full forward under the block-causal mask, for the decoded
    state and for half-masked states; fused begin_block logits too; a batch of drafts == separate forwards."""
    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][7]
    x_final = sdar_block_diffusion_generate(model, prompt, mask, seed=0, **_kw(sdar, "low_confidence_static", 0.0))
    for fuse in (False, True):
        cfg = SDARDecodeConfig(gen_length=12, block_length=4, fuse_commit=fuse)
        session = SDARSession(model, prompt, cfg, mask_id=mask)
        session.x = x_final.clone()
        for b in range(session.num_blocks):
            s, e = session.block_bounds(b)
            first = session.begin_block(b)
            half = x_final.clone()
            half[:, s + 1 : e] = mask
            other = x_final.clone()
            other[:, s : e - 1] = mask
            states = torch.cat([x_final, half, other], dim=0)
            got = session.forward_states(states)
            for i in range(3):
                with torch.no_grad():
                    full = model(
                        states[i : i + 1, :e], attention_mask=block_causal_mask(e, 4, device="cpu"),
                        position_ids=torch.arange(e)[None],
                    ).logits[:, s:e]
                torch.testing.assert_close(got[i : i + 1], full, rtol=0, atol=1e-10)
                alone = session.forward_states(states[i : i + 1])
                torch.testing.assert_close(got[i : i + 1], alone, rtol=0, atol=1e-10)
            if fuse:
                torch.testing.assert_close(first, session.forward_states(x_final), rtol=0, atol=1e-10)
            else:
                assert first is None
            assert session.cache.get_seq_length() == s


def test_transition_is_pure_given_the_generator(sdar):
    session = make_session(sdar["model"], sdar["prompts"][8], gen_length=8, temperature=1.0, seed=5, mask_id=sdar["mask"])
    session.begin_block(0)
    logits = session.forward_states(session.x)
    info = session.step_info(0, 0)
    state = session.generator.get_state()
    a = session.transition(session.x, logits, info)
    session.generator.set_state(state)
    b = session.transition(session.x, logits, info)
    assert torch.equal(a, b)
    assert not torch.equal(a, session.x)
    assert a is not session.x and bool((session.x[:, 8:12] == sdar["mask"]).all())  # input untouched


def test_seed_reproduces_global_rng_convention(sdar):
    kw = _kw(sdar, "low_confidence_dynamic", 1.0)
    prompt = sdar["prompts"][7]
    torch.manual_seed(11)
    x_ref, _ = reference(sdar["model"], prompt, sdar["mask"], **kw)  # official script: global RNG
    torch.manual_seed(11)
    x_global = sdar_block_diffusion_generate(sdar["model"], prompt, sdar["mask"], **kw)  # no seed: global RNG
    x_seed = sdar_block_diffusion_generate(sdar["model"], prompt, sdar["mask"], seed=11, **kw)
    assert torch.equal(x_ref, x_global)
    assert torch.equal(x_ref, x_seed)
    x_other = sdar_block_diffusion_generate(sdar["model"], prompt, sdar["mask"], seed=12, **kw)
    assert not torch.equal(x_seed, x_other)


def test_stop_tokens(sdar):
    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][8]
    kw = _kw(sdar, "low_confidence_static", 0.0, gen_length=16)
    x_all, st_all = sdar_block_diffusion_generate(model, prompt, mask, seed=0, return_stats=True, **kw)
    stop = int(x_all[0, 12])  # a token of the second generated block
    first_hit = min(i for i in range(8, 24) if int(x_all[0, i]) == stop)
    stop_block_end = (first_hit // 4 + 1) * 4
    x_ref, calls = reference(model, prompt, mask, stopping_criteria_idx=[stop], **kw)
    x, st = sdar_block_diffusion_generate(model, prompt, mask, seed=0, stopping_criteria_idx=[stop], return_stats=True, **kw)
    assert torch.equal(x, x_ref)
    assert torch.equal(x[:, :stop_block_end], x_all[:, :stop_block_end])
    assert bool((x[:, stop_block_end:] == mask).all()) and stop_block_end < x.shape[1]
    assert st.nfe == calls - 1 < st_all.nfe
    xf, stf = sdar_block_diffusion_generate(model, prompt, mask, seed=0, stopping_criteria_idx=stop, fuse_commit=True, return_stats=True, **kw)
    assert torch.equal(xf, x) and stf.nfe < st.nfe


@pytest.mark.parametrize("strategy", ["sequential", "low_confidence_static", "low_confidence_dynamic"])
def test_overwrite_quirk_reproduces_reference_topk(sdar, strategy):
    """Unaligned prompt of 5 with 2 steps per block of 4: the first decode block has 3 masks, so step 1 asks for
    2 rows with 1 mask left. The reference's topk then overwrites a decoded row; the default clamps."""
    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][5]
    kw = _kw(sdar, strategy, 0.0, steps=2)
    kw["confidence_threshold"] = 0.999  # dynamic falls back to top-k
    x_ref_q, _ = reference(model, prompt, mask, clamp_transfer=False, **kw)
    x_q = sdar_block_diffusion_generate(model, prompt, mask, seed=0, overwrite_quirk=True, **kw)
    assert torch.equal(x_q, x_ref_q)
    x_ref_c, _ = reference(model, prompt, mask, **kw)
    x_c = sdar_block_diffusion_generate(model, prompt, mask, seed=0, **kw)
    assert torch.equal(x_c, x_ref_c)
    assert torch.equal(x_c[:, :5], prompt)
    if strategy != "sequential":  # (sequential slices to the block end: no over-selection possible)
        assert not torch.equal(x_q, x_c), "the quirk did not trigger; the test does not exercise it"


def test_batch_greedy_equals_separate_runs(sdar):
    model, mask = sdar["model"], sdar["mask"]
    p1, p2 = sdar["prompts"][7], sdar["prompts"][8][:, :7]
    cfg = SDARDecodeConfig(gen_length=8, block_length=4, threshold=_rule_params(sdar, 0.0, 0, 1.0)[0])
    both = make_session(model, torch.cat([p1, p2]), cfg, mask_id=mask)
    run_baseline(both)
    for i, p in enumerate((p1, p2)):
        one = make_session(model, p, cfg, mask_id=mask)
        run_baseline(one)
        assert torch.equal(both.x[i : i + 1], one.x)


# ------------------------------------------------------------------------------------------ pieces on tensors
def test_schedule():
    assert num_transfer_tokens(4, 4) == [1, 1, 1, 1]
    assert num_transfer_tokens(8, 3) == [3, 3, 2]
    assert num_transfer_tokens(5, 2) == [3, 2]
    assert sum(num_transfer_tokens(32, 7)) == 32


def test_greedy_sample_is_argmax_and_draws_nothing():
    logits = torch.randn(2, 3, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    before = g.get_state()
    tok, p, probs = sdar_sample(logits, 0.0, top_k=3, generator=g)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.equal(g.get_state(), before)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    assert int((probs > 0).sum(-1).max()) == 3


def test_select_transfer_rules():
    masked = torch.tensor([[False, True, True, True]])
    conf = torch.tensor([[0.99, 0.2, 0.9, 0.7]], dtype=torch.float64)
    assert select_transfer(masked, conf, None, 1, "sequential", 0.5, 0.0).tolist() == [[False, True, False, False]]
    assert select_transfer(masked, conf, None, 1, "low_confidence_static", 0.5, 0.0).tolist() == [[False, False, True, False]]
    # strict > threshold; at least the schedule's count
    assert select_transfer(masked, conf, None, 1, "low_confidence_dynamic", 0.5, 0.0).tolist() == [[False, False, True, True]]
    assert select_transfer(masked, conf, None, 1, "low_confidence_dynamic", 0.9, 0.0).tolist() == [[False, False, True, False]]
    assert select_transfer(masked, conf, None, 3, "low_confidence_dynamic", 0.5, 0.0).tolist() == [[False, True, True, True]]
    # count above the masks left: clamped by default, the reference's topk picks a decoded row with the quirk
    assert select_transfer(masked, conf, None, 4, "low_confidence_static", 0.5, 0.0).tolist() == [[False, True, True, True]]
    assert select_transfer(masked, conf, None, 4, "low_confidence_static", 0.5, 0.0, True).tolist() == [[True, True, True, True]]
    # entropy bounded: rows by ascending entropy while the cumulative entropy stays below the budget
    V = 4
    probs = torch.stack(
        [torch.full((V,), 1.0 / V), torch.tensor([0.97, 0.01, 0.01, 0.01]), torch.tensor([0.7, 0.1, 0.1, 0.1]), torch.tensor([0.4, 0.2, 0.2, 0.2])]
    )[None].double()
    ent = -(probs * probs.log()).sum(-1)[0]
    budget = float(ent[1] + ent[2]) + 1e-9
    got = select_transfer(masked, conf, probs, 1, "entropy_bounded", 0.5, budget)
    assert got.tolist() == [[False, True, True, False]]
    assert select_transfer(masked, conf, probs, 1, "entropy_bounded", 0.5, 0.0).tolist() == [[False, True, False, False]]


# ------------------------------------------------------------------------------------------ configuration/errors
def test_config_conversion_and_fingerprint():
    base = DecodeConfig(gen_length=16, block_length=4, threshold=0.9, temperature=0.5, seed=3)
    cfg = SDARDecodeConfig.from_config(base)
    assert cfg.resolved_strategy == "low_confidence_dynamic" and cfg.resolved_threshold == 0.9
    assert cfg.cache == "prefix" and cfg.steps_per_block == 4
    assert SDARDecodeConfig(gen_length=16, block_length=4, steps=8).steps_per_block == 2
    a = SDARDecodeConfig(gen_length=16, block_length=4, denoising_steps=2)
    b = SDARDecodeConfig(gen_length=32, block_length=4, steps=16, fuse_commit=True, seed=9)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != SDARDecodeConfig(gen_length=16, block_length=4, denoising_steps=4).fingerprint()
    assert a.fingerprint() != SDARDecodeConfig(gen_length=16, block_length=4, denoising_steps=2, strategy="sequential").fingerprint()
    assert SDARDecodeConfig.from_dict(a.to_dict()) == a
    # the base class rebuilds the subclass a dict names (graphs record an SDAR config that way); a foreign type fails
    assert DecodeConfig.from_dict(a.to_dict()) == a and type(DecodeConfig.from_dict(a.to_dict())) is SDARDecodeConfig
    with pytest.raises(ConfigError, match="not a DecodeConfig"):
        DecodeConfig.from_dict({**base.to_dict(), "type": "NoSuchConfig"})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gen_length=10, block_length=4),
        dict(gen_length=8, block_length=4, denoising_steps=5),
        dict(gen_length=8, block_length=4, denoising_steps=0),
        dict(gen_length=8, block_length=4, steps=4, denoising_steps=4),
        dict(gen_length=8, block_length=4, strategy="random"),
        dict(gen_length=8, block_length=4, cache="dual"),
        dict(gen_length=8, block_length=4, temperature=-1.0),
        dict(gen_length=8, block_length=4, eb_threshold=-0.1),
        dict(gen_length=8, block_length=4, threshold=1.5),
    ],
)
def test_config_errors(kwargs):
    with pytest.raises(ConfigError) as err:
        SDARDecodeConfig(**kwargs)
    assert "fix" in str(err.value) or "must" in str(err.value)


def test_runtime_errors(sdar):
    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][8]
    with pytest.raises(ConfigError, match="multiple of block_length"):
        sdar_block_diffusion_generate(model, prompt, mask, gen_length=10, block_length=4, denoising_steps=4)
    with pytest.raises(ConfigError, match="left padded"):
        make_session(model, prompt, gen_length=8, attention_mask=torch.tensor([[1] * 7 + [0]]), mask_id=mask)
    with pytest.raises(ConfigError, match="all padding"):
        make_session(model, prompt, gen_length=8, attention_mask=torch.zeros((1, 8), dtype=torch.long), mask_id=mask)
    with pytest.raises(PromptTooLongError):
        make_session(model, prompt, gen_length=int(model.config.max_position_embeddings), block_length=4, mask_id=mask)
    saved = getattr(model.config, "mask_token_id", None)
    try:
        model.config.mask_token_id = None
        with pytest.raises(MissingTokenError):
            make_session(model, prompt, gen_length=8)
    finally:
        model.config.mask_token_id = saved
    with pytest.raises(ConfigError, match="temperature"):
        sdar_block_diffusion_generate(model, prompt, mask, gen_length=8, block_length=4, denoising_steps=4, temperature=-0.5)


# ------------------------------------------------------------------------------------------ public API / Spiffy
def test_public_generate_dispatches_to_sdar(sdar):
    from spiffy.api import generate, make_session as api_make_session

    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][7]
    kw = _kw(sdar, "low_confidence_dynamic", 1.0)
    x = sdar_block_diffusion_generate(model, prompt, mask, seed=4, **kw)
    cfg = SDARDecodeConfig(
        gen_length=12, block_length=4, denoising_steps=4, temperature=1.0, threshold=kw["confidence_threshold"], seed=4
    )
    res = generate(model, prompt, cfg, tokenizer=sdar["tok"])
    assert torch.equal(res.sequences, x)
    assert res.tokens == [x[0, 7 : 7 + 12].tolist()] and res.nfe > 0  # gen_length positions; sequences keeps the tail
    session = api_make_session(model, prompt, DecodeConfig(gen_length=8, block_length=4, threshold=0.5), mask_id=mask)
    assert isinstance(session, SDARSession) and session.strategy == "low_confidence_dynamic"


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_routes_to_spiffy_losslessly(sdar, fuse, temperature):
    oracle = pytest.importorskip("spiffy.selfspec.oracle")
    model, mask = sdar["model"], sdar["mask"]
    prompt = sdar["prompts"][7]
    kw = _kw(sdar, "low_confidence_static", temperature, gen_length=16)
    base, st = sdar_block_diffusion_generate(model, prompt, mask, seed=2, fuse_commit=fuse, return_stats=True, **kw)
    cfg = SDARDecodeConfig(
        gen_length=16, block_length=4, denoising_steps=4, temperature=temperature, strategy="low_confidence_static", seed=2,
        mask_id=mask, fuse_commit=fuse,
    )
    graph = oracle.oracle_graph(SDARSession(model, prompt, cfg))
    spec, sst = sdar_block_diffusion_generate(
        model, prompt, mask, seed=2, fuse_commit=fuse, graph=graph, budget=4, return_stats=True, **kw
    )
    assert torch.equal(spec, base)
    assert sst.accepted_total > 0
    assert sst.nfe == st.nfe - sst.accepted_total
