"""Every field of a z-lab DFlash config that changes the drafts, written with a non-default value into a drafter's
``config.json``: honoured the way the official ``dflash`` package (PyPI 0.1.0) reads it, or refused with a typed
error. (Checked once against the package itself, float64: identical logits for each field; the tests restate its
semantics independently.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_target, make_tiny_dflash
from spiffy.models.tiny import make_tiny
from test_ar_drafter import _reference_block

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("dflash_fields")
    target_dir = make_tiny("llama", root / "target", seed=1, num_hidden_layers=3)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=2, num_layers=2, block_size=8)
    return target_dir, drafter_dir, load_target(target_dir, torch.float64, "cpu")


def _with(drafter_dir: Path, tmp: Path, top: dict | None = None, extras: dict | None = None) -> Path:
    """A copy of the drafter checkpoint whose config.json sets ``top`` fields and ``dflash_config`` ``extras``."""
    out = tmp / "variant"
    shutil.copytree(drafter_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(top or {})
    cfg["dflash_config"].update(extras or {})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _inputs(model, target):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 9, model.fc.weight.shape[1], generator=g, dtype=torch.float64)
    emb = target.get_input_embeddings()(torch.tensor([[5] + [model.mask_token_id] * 7]))
    return feats, emb, torch.arange(0, 17).view(1, -1)


def test_input_embedding_scale_multiplies_the_block_embeddings(pair, tmp_path):
    _, drafter_dir, target = pair
    base = load_drafter(drafter_dir, dtype=torch.float64)
    scaled = load_drafter(_with(drafter_dir, tmp_path, extras={"input_embedding_scale": 2.5}), dtype=torch.float64)
    feats, emb, pos = _inputs(base, target)
    out = scaled(feats, emb, pos)
    torch.testing.assert_close(out, base(feats, emb * 2.5, pos), rtol=0, atol=1e-12)
    assert not torch.allclose(out, base(feats, emb, pos), atol=1e-3)


def test_output_multiplier_then_softcapping(pair, tmp_path):
    _, drafter_dir, target = pair
    base = load_drafter(drafter_dir, dtype=torch.float64)
    feats, emb, pos = _inputs(base, target)
    hidden = base(feats, emb, pos)
    plain = base.compute_logits(hidden, target.lm_head)
    mult = load_drafter(_with(drafter_dir, tmp_path / "m", extras={"output_multiplier": 0.3}), dtype=torch.float64)
    torch.testing.assert_close(mult.compute_logits(hidden, target.lm_head), plain * 0.3, rtol=0, atol=1e-12)
    both = load_drafter(_with(drafter_dir, tmp_path / "c", top={"final_logit_softcapping": 0.7},
                              extras={"output_multiplier": 2.0}), dtype=torch.float64)
    capped = both.compute_logits(hidden, target.lm_head)
    torch.testing.assert_close(capped, 0.7 * torch.tanh(plain * 2.0 / 0.7), rtol=0, atol=1e-12)
    assert capped.abs().max() < 0.7 and plain.abs().max() > 0.7  # the cap bites
    off = load_drafter(_with(drafter_dir, tmp_path / "o", top={"final_logit_softcapping": 0.0}), dtype=torch.float64)
    torch.testing.assert_close(off.compute_logits(hidden, target.lm_head), plain, rtol=0, atol=0)  # 0 = off


@pytest.mark.parametrize("is_causal", [True, False])
def test_is_causal(pair, tmp_path, is_causal):
    _, drafter_dir, target = pair
    base = load_drafter(drafter_dir, dtype=torch.float64)
    model = load_drafter(_with(drafter_dir, tmp_path, top={"is_causal": is_causal}), dtype=torch.float64)
    feats, emb, pos = _inputs(model, target)
    out = model(feats, emb, pos)
    torch.testing.assert_close(out, _reference_block(model, feats, emb, pos, causal=is_causal), rtol=0, atol=1e-10)
    assert torch.allclose(out, base(feats, emb, pos), atol=1e-10) is (not is_causal)
    # causal: a block row never depends on the rows after it
    later = emb.clone()
    later[0, 5:] += 1.0
    changed = (model(feats, later, pos) - out).abs().amax(-1)[0]
    assert bool((changed[:5] < 1e-12).all()) is is_causal and bool((changed[5:] > 1e-6).all())


@pytest.mark.parametrize("is_causal", [None, False])
def test_sliding_window_layer_types(pair, tmp_path, is_causal):
    """``sliding_attention`` layers see keys < ``sliding_window`` positions away: behind only (causal) unless
    ``is_causal`` is false; cached context gives the same result."""
    _, drafter_dir, target = pair
    top = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 4, "use_sliding_window": True}
    if is_causal is not None:
        top["is_causal"] = is_causal
    model = load_drafter(_with(drafter_dir, tmp_path, top=top), dtype=torch.float64)
    assert model.sliding_layers == [True, True]
    feats, emb, pos = _inputs(model, target)
    out = model(feats, emb, pos)
    ref = _reference_block(model, feats, emb, pos, window=4, causal=is_causal is None)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    cache = model.new_cache()
    model(feats[:, :5], emb[:, :3], torch.arange(0, 8), past_key_values=cache)
    torch.testing.assert_close(model(feats[:, 5:], emb, torch.arange(5, 17).view(1, -1), past_key_values=cache), out,
                               rtol=0, atol=1e-10)


def test_mixed_layer_types_mask_only_their_layers(pair, tmp_path):
    _, drafter_dir, target = pair
    top = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3, "use_sliding_window": True}
    model = load_drafter(_with(drafter_dir, tmp_path, top=top), dtype=torch.float64)
    assert [(a.causal, a.window) for a in model.layer_attention] == [(True, 3), (False, None)]


@pytest.mark.parametrize("top, extras, match", [
    ({"layer_types": ["linear_attention", "full_attention"]}, {}, "layer_types"),
    ({"is_causal": "yes"}, {}, "is_causal"),
    ({}, {"output_multiplier": "big"}, "output_multiplier"),
    ({}, {"input_embedding_scale": float("nan")}, "input_embedding_scale"),
    ({"final_logit_softcapping": [30]}, {}, "final_logit_softcapping"),
])
def test_values_that_cannot_be_honoured_are_refused(pair, tmp_path, top, extras, match):
    _, drafter_dir, _ = pair
    with pytest.raises(ConfigError, match=match):
        load_drafter(_with(drafter_dir, tmp_path, top=top, extras=extras), dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_with_every_field_set_stays_lossless(pair, tmp_path, temperature):
    _, drafter_dir, target = pair
    path = _with(drafter_dir, tmp_path, top={"is_causal": True, "final_logit_softcapping": 5.0,
                                             "layer_types": ["sliding_attention", "full_attention"],
                                             "sliding_window": 6, "use_sliding_window": True},
                 extras={"input_embedding_scale": 1.5, "output_multiplier": 0.8})
    sampling = SamplingConfig(temperature=temperature, seed=2)
    prompt = [5, 17, 42, 8, 99, 3]
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=16, sampling=sampling))
    for method in ("dflash", "ddtree"):
        drafter = as_drafter(load_drafter(path, dtype=torch.float64))
        cfg = ARSpecConfig(method=method, budget=12, max_new_tokens=16, sampling=sampling)
        assert speculative_generate(target, drafter, prompt, cfg).tokens == ar.tokens, method
