"""The real checkpoints' architectures at their published sizes, built on the meta device (no memory).

Each model is built the way ``load_model`` builds it - ``load_config`` on a directory holding the official
``config.json`` (fixtures in ``tests/data/real_configs``, provenance in its SOURCES.md), then the family's class on
the meta device - and its parameter names and shapes must be exactly the official checkpoint's key layout, written
out below from SPEC section 3 and the config's dimensions (for LLaDA also checked against the official
``model.safetensors.index.json``). Parameter counts are printed beside the published ones (``pytest -s``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spiffy.models import family_of, family_spec, load_config
from spiffy.models.loading import check_keys

CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"

#: family -> (config fixture, published size in billions, exact count from the official bf16 index total_size / 2)
REAL = {
    "llada": ("GSAI-ML--LLaDA-8B-Instruct", 8.0, 8_015_581_184),
    "dream": ("Dream-org--Dream-v0-Instruct-7B", 7.6, 7_615_616_512),
    "sdar": ("JetLM--SDAR-8B-Chat", 8.2, 8_190_735_360),
    "qwen3": ("Qwen--Qwen3-8B", 8.2, 8_190_735_360),
    "dflash": ("z-lab--Qwen3-8B-DFlash-b16", None, None),
    # SDAR-30B-A3B-Chat: 30.5B in total (the official index's total_size / 2), 3.3B activated per token
    "sdar_moe": ("JetLM--SDAR-30B-A3B-Chat", 30.5, 30_532_122_624),
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def llada_layout(c: dict) -> dict[str, tuple[int, ...]]:
    d, ff, vocab, kv = c["d_model"], c["mlp_hidden_size"], c["embedding_size"], c["n_kv_heads"]
    head = d // c["n_heads"]
    out = {"model.transformer.wte.weight": (vocab, d), "model.transformer.ln_f.weight": (d,)}
    if not c["weight_tying"]:
        out["model.transformer.ff_out.weight"] = (vocab, d)
    for i in range(c["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        out |= {p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,), p + "q_proj.weight": (d, d),
                p + "k_proj.weight": (kv * head, d), p + "v_proj.weight": (kv * head, d), p + "attn_out.weight": (d, d),
                p + "ff_proj.weight": (ff, d), p + "up_proj.weight": (ff, d), p + "ff_out.weight": (d, ff)}
    return out


def qwen_layers(c: dict, prefix: str, qkv_bias: bool, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    h, ff = c["hidden_size"], c["intermediate_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff)}
        if qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if qk_norm:
            out |= {p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,)}
    return out


def qwen_lm_layout(c: dict, qkv_bias: bool, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    h, vocab = c["hidden_size"], c["vocab_size"]
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return out | qwen_layers(c, "model.", qkv_bias, qk_norm)


def dflash_layout(c: dict) -> dict[str, tuple[int, ...]]:
    h, n_target = c["hidden_size"], len(c["dflash_config"]["target_layer_ids"])
    out = {"fc.weight": (h, n_target * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}  # no embedding, no head
    return out | qwen_layers(c, "", qkv_bias=False, qk_norm=True)


def sdar_moe_layout(c: dict) -> dict[str, tuple[int, ...]]:
    """SDAR-MoE: SDAR's layout with every sparse layer's MLP replaced by ``mlp.gate`` and ``mlp.experts.{e}.*``."""
    out = qwen_lm_layout(c, qkv_bias=False, qk_norm=True)
    h, e, ff = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    for i in range(c["num_hidden_layers"]):
        if i in c["mlp_only_layers"] or e == 0 or (i + 1) % c["decoder_sparse_step"]:
            continue
        p = f"model.layers.{i}.mlp."
        for k in ("gate_proj", "up_proj", "down_proj"):
            del out[f"{p}{k}.weight"]
        out[p + "gate.weight"] = (e, h)
        for x in range(e):
            out |= {f"{p}experts.{x}.gate_proj.weight": (ff, h), f"{p}experts.{x}.up_proj.weight": (ff, h),
                    f"{p}experts.{x}.down_proj.weight": (h, ff)}
    return out


LAYOUTS = {
    "llada": llada_layout,
    "dream": lambda c: qwen_lm_layout(c, qkv_bias=True, qk_norm=False),
    "sdar": lambda c: qwen_lm_layout(c, qkv_bias=False, qk_norm=True),
    "qwen3": lambda c: qwen_lm_layout(c, qkv_bias=False, qk_norm=True),
    "dflash": dflash_layout,
    "sdar_moe": sdar_moe_layout,
}


_META: dict[str, tuple[str, torch.nn.Module]] = {}


def _meta_model(name: str, tmp_path: Path) -> tuple[str, torch.nn.Module]:
    """Build the checkpoint's model as ``load_model`` does, on the meta device (once per checkpoint: building
    SDAR-30B-A3B's 6,144 experts takes seconds; the tests only read the models)."""
    if name not in _META:
        _META[name] = _build_meta_model(name, tmp_path)
    return _META[name]


def _build_meta_model(name: str, tmp_path: Path) -> tuple[str, torch.nn.Module]:
    ckpt = tmp_path / name
    ckpt.mkdir(parents=True)
    shutil.copy(CONFIGS / f"{name}.config.json", ckpt / "config.json")
    family = family_of(ckpt)
    config = load_config(ckpt, family)
    with torch.device("meta"):
        model = family_spec(family).model_class(config)
    return family, model


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "sdar_moe" else f for f in REAL])
def test_real_size_layout_and_parameter_count(family: str, tmp_path: Path) -> None:
    name, published, exact = REAL[family]
    found, model = _meta_model(name, tmp_path)
    assert found == family
    assert all(p.is_meta for p in model.parameters())
    layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = LAYOUTS[family](_config(name))
    assert sorted(layout) == sorted(expected), (sorted(set(layout) ^ set(expected)))[:8]
    assert layout == expected
    # the loader's strict check accepts a checkpoint with exactly this layout
    check_keys(model, {k: torch.empty(s, device="meta") for k, s in expected.items()}, name)
    count = sum(p.numel() for p in model.parameters())
    shown = f"published {published}B" if published else "no published total"
    print(f"\n{name.replace('--', '/')}: {count:,} parameters = {count / 1e9:.2f}B ({shown})")
    if published is not None:
        assert round(count / 1e9, 1) == published
        assert count == exact


def test_llada_matches_the_official_weight_map(tmp_path: Path) -> None:
    """Key names and total size against LLaDA-8B-Instruct's own model.safetensors.index.json (bf16: 2 bytes each)."""
    summary = json.loads((CONFIGS / "GSAI-ML--LLaDA-8B-Instruct.index-summary.json").read_text())
    keys = set(summary["top_level_keys"]) | {
        f"{summary['block_prefix']}{i}.{k}" for i in range(summary["num_blocks"]) for k in summary["block_keys"]
    }
    assert len(keys) == summary["num_keys"]
    _, model = _meta_model("GSAI-ML--LLaDA-8B-Instruct", tmp_path)
    state = model.state_dict()
    assert set(state) == keys
    assert sum(t.numel() for t in state.values()) * 2 == summary["metadata"]["total_size"]


def test_dflash_drafter_fits_the_qwen3_8b_target(tmp_path: Path) -> None:
    from spiffy.models.dflash import check_compatible, drafter_settings

    _, drafter = _meta_model("z-lab--Qwen3-8B-DFlash-b16", tmp_path / "d")
    _, target = _meta_model("Qwen--Qwen3-8B", tmp_path / "t")
    settings = drafter_settings(drafter.config)
    assert settings["block_size"] == 16 and settings["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert settings["mask_token_id"] == 151669
    check_compatible(drafter, target)


@pytest.mark.slow
def test_sdar_moe_matches_the_official_weight_map(tmp_path: Path) -> None:
    """SDAR-30B-A3B-Chat's key names and total size against its own model.safetensors.index.json (bf16), and the
    published 3.3B activated parameters (embeddings, head, attention, norms, router and 8 of 128 experts)."""
    summary = json.loads((CONFIGS / "JetLM--SDAR-30B-A3B-Chat.index-summary.json").read_text())
    layers = [f"{summary['layer_prefix']}{i}." for i in range(summary["num_layers"])]
    keys = set(summary["top_level_keys"]) | {p + k for p in layers for k in summary["layer_keys"]} | {
        f"{p}{summary['expert_prefix']}{e}.{k}" for p in layers for e in range(summary["num_experts"])
        for k in summary["expert_keys"]
    }
    assert len(keys) == summary["num_keys"]
    _, model = _meta_model("JetLM--SDAR-30B-A3B-Chat", tmp_path)
    state = model.state_dict()
    assert set(state) == keys
    assert sum(t.numel() for t in state.values()) * 2 == summary["metadata"]["total_size"]
    c = model.config
    expert = sum(t.numel() for k, t in state.items() if ".experts.0." in k and k.startswith("model.layers.0."))
    active = sum(t.numel() for k, t in state.items() if ".experts." not in k) + (
        c.num_hidden_layers * c.num_experts_per_tok * expert
    )
    print(f"\nSDAR-30B-A3B-Chat: {active:,} activated parameters per token")
    assert active == 3_353_032_704 and abs(active / 1e9 - 3.3) < 0.1  # the card's 3.3B; 3.35B counting both embeddings
