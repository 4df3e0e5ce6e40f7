"""dLLM drafters for AR targets (DEER, SpecDiff-2): the checkpoint kind, the drafter's prefix cache, and every method
x drafter kind x rule against plain AR (float64)."""

from __future__ import annotations

import json

import pytest
import torch

from oracle_drafter import OracleDrafter
from spiffy.arspec import ARSpecConfig, ContextUpdate, SamplingConfig, speculative_generate
from spiffy.arspec.dllm_drafter import DLLMDrafter, as_drafter, drafter_block_mask
from spiffy.arspec.drafter import DFlashDrafter
from spiffy.embedded import embedded_model_path, is_embedded_available
from spiffy.errors import ConfigError, DrafterMismatchError
from spiffy.models import load_target, load_tokenizer, make_tiny_dflash, make_tiny_target
from spiffy.models.ar_drafters import drafter_kind, load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.cache import KVCache
from spiffy.models.sdar import block_causal_mask

torch.set_num_threads(1)

BLOCK = 6
METHODS = ("dflash", "deer", "specdiff", "ddtree")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("dllm_drafter")
    target = make_tiny_target(base / "target", seed=5, num_layers=2)
    dllm = make_tiny_dllm_drafter(base / "dllm", target, seed=1, block_size=BLOCK)
    dflash = make_tiny_dflash(base / "dflash", target, seed=2, block_size=BLOCK)
    return {"target": target, "dllm": dllm, "dflash": dflash}


@pytest.fixture(scope="module")
def target(paths):
    return load_target(paths["target"], torch.float64, "cpu")


@pytest.fixture(scope="module")
def drafters(paths):
    return {kind: as_drafter(load_ar_drafter(paths[kind], dtype=torch.float64)) for kind in ("dllm", "dflash")}


@pytest.fixture(scope="module")
def prompt():
    return [5, 17, 42, 8, 99]


def test_tiny_dllm_drafter_checkpoint(paths):
    d = paths["dllm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["drafter_config"]["kind"] == "dllm"
    assert cfg["drafter_config"]["block_size"] == BLOCK
    assert (d / "tokenizer.json").read_text() == (paths["target"] / "tokenizer.json").read_text()
    assert drafter_kind(d) == "dllm" and drafter_kind(paths["dflash"]) == "dflash"
    with pytest.raises(ConfigError, match="not a drafter"):
        drafter_kind(paths["target"])
    model = load_ar_drafter(d, dtype=torch.float64)
    drafter = as_drafter(model)
    assert isinstance(drafter, DLLMDrafter) and drafter.block_size == BLOCK and not drafter.shifted
    assert drafter.layout == "root"
    assert drafter.mask_token_id == cfg["drafter_config"]["mask_token_id"]
    assert isinstance(as_drafter(load_ar_drafter(paths["dflash"], dtype=torch.float64)), DFlashDrafter)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path, paths, target):
    other = make_tiny_target(tmp_path / "other", seed=0, vocab_size=200, with_tokenizer=False)
    wrong = make_tiny_dllm_drafter(tmp_path / "wrong", other, seed=0)
    drafter = as_drafter(load_ar_drafter(wrong, dtype=torch.float64))
    with pytest.raises(DrafterMismatchError, match="vocabulary"):
        speculative_generate(target, drafter, [1, 2, 3], ARSpecConfig(method="deer", max_new_tokens=4))


def test_block_mask_layout():
    m = drafter_block_mask(2, 3, 4, "cpu")[0, 0]
    assert m.shape == (5, 9)
    assert m[0].tolist() == [True] * 5 + [False] * 4  # committed row 0 sees the cache and itself
    assert m[1].tolist() == [True] * 6 + [False] * 3
    assert bool(m[2:].all())  # draft rows see everything


def test_prefix_cache_matches_a_full_forward(paths):
    """The proposal of round r (cache of earlier rounds + fused commit) equals one uncached forward over the whole
    committed context with the same visibility."""
    model = load_ar_drafter(paths["dllm"], dtype=torch.float64)
    drafter = DLLMDrafter(model)
    target = load_target(paths["target"], torch.float64, "cpu")
    drafter.attach(target)
    context = [3, 9, 27, 81, 1, 4, 16]
    drafter.commit(ContextUpdate(context[:4], 0, range(4)))
    drafter.propose(context[4], 4, 3)  # caches the first 4
    drafter.commit(ContextUpdate(context[4:6], 4, range(2)))
    got = drafter.propose(context[6], 6, 4)
    assert drafter._cache.get_seq_length() == 6  # committed rows only, drafted rows cropped
    ids = context + [drafter.mask_token_id] * 4
    mask = drafter_block_mask(6, 5, 0, "cpu")
    full = model(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(len(ids)).view(1, -1),
                 past_key_values=KVCache(model.config.num_hidden_layers), cache_policy="read").logits[0]
    torch.testing.assert_close(got, full[7:11], rtol=1e-9, atol=1e-9)
    drafter.detach()


def _aligned(model, block: int = 4):
    model.config.drafter_config = {"kind": "dllm", "block_size": BLOCK, "layout": "aligned", "attention_block": block,
                                   "mask_token_id": model.config.drafter_config["mask_token_id"]}
    return DLLMDrafter(model)


def test_aligned_layout_cache_matches_sdar_block_causal_forward(paths):
    """SDAR's own layout: the cache keeps complete aligned blocks; a proposal equals one uncached forward over the
    committed context + block under SDAR's block-causal mask."""
    model = load_ar_drafter(paths["dllm"], dtype=torch.float64)
    drafter = _aligned(model)
    assert drafter.layout == "aligned" and drafter.attention_block == 4
    drafter.attach(load_target(paths["target"], torch.float64, "cpu"))
    context = [3, 9, 27, 81, 1, 4, 16, 64, 2, 8]
    drafter.commit(ContextUpdate(context[:5], 0, range(5)))
    drafter.propose(context[5], 5, 3)
    assert drafter._cache.get_seq_length() == 4  # block [0, 4) complete; position 4 stays pending
    drafter.commit(ContextUpdate(context[5:9], 5, range(4)))
    got = drafter.propose(context[9], 9, 4)
    assert drafter._cache.get_seq_length() == 8
    ids = context + [drafter.mask_token_id] * 4
    mask = block_causal_mask(len(ids), 4, device="cpu")
    full = model(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(len(ids)).view(1, -1),
                 past_key_values=KVCache(model.config.num_hidden_layers), cache_policy="read").logits[0]
    torch.testing.assert_close(got, full[10:14], rtol=1e-9, atol=1e-9)
    drafter.detach()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_aligned_layout_is_lossless(target, paths, prompt, temperature):
    drafter = _aligned(load_ar_drafter(paths["dllm"], dtype=torch.float64), block=3)
    sampling = SamplingConfig(temperature=temperature, seed=6)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=18, sampling=sampling))
    for method in METHODS:
        cfg = ARSpecConfig(method=method, budget=8, drafts=3, max_new_tokens=18, sampling=sampling)
        assert speculative_generate(target, drafter, prompt, cfg).tokens == ar.tokens, method
    steps = DLLMDrafter(drafter.model, denoise_steps=2)
    cfg = ARSpecConfig(method="deer", max_new_tokens=18, sampling=sampling)
    assert speculative_generate(target, steps, prompt, cfg).tokens == ar.tokens


@pytest.mark.parametrize("accept", ["coupled", "rejection"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["dllm", "dflash"])
def test_greedy_equals_ar_for_every_method_drafter_and_rule(target, drafters, prompt, kind, method, accept):
    sampling = SamplingConfig(temperature=0.0)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=20, sampling=sampling))
    cfg = ARSpecConfig(method=method, budget=10, drafts=3, accept=accept, max_new_tokens=20, sampling=sampling)
    assert speculative_generate(target, drafters[kind], prompt, cfg).tokens == ar.tokens


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["dllm", "dflash"])
def test_coupled_sampling_equals_ar_same_seed(target, drafters, prompt, kind, method):
    for seed in (0, 7):
        sampling = SamplingConfig(temperature=1.0, top_k=50, seed=seed)
        ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=20, sampling=sampling))
        cfg = ARSpecConfig(method=method, budget=10, drafts=4, max_new_tokens=20, sampling=sampling)
        assert speculative_generate(target, drafters[kind], prompt, cfg).tokens == ar.tokens, seed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", METHODS)
def test_oracle_drafter_is_lossless_and_accepts_runs(target, prompt, method, temperature):
    sampling = SamplingConfig(temperature=temperature, seed=4)
    n = 24
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=n + BLOCK, sampling=sampling))
    for wrong_every in (0, 4):
        drafter = OracleDrafter(ar.tokens, len(prompt), target.config.vocab_size, BLOCK, wrong_every)
        cfg = ARSpecConfig(method=method, budget=12, drafts=4, max_new_tokens=n, sampling=sampling)
        res = speculative_generate(target, drafter, prompt, cfg)
        assert res.tokens == ar.tokens[:n], (method, wrong_every)
        if wrong_every == 0:
            assert res.tau > 3.0, (method, res.tau)


def test_rejection_rule_is_reproducible_and_uses_the_min_p_over_q_acceptance(target, prompt):
    """Same seed -> same tokens; an oracle whose q equals the target's p is accepted (almost) always."""
    sampling = SamplingConfig(temperature=1.0, seed=11)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=30, sampling=sampling))
    drafter = OracleDrafter(ar.tokens, len(prompt), target.config.vocab_size, BLOCK)
    for method in ("deer", "specdiff", "ddtree"):
        cfg = ARSpecConfig(method=method, budget=8, drafts=2, accept="rejection", max_new_tokens=24,
                           sampling=sampling)
        a = speculative_generate(target, drafter, prompt, cfg)
        b = speculative_generate(target, drafter, prompt, cfg)
        assert a.tokens == b.tokens and len(a.tokens) == 24
        other = speculative_generate(target, drafter, prompt, ARSpecConfig(
            method=method, budget=8, drafts=2, accept="rejection", max_new_tokens=24,
            sampling=SamplingConfig(temperature=1.0, seed=12)))
        assert other.tokens != a.tokens  # the seed matters


def test_specdiff_config():
    with pytest.raises(ConfigError, match="drafts"):
        ARSpecConfig(method="specdiff", drafts=-1)
    with pytest.raises(ConfigError, match="acceptance rule"):
        ARSpecConfig(accept="typical")
    assert not ARSpecConfig(method="specdiff", drafts=0).uses_drafter
    assert ARSpecConfig(method="specdiff", drafts=4).draft_nodes(6) == 20
    assert ARSpecConfig(method="deer", chain_length=3).draft_nodes(6) == 3
    assert ARSpecConfig(method="specdiff").samples_drafts
    assert not ARSpecConfig(method="deer", accept="rejection").samples_drafts  # greedy: argmax chain
    assert ARSpecConfig(method="deer", accept="rejection", sampling=SamplingConfig(temperature=0.7)).samples_drafts


def test_denoise_steps_keep_the_output_lossless(target, paths, prompt):
    drafter = DLLMDrafter(load_ar_drafter(paths["dllm"], dtype=torch.float64), denoise_steps=3)
    sampling = SamplingConfig(temperature=1.0, seed=2)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=16, sampling=sampling))
    for method in ("deer", "ddtree"):
        cfg = ARSpecConfig(method=method, budget=8, max_new_tokens=16, sampling=sampling)
        assert speculative_generate(target, drafter, prompt, cfg).tokens == ar.tokens


@pytest.mark.slow
@pytest.mark.skipif(not is_embedded_available("ar-dllm-drafter"), reason="the embedded dLLM drafter is not shipped")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shipped_models_float32_coupled_equals_ar(temperature):
    target_dir = embedded_model_path("ar-target")
    target = load_target(target_dir, torch.float32, "cpu")
    drafters = {kind: as_drafter(load_ar_drafter(embedded_model_path(name), dtype=torch.float32))
                for kind, name in (("dllm", "ar-dllm-drafter"), ("dflash", "ar-drafter"))}
    prompt = load_tokenizer(target_dir)("def add(a, b):\n", add_special_tokens=False)["input_ids"]
    sampling = SamplingConfig(temperature=temperature, seed=1)
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=32, sampling=sampling))
    for kind, drafter in drafters.items():
        for method in METHODS:
            cfg = ARSpecConfig(method=method, budget=16, drafts=4, max_new_tokens=32, sampling=sampling)
            assert speculative_generate(target, drafter, prompt, cfg).tokens == ar.tokens, (kind, method)


def test_plain_sdar_checkpoint_drafts_in_its_own_layout(tiny_sdar, tiny_llada):
    from spiffy.models.ar_drafters import DEFAULT_DLLM_BLOCK, dllm_drafter_settings

    sdar = dllm_drafter_settings(load_ar_drafter(tiny_sdar, dtype=torch.float32))
    assert (sdar.layout, sdar.block_size, sdar.attention_block, sdar.family) == ("aligned", DEFAULT_DLLM_BLOCK,
                                                                                 DEFAULT_DLLM_BLOCK, "sdar")
    llada = load_ar_drafter(tiny_llada, dtype=torch.float32)
    assert dllm_drafter_settings(llada).layout == "root"
    llada.config.drafter_config = {"layout": "aligned"}
    with pytest.raises(ConfigError, match="SDAR only|does not fit"):
        dllm_drafter_settings(llada)


@pytest.mark.parametrize("accept", ["coupled", "rejection"])
def test_batched_rows_equal_single_runs_with_dllm_drafters(target, paths, accept):
    """speculative_generate_batch with dLLM drafters: each row equals its own single run (both rules, the sampled
    specdiff trees keyed by the row's root positions)."""
    from spiffy.arspec import speculative_generate_batch

    prompts = [[5, 17, 42, 8, 99], [7, 7, 1], [120, 2, 9, 4]]
    for method in ("deer", "specdiff", "ddtree"):
        cfg = ARSpecConfig(method=method, budget=6, drafts=3, accept=accept, max_new_tokens=12,
                           sampling=SamplingConfig(temperature=1.0, seed=2))
        drafters = [as_drafter(load_ar_drafter(paths["dllm"], dtype=torch.float64)) for _ in prompts]
        batch = speculative_generate_batch(target, drafters, prompts, cfg)
        for p, res in zip(prompts, batch):
            alone = speculative_generate(target, as_drafter(load_ar_drafter(paths["dllm"], dtype=torch.float64)), p, cfg)
            assert res.tokens == alone.tokens, (method, p)
