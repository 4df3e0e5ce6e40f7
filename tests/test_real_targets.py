"""The targets people run, at their published sizes on the meta device (no memory): Qwen3-30B-A3B and
Qwen3-Coder-30B-A3B-Instruct (``qwen3_moe``: the DEER and DDTree papers' targets), Qwen2.5-14B-Instruct (``qwen2``:
SpecDiff-2's verifier), Llama-3.1-8B-Instruct (``llama``), and Qwen3.5-27B (``qwen3_5``, a hybrid verified through its
text model).

Each is built from its published ``config.json`` (``tests/data/real_configs``, provenance in SOURCES.md) the way
``load_target`` builds it (its registry family's transformers class and config class), and its parameter count is
checked three ways: against a count computed here from the config's dimensions alone, against the published total,
and (MoE) the activated count against the published one. A DFlash drafter config for each (``spiffy tiny dflash`` /
``spiffy train-drafter``'s builder) fits the real target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from spiffy.models.ar_checkpoints import dflash_config_for_target
from spiffy.models.dflash import DFlashDraftModel, check_compatible
from spiffy.models.target import target_spec

CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"

#: fixture -> (family, published total and activated in billions as the model cards print them: truncated to the
#: digits shown, e.g. Qwen2.5-14B's 14.77B is "14.7B", Qwen3-30B-A3B's 3.35B activated (both embeddings) "3.3B")
REAL_TARGETS = {
    "Qwen--Qwen3-30B-A3B": ("qwen3_moe", 30.5, 3.3),
    "Qwen--Qwen3-Coder-30B-A3B-Instruct": ("qwen3_moe", 30.5, 3.3),
    "Qwen--Qwen2.5-14B-Instruct": ("qwen2", 14.7, None),
    "meta-llama--Llama-3.1-8B-Instruct": ("llama", 8.0, None),
}


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def _meta_target(name: str) -> torch.nn.Module:
    raw = _raw(name)
    spec = target_spec(raw, name)
    config = spec.config_class.from_dict(raw)
    with torch.device("meta"):
        return spec.model_class(config)


def counted_from_dimensions(c: dict) -> tuple[int, int]:
    """``(total, activated)`` parameters from the config's dimensions: embeddings and (untied) head, final norm, and
    per layer attention (Qwen2's q/k/v biases, Qwen3's q/k norms), two norms, and the MLP or, for an MoE layer, the
    router and every expert (activated: ``num_experts_per_tok`` of them)."""
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if c["model_type"] == "qwen2":
        attention += heads * hd + 2 * kv * hd
    if c["model_type"].startswith("qwen3"):
        attention += 2 * hd
    if c.get("num_experts"):
        experts = c["num_experts"] * 3 * h * c["moe_intermediate_size"]
        mlp, active_mlp = c["num_experts"] * h + experts, c["num_experts"] * h + experts * c["num_experts_per_tok"] // c["num_experts"]
    else:
        mlp = active_mlp = 3 * h * c["intermediate_size"]
    head = 0 if c.get("tie_word_embeddings") else v * h
    fixed = v * h + head + h
    return fixed + layers * (attention + 2 * h + mlp), fixed + layers * (attention + 2 * h + active_mlp)


@pytest.mark.parametrize("name", list(REAL_TARGETS))
def test_real_target_sizes(name: str) -> None:
    family, published, activated = REAL_TARGETS[name]
    model = _meta_target(name)
    assert type(model).__name__ == _raw(name)["architectures"][0]  # transformers' own class of the checkpoint
    assert target_spec(_raw(name)).name == family
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    total, active = counted_from_dimensions(_raw(name))
    assert count == total
    print(f"\n{name.replace('--', '/')}: {count:,} parameters = {count / 1e9:.2f}B (published {published}B)"
          + (f", {active / 1e9:.2f}B activated (published {activated}B)" if activated else ""))
    shown = 1 if published != 8.0 else 0  # the model cards print 30.5B, 14.7B (truncated), 8B
    assert math.floor(count / 1e9 * 10**shown) / 10**shown == published
    if activated is not None:
        assert math.floor(active / 1e8) / 10 == activated


@pytest.mark.parametrize("name", list(REAL_TARGETS))
def test_a_dflash_drafter_fits_each_real_target(name: str) -> None:
    """The drafter config ``spiffy tiny dflash --target`` / ``spiffy train-drafter`` build for the real target (five
    layers, block 16, the SPEC §3 target layers) fits it."""
    model = _meta_target(name)
    config = dflash_config_for_target(_raw(name), num_layers=5, block_size=16, target_layer_ids=None,
                                      mask_token_id=int(model.config.vocab_size) - 1)
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    check_compatible(drafter, model)
    n = model.config.num_hidden_layers
    assert drafter.target_layer_ids[0] == 1 and drafter.target_layer_ids[-1] == n - 3


def counted_hybrid(c: dict) -> int:
    """Qwen3.5's text model from its config's dimensions: per Gated-DeltaNet layer the q/k/v, z, b and a input
    projections, the depthwise convolution, ``dt_bias`` and ``A_log``, the gated norm and the output projection; per
    full-attention layer a gated query (twice the heads), k, v, o and the q/k norms; an MLP and two norms each."""
    h, v = c["hidden_size"], c["vocab_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd, nv = c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    linear = (h * (2 * kd + vd) + h * vd + 2 * h * nv + (2 * kd + vd) * c["linear_conv_kernel_dim"] + 2 * nv
              + c["linear_value_head_dim"] + vd * h)
    hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    attention = 2 * h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    per_layer = {"linear_attention": linear, "full_attention": attention}
    head = 0 if c.get("tie_word_embeddings") else v * h
    return v * h + head + h + sum(per_layer[k] + 3 * h * c["intermediate_size"] + 2 * h for k in c["layer_types"])


def test_real_qwen3_5_is_a_target_and_sized() -> None:
    """Qwen3.5-27B (48 Gated-DeltaNet layers, 16 full attention), published as ``Qwen3_5ForConditionalGeneration``:
    its target is the text model (``Qwen3_5ForCausalLM``, what ``load_target`` builds; the vision tower is not
    loaded), counted here from the config's dimensions; with the tower, transformers' multimodal class is the
    published 27B (transformers builds no multi-token-prediction layer). A DFlash drafter config fits it."""
    raw = _raw("Qwen--Qwen3.5-27B")
    spec = target_spec(raw)
    assert spec.name == "qwen3_5"
    with torch.device("meta"):
        target = spec.model_class(spec.config_class.from_dict(raw["text_config"]))
    text = sum(p.numel() for p in target.parameters())
    assert type(target).__name__ == "Qwen3_5ForCausalLM" and text == counted_hybrid(raw["text_config"])
    config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = getattr(transformers, raw["architectures"][0])(config)
    count = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    print(f"\nQwen/Qwen3.5-27B: {count:,} parameters = {count / 1e9:.2f}B (published 27B); text model (the target) "
          f"{text:,} = {text / 1e9:.2f}B, vision tower {tower:,}")
    assert int(count / 1e9) == 27 and count == text + tower
    drafter_config = dflash_config_for_target(raw, num_layers=5, block_size=16, target_layer_ids=None,
                                              mask_token_id=int(target.config.vocab_size) - 1)
    with torch.device("meta"):
        check_compatible(DFlashDraftModel(drafter_config), target)
