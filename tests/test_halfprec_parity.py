"""The official generators' semantics in half precision (bfloat16, float16), not only in float64.

The oracles restate the official code (``reference_forward.py`` for the model numerics, ``reference_llada.py`` and
the Dream reference of ``test_decoding_dream.py`` for the generators, plus Fast-dLLM's Dream
``confidence_threshold`` rule restated here); token ids are compared exactly. What each test pins:

* LLaDA RoPE tables stay float32 and rotate in float32; Dream/SDAR tables and rotation are in the model dtype;
* Fast-dLLM's LLaDA cache/threshold modes rank ``softmax(logits.to(float64))``; ML-GSAI ``generate`` the logits'
  dtype;
* the dual cache attends over keys in sequence order (the block's K/V written in place);
* Dream's no-cache ``confidence_threshold`` caps a step at ``n // steps`` plus what earlier steps carried over;
* SDAR configs carry ``fuse_cross_entropy``; SDAR hands attention the official mask layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reference_forward import OfficialDream, OfficialLLaDA
from reference_llada import reference_generate
from spiffy.decoding import make_session
from spiffy.compat import dream_diffusion_generate, llada_generate
from spiffy.models.cache import KVCache
from spiffy.models.layers import ForwardContext, attend
from spiffy.models.loading import load_model, save_checkpoint
from spiffy.models.sdar import official_mask_layout
from test_decoding_dream import _ref_sample, dream_reference

HALF = [torch.bfloat16, torch.float16]
GEN = 24


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llada_half(tiny_llada: Path):
    return {dt: load_model(tiny_llada, dtype=dt) for dt in HALF}


@pytest.fixture(scope="module")
def dream_half(tiny_dream: Path):
    return {dt: load_model(tiny_dream, dtype=dt) for dt in HALF}


# ------------------------------------------------------------------------------------------ model numerics
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_logits_follow_official_numerics(llada_half, dream_half, dtype):
    """Sanity on the oracle: spiffy's logits agree with the restated official forward (tolerance: a few ulps)."""
    ids = _prompt(30, 1)
    for model, oracle in ((llada_half[dtype], OfficialLLaDA), (dream_half[dtype], OfficialDream)):
        torch.testing.assert_close(model(ids).logits.float(), oracle(model)(ids).logits.float(), rtol=0.02, atol=0.02)


LLADA_CASES = {
    "blocks_greedy": dict(steps=12, gen_length=GEN, block_length=8, temperature=0.0),
    "one_block_greedy": dict(steps=GEN, gen_length=GEN, block_length=GEN, temperature=0.0),
    "random_remasking": dict(steps=12, gen_length=GEN, block_length=8, temperature=0.0, remasking="random"),
    "sampled": dict(steps=12, gen_length=GEN, block_length=8, temperature=0.8),
}


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(LLADA_CASES))
def test_llada_generate_equals_official_in_half_precision(llada_half, dtype, case):
    """ML-GSAI ``generate`` on the official numerics == spiffy, token for token, for several prompts."""
    model = llada_half[dtype]
    mask = model.config.mask_token_id
    kw = LLADA_CASES[case]
    for plen, seed in ((5, 0), (12, 1), (9, 2)):
        ids = _prompt(plen, seed)
        torch.manual_seed(seed)
        ref, _ = reference_generate(OfficialLLaDA(model), ids.clone(), mask_id=mask, **kw)
        torch.manual_seed(seed)
        out = llada_generate(model, ids, mask_id=mask, **kw)
        assert torch.equal(out, ref), f"{case} prompt {plen}: differs from the official semantics"


DREAM_CASES = {
    "maskgit_plus": dict(alg="maskgit_plus"),
    "topk_margin": dict(alg="topk_margin"),
    "entropy_sampled": dict(alg="entropy", temperature=0.6, top_p=0.95),
    "origin_sampled": dict(alg="origin", temperature=0.7),
}


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(DREAM_CASES))
def test_dream_generate_equals_official_in_half_precision(dream_half, dtype, case):
    model = dream_half[dtype]
    mask = model.config.mask_token_id
    kw = DREAM_CASES[case]
    for plen, seed in ((5, 0), (12, 1)):
        ids = _prompt(plen, seed)
        torch.manual_seed(seed)
        ref = dream_reference(OfficialDream(model), ids.clone(), mask, gen_length=GEN, steps=12, **kw)
        torch.manual_seed(seed)
        out = dream_diffusion_generate(model, ids, max_new_tokens=GEN, steps=12, **kw)
        assert torch.equal(out, ref), f"{case} prompt {plen}: differs from the official semantics"


# ------------------------------------------------------------------------------------------ Dream threshold
@torch.no_grad()
def dream_threshold_reference(model, ids, mask_id, gen_length, steps, threshold):  # noqa: ANN001
    """Fast-dLLM ``generation_utils`` ``alg="confidence_threshold"`` (no cache, batch 1), restated: a quota of
    ``n // steps`` per step plus what earlier steps left over; the first of the ranked quota is always taken, the
    others only at confidence ``>= threshold``; leftovers at the last step add one step with quota 0."""
    x = F.pad(ids, (0, gen_length), value=mask_id)
    quota = int((x == mask_id).sum()) // steps
    left, i = 0, 0
    while i < steps:
        masked = x == mask_id
        logits = model(x).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        conf, x0 = _ref_sample(logits[masked], 0.0, None, None)
        full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full[masked] = conf
        cur, left = quota + left, 0
        vals, idx = torch.topk(full, cur)
        take = torch.zeros_like(x, dtype=torch.bool)
        take[0, idx[0, 0]] = True
        for k in range(1, cur):
            if vals[0, k] < threshold:
                if i < steps - 1:
                    left += 1
                else:
                    quota, steps, left = 0, steps + 1, left + 1
            else:
                take[0, idx[0, k]] = True
        proposal = torch.full_like(x, mask_id)
        proposal[masked] = x0
        x[take] = proposal[take]
        i += 1
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
# the tiny model's confidences lie around 0.0177: thresholds there let several positions pass, so the quota binds
@pytest.mark.parametrize("threshold,steps", [(0.9, 8), (0.0178, 12), (0.0176, 6)])
def test_dream_confidence_threshold_quota_rule(tiny_dream, dream_half, dtype, threshold, steps):
    model = dream_half[dtype] if dtype in dream_half else load_model(tiny_dream, dtype=dtype)
    mask = model.config.mask_token_id
    for plen, seed in ((5, 0), (12, 1)):
        ids = _prompt(plen, seed)
        oracle = OfficialDream(model) if dtype != torch.float64 else model
        ref = dream_threshold_reference(oracle, ids.clone(), mask, GEN, steps, threshold)
        out = dream_diffusion_generate(model, ids, max_new_tokens=GEN, steps=steps, alg="confidence_threshold",
                                       threshold=threshold)
        assert torch.equal(out, ref), f"prompt {plen}: differs from Fast-dLLM's confidence_threshold rule"


# ------------------------------------------------------------------------------------------ Fast-dLLM LLaDA
@pytest.mark.parametrize("cache,threshold", [("prefix", None), ("dual", 0.3), ("none", 0.3)])
def test_fast_dllm_modes_rank_float64_confidences(llada_half, cache, threshold):
    """Fast-dLLM's ``get_transfer_index`` computes ``softmax(logits.to(float64))``; on bfloat16 logits that ranks
    (and thresholds) differently from a softmax in bfloat16, and spiffy must follow float64."""
    model = llada_half[torch.bfloat16]
    s = make_session(model, _prompt(6), gen_length=16, block_length=8, steps=8, cache=cache, threshold=threshold)
    s.begin_block(0)
    info = s.step_info(0, 1)
    w = s.window_end(0) - info.window_start
    gen = torch.Generator().manual_seed(0)
    disagreements = 0
    for trial in range(40):
        logits = (torch.randn(1, w, 64, generator=gen) * 0.02 + torch.randn(1, w, 1, generator=gen) * 0.01)
        logits = logits.to(torch.bfloat16)
        out = s.transition(s.x, logits, info)
        expected = {}
        for name, conf_dtype in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
            x0 = logits.argmax(-1)
            p = torch.gather(F.softmax(logits.to(conf_dtype), dim=-1), -1, x0[..., None])[..., 0]
            # the official rows ranked: the whole sequence without cache, the window with one
            lo, hi = (0, s.x.shape[1]) if cache == "none" else (info.window_start, info.window_start + w)
            rows = torch.arange(lo, hi)
            eligible = (s.x[0, rows] == s.mask_id) & (rows >= info.block_start) & (rows < info.block_end)
            p_rows = torch.full((hi - lo,), -torch.inf, dtype=p.dtype)
            p_rows[info.window_start - lo : info.window_start - lo + w] = p[0]
            conf = torch.where(eligible, p_rows, torch.full_like(p_rows, -torch.inf))
            k = int(eligible.sum()) if threshold is not None else int(s.num_transfer_tokens[0, 1])
            vals, idx = torch.topk(conf, k)
            keep = torch.ones_like(vals, dtype=torch.bool) if threshold is None else (vals >= threshold)
            keep[0] = True
            x = s.x.clone()
            x[0, rows[idx[keep]]] = x0[0, idx[keep] - (info.window_start - lo)]
            expected[name] = x
        assert torch.equal(out, expected["float64"]), f"trial {trial}: not Fast-dLLM's float64 ranking"
        disagreements += int(not torch.equal(expected["float64"], expected["bfloat16"]))
    assert disagreements > 0, "the trials never distinguish float64 from bfloat16 ranking"


# ------------------------------------------------------------------------------------------ dual cache order
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_dual_cache_attends_in_sequence_order(dtype):
    """A cache with ``insert_at`` attends exactly as keys written in place (Fast-dLLM's dual cache)."""
    gen = torch.Generator().manual_seed(0)
    b, h, t, d, start, end = 1, 4, 24, 16, 9, 17
    k_full = torch.randn(b, h, t, d, generator=gen).to(dtype)
    v_full = torch.randn(b, h, t, d, generator=gen).to(dtype)
    q = torch.randn(b, h, end - start, d, generator=gen).to(dtype)
    k_new = torch.randn(b, h, end - start, d, generator=gen).to(dtype)
    v_new = torch.randn(b, h, end - start, d, generator=gen).to(dtype)
    full = KVCache(1)
    full.append(0, k_full, v_full)
    keep = torch.cat([torch.arange(0, start), torch.arange(end, t)])
    cache = full.select(keep, insert_at=start)
    ctx = ForwardContext(cache, cache, "read", cache.get_seq_length(0), torch.arange(start, end)[None], None)
    out = attend(q, k_new, v_new, 0, ctx, scale=d**-0.5)
    k_in, v_in = k_full.clone(), v_full.clone()
    k_in[:, :, start:end], v_in[:, :, start:end] = k_new, v_new
    ref = F.scaled_dot_product_attention(q, k_in, v_in, scale=d**-0.5).transpose(1, 2).reshape(b, end - start, h * d)
    assert torch.equal(out, ref)
    with pytest.raises(Exception, match="read-only"):
        attend(q, k_new, v_new, 0, ForwardContext(cache, cache, "append", cache.get_seq_length(0), ctx.position_ids, None))


# ------------------------------------------------------------------------------------------ SDAR
def test_sdar_config_carries_fuse_cross_entropy(tiny_sdar, tmp_path):
    assert json.loads((tiny_sdar / "config.json").read_text())["fuse_cross_entropy"] is True
    model = load_model(tiny_sdar, dtype=torch.float32)
    out = save_checkpoint(model, tmp_path / "again")
    assert json.loads((out / "config.json").read_text())["fuse_cross_entropy"] is True


def test_sdar_mask_layout_is_the_official_one():
    blocks = torch.arange(8) // 4
    visible = (blocks[None, :] <= blocks[:, None])[None, None]  # [1, 1, 8, 8]
    assert official_mask_layout(None) is None
    assert official_mask_layout(torch.ones(1, 1, 4, 12, dtype=torch.bool)) is None  # decoding: no mask
    assert official_mask_layout(visible).shape == (1, 8, 8)  # prefill: the 3-D mask of the official generate
    batched = visible.expand(2, 1, 8, 8)
    assert official_mask_layout(batched) is batched
    additive = torch.zeros(1, 1, 8, 8)
    assert official_mask_layout(additive) is additive
