"""Dream baseline decoding: diffusion_generate semantics (every alg), shifted logits, Fast-dLLM cache modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributions as dists
import torch.nn.functional as F
from conftest import load_f64

from spiffy.decoding import DecodeConfig, make_session
from spiffy.decoding.schedules import dream_num_transfer, dream_num_transfer_host, masked_rows
from spiffy.compat import dream_diffusion_generate
from spiffy.api import generate
from spiffy.errors import ConfigError
from spiffy.models.loading import load_tokenizer
from spiffy.models.tiny import make_tiny

PROMPT = "import os\nprint("


# ------------------------------------------------------------------------------------------ oracle
def _ref_sample(logits, temperature, top_p, top_k, margin=False, neg_entropy=False):
    """Dream's documented ``sample_tokens`` (global RNG through torch.distributions.Categorical)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        srt, order = torch.sort(logits, descending=True)
        cum = torch.cumsum(F.softmax(srt, dim=-1), dim=-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = dists.Categorical(probs=probs).sample()
        conf = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if margin:
        sp, _ = torch.sort(probs, dim=-1, descending=True)
        conf = sp[:, 0] - sp[:, 1]
    if neg_entropy:
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


@torch.no_grad()
def dream_reference(model, ids, mask_id, gen_length, steps, eps=1e-3, alg="origin", alg_temp=None, temperature=0.0,
                    top_p=None, top_k=None, attention_mask=None):
    """Re-statement of Dream's original ``_sample`` (one block, no cache, global RNG), written from its docs."""
    x = F.pad(ids, (0, gen_length), value=mask_id)
    if attention_mask is not None and bool((attention_mask == 0).any()):
        am = F.pad(attention_mask, (0, gen_length), value=1)
        tok_idx = am.long().cumsum(-1) - 1
        tok_idx.masked_fill_(am == 0, 1)
        am4 = torch.logical_and(am.unsqueeze(1).unsqueeze(-2), am.unsqueeze(1).unsqueeze(-1))
    else:
        tok_idx, am4 = None, None
    ts = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = x == mask_id
        logits = model(x, attention_mask=am4, position_ids=tok_idx).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        ml = logits[masked]
        t, s = ts[i], ts[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[masked]) + mask_id
            reveal = torch.rand(*x0.shape) < p_transfer
            _, x0[reveal] = _ref_sample(ml[reveal], temperature, top_p, top_k)
            x[masked] = x0.clone()
            continue
        conf, x0 = _ref_sample(ml, temperature, top_p, top_k, margin=alg == "topk_margin", neg_entropy=alg == "entropy")
        n = masked.sum() / masked.shape[0]
        k = int(n * (1 - s / t)) if i < steps - 1 else int(n)
        full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full[masked] = conf
        if k > 0:
            if alg_temp is None or alg_temp == 0:
                _, idx = torch.topk(full, k)
            else:
                idx = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=k)
            x_ = torch.zeros_like(x) + mask_id
            x_[masked] = x0.clone()
            rows = torch.arange(x.size(0)).unsqueeze(1).expand_as(idx)
            x[rows, idx] = x_[rows, idx]
    return x


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def dream(tiny_dream: Path):
    model = load_f64(tiny_dream, cached=True)
    tok = load_tokenizer(tiny_dream)
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    return model, tok, ids


@pytest.fixture(scope="module")
def dream_one_layer(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny("dream", tmp_path_factory.mktemp("dream1") / "model", seed=3, num_hidden_layers=1)
    return load_f64(path), load_tokenizer(path)


# ------------------------------------------------------------------------------------------ parity
DREAM_CASES = {
    "origin_greedy": dict(alg="origin"),
    "origin_sampled": dict(alg="origin", temperature=0.7, top_p=0.9),
    "maskgit_plus_greedy": dict(alg="maskgit_plus"),
    "maskgit_plus_sampled": dict(alg="maskgit_plus", temperature=1.0, top_k=20),
    "topk_margin": dict(alg="topk_margin", temperature=0.5),
    "entropy": dict(alg="entropy", temperature=0.3, top_p=0.95),
    "entropy_alg_temp": dict(alg="entropy", alg_temp=0.5),
    # both filters: Dream applies top-p before top-k (the order changes the kept set)
    "origin_top_p_top_k": dict(alg="origin", temperature=1.5, top_p=0.6, top_k=8),
}


@pytest.mark.parametrize("case", sorted(DREAM_CASES))
def test_matches_dream_semantics(dream, case):
    """Global-RNG wrapper == the documented reference, token for token (greedy and seeded sampling)."""
    model, _, ids = dream
    kw = DREAM_CASES[case]
    torch.manual_seed(4)
    ref = dream_reference(model, ids, model.config.mask_token_id, gen_length=12, steps=6, **kw)
    torch.manual_seed(4)
    out = dream_diffusion_generate(model, ids, max_new_tokens=12, steps=6, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_algorithms_reproducible_for_a_seed(dream, alg):
    model, _, ids = dream
    cfg = DecodeConfig(gen_length=12, block_length=4, steps=6, alg=alg, temperature=0.8, seed=9)
    a = generate(model, ids, cfg)
    b = generate(model, ids, cfg)
    assert a.tokens == b.tokens and a.nfe == b.nfe == 6
    others = {tuple(generate(model, ids, cfg.replace(seed=s)).tokens[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(a.tokens[0])}) > 1  # the seed matters at T > 0
    assert model.config.mask_token_id not in a.tokens[0] or alg == "origin"


def test_left_padded_batch_matches_reference_and_separate_runs(dream):
    model, tok, _ = dream
    rows = [tok("x = 2", add_special_tokens=False)["input_ids"], tok(PROMPT, add_special_tokens=False)["input_ids"]]
    width = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    am = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    ref = dream_reference(model, ids, model.config.mask_token_id, gen_length=8, steps=8, alg="maskgit_plus",
                          attention_mask=am)
    res = generate(model, ids, DecodeConfig(gen_length=8, steps=8, alg="maskgit_plus"), attention_mask=am)
    assert torch.equal(res.sequences, ref)
    for i, r in enumerate(rows):
        alone = generate(model, torch.tensor([r]), DecodeConfig(gen_length=8, steps=8, alg="maskgit_plus"))
        assert res.tokens[i] == alone.tokens[0]


# ------------------------------------------------------------------------------------------ logits / caches
def test_window_logits_are_shifted(dream):
    model, _, ids = dream
    s = make_session(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8))
    s.begin_block(0)
    win = s.forward_states(s.x)
    full = model(s.x).logits
    p = s.prompt_len
    assert s.window_start(0) == p and win.shape[1] == 8
    assert torch.allclose(win, full[:, p - 1 : p + 7], atol=1e-10, rtol=0)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_windows_follow_fast_dllm(dream_one_layer, cache):
    """One layer: cached K/V are exact. The block-start window is the full forward shifted; later windows equal
    the full forward shifted except their first row, which takes its own logits (Fast-dLLM)."""
    model, tok = dream_one_layer
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    s = make_session(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, cache=cache))
    first = s.begin_block(0)
    start, end = s.block_bounds(0)
    full = model(s.x).logits
    assert torch.allclose(first, full[:, start - 1 : start - 1 + first.shape[1]], atol=1e-10, rtol=0)
    x1 = s.transition(s.x, first, s.step_info(0, 0))
    assert (x1 != s.x).nonzero()[:, 1].tolist() == [start]  # the block's first row only
    states = torch.cat([x1, x1.clone()])
    states[1, start + 2] = 5
    win = s.forward_states(states)
    full = model(states).logits
    w = win.shape[1]
    assert w == (end - start if cache == "dual" else states.shape[1] - start)
    assert torch.allclose(win[:, 1:], full[:, start : start + w - 1], atol=1e-10, rtol=0)
    assert torch.allclose(win[:, 0], full[:, start], atol=1e-10, rtol=0)


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_prefix_and_dual_agree_when_exact(dream_one_layer, threshold):
    model, tok = dream_one_layer
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    kw = dict(gen_length=12, block_length=4, steps=12, alg="entropy", threshold=threshold)
    pre = generate(model, ids, DecodeConfig(cache="prefix", **kw))
    dual = generate(model, ids, DecodeConfig(cache="dual", **kw))
    assert pre.tokens == dual.tokens and pre.nfe == dual.nfe


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_and_nfe(dream, cache):
    model, _, ids = dream
    recs = []
    res = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, threshold=0.5, cache=cache),
                   observer=recs.append)
    assert all(int((r.x_after != r.x_before).sum()) >= 1 for r in recs)
    assert res.nfe == res.steps == len(recs)
    static = generate(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=4, cache=cache, alg="maskgit_plus"))
    assert static.nfe == 4 and static.stats["steps_per_block"] == [2, 2]
    assert model.config.mask_token_id not in static.tokens[0]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_forward_states_batch_equals_single(dream, cache):
    model, _, ids = dream
    s = make_session(model, ids, DecodeConfig(gen_length=8, block_length=4, steps=8, cache=cache))
    logits = s.begin_block(0)
    if logits is not None:
        s.x = s.transition(s.x, logits, s.step_info(0, 0))
    start, _ = s.block_bounds(0)
    states = s.x.repeat(3, 1)
    states[1, start + 1] = 7
    states[2, start + 1 : start + 3] = torch.tensor([9, 11])
    batch = s.forward_states(states)
    singles = torch.cat([s.forward_states(states[i : i + 1]) for i in range(3)])
    assert torch.allclose(batch, singles, atol=1e-12, rtol=0)


def test_dream_wrapper_options_and_errors(dream):
    model, _, ids = dream
    out = dream_diffusion_generate(model, ids, max_new_tokens=8, steps=8, alg="confidence_threshold",
                                   block_length=4, seed=1, return_dict_in_generate=True, output_history=True)
    assert out.sequences.shape == (1, ids.shape[1] + 8)
    assert len(out.history) == out.result.steps and out.result.config.cache == "prefix"
    assert out.result.config.threshold == 0.9
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dream_diffusion_generate(model, ids, max_length=ids.shape[1], steps=4)
    with pytest.raises(ConfigError, match="alg"):
        DecodeConfig(alg="greedy")
    with pytest.raises(ConfigError, match="top_p"):
        DecodeConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="empty"):
        generate(model, torch.zeros((1, 0), dtype=torch.long), gen_length=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_num_transfer_host_equals_tensor_schedule(dtype: torch.dtype) -> None:
    """The host count (numpy scalars, no device read) equals the reference's tensor expression for every masked
    count, batch, step and a few eps: the same IEEE operations in the same dtype."""
    for steps in (1, 2, 3, 5, 8, 13, 32):
        for eps in (1e-3, 1e-2, 0.1):
            ts = torch.linspace(1, eps, steps + 1, dtype=dtype)  # dream_timesteps in that dtype
            host = ts.tolist()
            for b in (1, 2, 3):
                for n in range(0, 65 * b, max(1, b // 2)):
                    num_mask = torch.tensor(n) / b if dtype == torch.float32 else torch.tensor(n, dtype=dtype) / b
                    for step in range(steps):
                        assert dream_num_transfer_host(n, b, host, step, steps, dtype) == dream_num_transfer(
                            num_mask, ts, step, steps), (steps, eps, b, n, step)


def test_masked_rows_equal_nonzero() -> None:
    """The masked rows found with their count known on the host are ``nonzero``'s, in its order."""
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1), (1, 9), (3, 7), (2, 33)):
        for _ in range(20):
            mask = torch.rand(shape, generator=g) < torch.rand((), generator=g)
            want = mask.reshape(-1).nonzero().squeeze(1)
            assert torch.equal(masked_rows(mask, int(mask.sum())), want)
