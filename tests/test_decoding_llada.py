"""LLaDA baseline decoding: parity with the official generate() semantics, schedules, cache modes, errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import load_f64
from reference_llada import reference_generate

from spiffy.decoding import DecodeConfig, make_session, run_baseline
from spiffy.api import generate
from spiffy.compat import llada_generate
from spiffy.decoding.schedules import get_num_transfer_tokens, threshold_transfer, topk_transfer
from spiffy.errors import ConfigError, MissingTokenError, PromptTooLongError
from spiffy.models.loading import load_tokenizer
from spiffy.models.tiny import make_tiny

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def llada(tiny_llada: Path):
    model = load_f64(tiny_llada, cached=True)
    tok = load_tokenizer(tiny_llada)
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    return model, tok, ids


@pytest.fixture(scope="module")
def llada_eos(llada):
    """A copy of the tiny model whose head makes EOS/EoT frequent proposals (so the EOS options matter)."""
    model, tok, ids = llada
    res = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8))
    common = torch.tensor(res.tokens[0]).bincount().argsort(descending=True).tolist()
    eos = model.config.eos_token_id
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    boosted = copy.deepcopy(model)
    head = boosted.get_output_embeddings().weight
    with torch.no_grad():
        head[eos] = head[common[0]] * 1.2
        head[eot] = head[common[1]] * 1.2
    return boosted, tok, ids, eos, eot


@pytest.fixture(scope="module")
def llada_one_layer(tmp_path_factory: pytest.TempPathFactory):
    """One layer: K/V depend on the token alone, so prefix/dual caches are exact and cached == full forward."""
    path = make_tiny("llada", tmp_path_factory.mktemp("llada1") / "model", seed=1, n_layers=1)
    return load_f64(path), load_tokenizer(path)


def _reference(model, ids, seed, mask_id, eos=None, eot=None, **kw):
    torch.manual_seed(seed)
    return reference_generate(model, ids, mask_id=mask_id, eos_id=eos, eot_id=eot, **kw)


# ------------------------------------------------------------------------------------------ schedules
def test_num_transfer_tokens_schedule():
    m = torch.zeros(3, 10, dtype=torch.bool)
    m[0, :10] = True
    m[1, :7] = True
    m[2, :3] = True
    out = get_num_transfer_tokens(m, 4)
    assert out.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [1, 1, 1, 0]]
    assert out.sum(dim=1).tolist() == [10, 7, 3]
    assert get_num_transfer_tokens(m[:1], 1).tolist() == [[10]]


def test_topk_and_threshold_selection():
    conf = torch.tensor([[0.2, 0.9, -torch.inf, 0.95, 0.5], [0.1, 0.1, 0.1, -torch.inf, 0.3]], dtype=torch.float64)
    sel = topk_transfer(conf, torch.tensor([2, 1]))
    assert sel.tolist() == [[False, True, False, True, False], [False, False, False, False, True]]
    # ties are broken by torch.topk, exactly as the official script (same call, same input)
    tie = torch.tensor([[0.5, 0.5, 0.5, -torch.inf]], dtype=torch.float64)
    _, idx = torch.topk(tie[0], k=2)
    expect = torch.zeros(1, 4, dtype=torch.bool)
    expect[0, idx] = True
    assert torch.equal(topk_transfer(tie, [2]), expect)
    # threshold: everything >= tau, and always the most confident one
    thr = threshold_transfer(conf, torch.tensor([4, 4]), 0.85)
    assert thr.tolist() == [[False, True, False, True, False], [False, False, False, False, True]]
    assert threshold_transfer(conf, torch.tensor([4, 0]), 1.0).sum(dim=1).tolist() == [1, 0]


# ------------------------------------------------------------------------------------------ reference parity
PARITY_CASES = {
    "one_token_per_step": dict(gen_length=16, block_length=8, steps=16),
    "several_per_step": dict(gen_length=16, block_length=8, steps=4),
    "uneven_schedule": dict(gen_length=16, block_length=16, steps=6),
    "random_remasking": dict(gen_length=16, block_length=8, steps=16, remasking="random"),
    "temperature": dict(gen_length=16, block_length=8, steps=8, temperature=0.8),
    "random_and_temperature": dict(gen_length=16, block_length=16, steps=6, temperature=0.5, remasking="random"),
    "cfg": dict(gen_length=16, block_length=8, steps=8, cfg_scale=1.5),
    "cfg_temperature": dict(gen_length=8, block_length=8, steps=8, cfg_scale=0.5, temperature=1.0),
}


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_matches_official_semantics(llada, case):
    model, tok, ids = llada
    kw = PARITY_CASES[case]
    ref_traj: list = []
    ref, calls = _reference(model, ids, 11, model.config.mask_token_id, trace=ref_traj, **kw)
    traj: list = []
    res = generate(model, ids, DecodeConfig(seed=11, **kw), tokenizer=tok, observer=lambda r: traj.append(r.x_after))
    assert torch.equal(res.sequences, ref)
    assert all(torch.equal(a, b) for a, b in zip(traj, ref_traj, strict=True))
    assert res.nfe == calls == kw["steps"]
    assert res.tokens[0] == ref[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("opts", [(True, False), (False, True), (True, True)])
def test_eos_options_match_official(llada_eos, temperature, opts):
    model, tok, ids, eos, eot = llada_eos
    logits_eos_inf, conf_inf = opts
    kw = dict(gen_length=8, block_length=4, steps=8, temperature=temperature,
              logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=conf_inf)
    ref_traj: list = []
    ref, _ = _reference(model, ids, 5, model.config.mask_token_id, eos=eos, eot=eot, trace=ref_traj, **kw)
    traj: list = []
    res = generate(model, ids, DecodeConfig(seed=5, **kw), tokenizer=tok, observer=lambda r: traj.append(r.x_after))
    assert torch.equal(res.sequences, ref)
    assert len(traj) == len(ref_traj) and all(torch.equal(a, b) for a, b in zip(traj, ref_traj))  # same order too
    plain_traj: list = []
    plain = generate(model, ids, DecodeConfig(seed=5, **{**kw, "logits_eos_inf": False, "confidence_eos_eot_inf": False}),
                     observer=lambda r: plain_traj.append(r.x_after))
    if logits_eos_inf:
        assert eos not in res.tokens[0]
    if temperature == 0:  # the boosted head proposes EOS/EoT greedily: every option changes the decoding
        assert eos in plain.tokens[0]
        assert any(not torch.equal(a, b) for a, b in zip(traj, plain_traj))


@pytest.mark.parametrize("temperature", [0.0, 0.01])
def test_confidence_eos_eot_rule_on_handmade_logits(llada, temperature):
    """Row B proposes EoT (p 0.95), row A EOS (p 0.88), row C a plain token (p 0.73); one token per step.
    Official semantics of confidence_eos_eot_inf: at T = 0 EOS and EoT proposals get confidence 0 (C goes first);
    at T > 0 only EoT does (A goes first). Without the option B (the most confident) goes first."""
    model, tok, ids = llada
    eos, eot = model.config.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")
    v = model.config.vocab_size
    first = {}
    for opt in (False, True):
        s = make_session(model, ids, DecodeConfig(gen_length=3, block_length=3, steps=3, temperature=temperature,
                                                  confidence_eos_eot_inf=opt), tokenizer=tok)
        s.begin_block(0)
        logits = torch.full((1, 3, v), -30.0, dtype=torch.float64)
        for row, (tid, gap) in enumerate([(eos, 2.0), (eot, 3.0), (7, 1.0)]):
            logits[0, row, tid] = 5.0
            logits[0, row, 3] = 5.0 - gap  # runner-up: no proposal is certain
        out = s.transition(s.x, logits, s.step_info(0, 0))
        changed = (out != s.x).nonzero()[:, 1].tolist()
        assert len(changed) == 1
        first[opt] = changed[0] - s.prompt_len
    assert first[False] == 1
    assert first[True] == (2 if temperature == 0 else 0)


def test_cfg_with_left_padded_batch_matches_official(llada):
    model, tok, _ = llada
    rows = [tok("x = 1", add_special_tokens=False)["input_ids"], tok(PROMPT, add_special_tokens=False)["input_ids"]]
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = dict(gen_length=8, block_length=4, steps=8, cfg_scale=1.0, temperature=0.7)
    ref, _ = _reference(model, ids, 3, model.config.mask_token_id, attention_mask=am, **kw)
    # the official batched sampling (one generator for the batch) is the batch session's own rule; generate()
    # decodes a batch row by row instead (each row as if alone: tests/test_batch_rows.py)
    session = make_session(model, ids, DecodeConfig(seed=3, **kw), attention_mask=am)
    run_baseline(session)
    assert torch.equal(session.x, ref)


def test_wrapper_follows_global_seed(llada):
    model, _, ids = llada
    kw = dict(steps=8, gen_length=8, block_length=4, temperature=1.0, remasking="random")
    ref, _ = _reference(model, ids, 21, model.config.mask_token_id, **kw)
    torch.manual_seed(21)
    out = llada_generate(model, ids, **kw)
    assert torch.equal(out, ref)
    assert torch.equal(llada_generate(model, ids, seed=21, **kw), ref)  # seed= gives the same stream


def test_transition_is_pure_given_generator_state(llada):
    model, _, ids = llada
    s = make_session(model, ids, DecodeConfig(gen_length=8, block_length=8, steps=4, temperature=1.0, seed=2))
    s.begin_block(0)
    logits = s.forward_states(s.x)
    info = s.step_info(0, 0)
    state = s.generator.get_state()
    a = s.transition(s.x, logits, info)
    s.generator.set_state(state)
    b = s.transition(s.x, logits, info)
    assert torch.equal(a, b)
    assert int((a != s.x).sum()) == 2  # 8 masks over 4 steps


# ------------------------------------------------------------------------------------------ threshold / NFE
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_unmasks_at_least_one_per_step(llada, cache):
    model, _, ids = llada
    records = []
    res = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, threshold=0.3, cache=cache),
                   observer=records.append)
    gains = [int(((r.x_before == model.config.mask_token_id) & (r.x_after != r.x_before)).sum()) for r in records]
    assert all(g >= 1 for g in gains)
    assert res.steps == len(records) and res.nfe == res.steps
    assert sum(gains) == 8 - res.tokens[0].count(model.config.mask_token_id)
    one = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, threshold=1.0, cache=cache))
    assert one.nfe == 8  # tau = 1: exactly one token per step
    everything = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, threshold=1e-12, cache=cache))
    assert everything.nfe == 2  # every masked row passes: one step per block


def test_nfe_counts_per_cache_mode(llada):
    model, _, ids = llada
    for cache in ("none", "prefix", "dual"):
        res = generate(model, ids, DecodeConfig(gen_length=16, block_length=4, steps=8, cache=cache))
        assert res.nfe == 8 and res.steps == 8 and res.stats["steps_per_block"] == [2, 2, 2, 2]


# ------------------------------------------------------------------------------------------ cache modes
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_window_logits_equal_full_forward(llada_one_layer, cache):
    model, tok = llada_one_layer
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    s = make_session(model, ids, DecodeConfig(gen_length=12, block_length=4, steps=12, cache=cache))
    for block in range(3):
        s.begin_block(block)
        start, end = s.block_bounds(block)
        g = torch.Generator().manual_seed(block)
        states = s.x.repeat(3, 1)
        for i in range(1, 3):  # drafts: random tokens in some block rows
            rows = torch.randperm(end - start, generator=g)[: i + 1] + start
            states[i, rows] = torch.randint(0, 400, (rows.numel(),), generator=g)
        win = s.forward_states(states)
        full = model(states).logits
        ws = s.window_start(block)
        assert torch.allclose(win, full[:, ws : ws + win.shape[1]], atol=1e-10, rtol=0)
        s.x = states[:1].clone()
        s.x[:, start:end] = states[0, start:end]
        s.end_block(block)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_decoding_equals_no_cache_when_exact(llada_one_layer, cache):
    model, tok = llada_one_layer
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    kw = dict(gen_length=16, block_length=4, steps=16)
    base = generate(model, ids, DecodeConfig(**kw))
    cached = generate(model, ids, DecodeConfig(cache=cache, **kw))
    assert cached.tokens == base.tokens and cached.nfe == base.nfe
    thr = dict(kw, threshold=0.2)
    assert generate(model, ids, DecodeConfig(cache=cache, **thr)).tokens == generate(model, ids, DecodeConfig(**thr)).tokens


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_forward_states_batch_equals_single(llada, cache):
    """N candidate states in one call == each state alone (what Spiffy's verification relies on)."""
    model, _, ids = llada
    s = make_session(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, cache=cache))
    s.begin_block(0)
    start, end = s.block_bounds(0)
    states = s.x.repeat(3, 1)
    states[1, start] = 7
    states[2, start : start + 2] = torch.tensor([9, 11])
    nfe = s.nfe
    batch = s.forward_states(states)
    assert s.nfe == nfe + 1
    singles = torch.cat([s.forward_states(states[i : i + 1]) for i in range(3)])
    assert torch.allclose(batch, singles, atol=1e-12, rtol=0)
    assert not torch.allclose(batch[0], batch[2])


# ------------------------------------------------------------------------------------------ batching
@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_left_padded_batch_equals_separate_runs(llada, cache):
    model, tok, _ = llada
    rows = [tok("print(1)", add_special_tokens=False)["input_ids"], tok(PROMPT, add_special_tokens=False)["input_ids"]]
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=8, cache=cache)
    batched = generate(model, ids, cfg, attention_mask=am)
    for i, r in enumerate(rows):
        alone = generate(model, torch.tensor([r]), cfg)
        assert batched.tokens[i] == alone.tokens[0]


# ------------------------------------------------------------------------------------------ errors
def test_validation_errors(llada, tiny_llada):
    model, tok, ids = llada
    with pytest.raises(ConfigError, match="block_length"):
        DecodeConfig(gen_length=10, block_length=4)
    with pytest.raises(ConfigError, match="multiple of the number of blocks"):
        DecodeConfig(gen_length=8, block_length=4, steps=3)
    with pytest.raises(ConfigError, match="temperature"):
        DecodeConfig(temperature=-0.1)
    for tau in (0.0, 1.5, -1.0):
        with pytest.raises(ConfigError, match="threshold"):
            DecodeConfig(threshold=tau)
    with pytest.raises(ConfigError, match="cache"):
        DecodeConfig(cache="full")
    with pytest.raises(ConfigError, match="unknown decoding option"):
        generate(model, ids, DecodeConfig(), gen_lenght=8)
    with pytest.raises(PromptTooLongError, match="context"):
        generate(model, ids, gen_length=model.config.max_sequence_length)
    with pytest.raises(ConfigError, match="cfg_scale"):
        generate(model, ids, gen_length=8, cfg_scale=1.0, cache="prefix")
    nomask = copy.deepcopy(model)
    nomask.config.mask_token_id = None
    with pytest.raises(MissingTokenError, match="mask"):
        generate(nomask, ids, gen_length=8)
    # the tokenizer's mask token is the fallback
    res = generate(nomask, ids, gen_length=4, tokenizer=tok)
    assert res.nfe == 4


def test_config_fingerprint_and_dict_round_trip():
    a = DecodeConfig(gen_length=64, block_length=32, steps=64, temperature=0, seed=1)
    b = DecodeConfig(gen_length=128, block_length=32, steps=128, temperature=0.0, seed=9)
    assert a.fingerprint() == b.fingerprint()  # same rule: block 32, 32 steps per block
    assert DecodeConfig(gen_length=64, block_length=32, steps=32).fingerprint() != a.fingerprint()
    assert DecodeConfig.from_dict(a.to_dict()) == a
    assert a.replace(seed=4).seed == 4 and a.replace(seed=4).fingerprint() == a.fingerprint()
    assert a.tokens_per_step == 1 and DecodeConfig(threshold=0.9).tokens_per_step == "dynamic"
    with pytest.raises(ConfigError):
        DecodeConfig.from_dict({"gen_length": 8, "bogus": 1})


def test_session_contract_with_run_baseline(llada):
    """make_session + run_baseline is what generate() runs: same tokens, NFE == model calls."""
    model, _, ids = llada
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=4, temperature=0.5, seed=8)
    s = make_session(model, ids, cfg)
    stats = run_baseline(s)
    assert stats.nfe == s.nfe == 4 and stats.steps_per_block == [2, 2]
    assert s.x[0, ids.shape[1]:].tolist() == generate(model, ids, cfg).tokens[0]


def test_dynamic_block_has_a_step_cap(llada):
    """Under dynamic unmasking a block ends when it has no mask, or after 4 * block_length steps (a model that keeps
    proposing the mask token would otherwise loop forever); static schedules end after steps_per_block."""
    model, _, ids = llada
    s = make_session(model, ids, DecodeConfig(gen_length=4, block_length=2, steps=4, threshold=0.9))
    assert not s.block_finished(0, 7, s.x) and s.block_finished(0, 8, s.x)
    done = s.x.clone()
    done[:, s.prompt_len : s.prompt_len + 2] = 3
    assert s.block_finished(0, 1, done) and not s.block_finished(1, 1, done)
    static = make_session(model, ids, DecodeConfig(gen_length=4, block_length=2, steps=4))
    assert not static.block_finished(0, 1, done) and static.block_finished(0, 2, static.x)
