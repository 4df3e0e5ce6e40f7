"""LLaDA2.0 (``llada2_moe``): real sizes on the meta device, the tiny checkpoint's strict layout and Auto classes,
the router restated, config refusals, and the baseline against a re-statement of the official generator.

The official code itself (``modeling_llada2_moe.py``) was run out of tree on the tiny checkpoint (float32 and
bfloat16); see docs/MODELS.md for that comparison.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spiffy
from conftest import load_f64
from reference_llada2 import reference_generate
from spiffy.decoding import make_session, run_baseline
from spiffy.errors import ConfigError, UnsupportedDecodingError
from spiffy.models import family_of, family_spec, load_config
from spiffy.models.llada2 import LLaDA2MoeGate, LLaDA2MoeModelLM
from spiffy.models.loading import check_keys, special_token_ids

CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"
#: name -> (published total, published activated) in billions (model cards: "16B total, 1.4B activated" for mini;
#: "100B total, 6.1B activated" for flash)
REAL = {"inclusionAI--LLaDA2.0-mini": (16.0, 1.4), "inclusionAI--LLaDA2.0-flash": (100.0, 6.1)}

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def official_layout(c: dict) -> dict[str, tuple[int, ...]]:
    """The official checkpoint's keys and shapes from the config's dimensions (``modeling_llada2_moe.py``)."""
    h, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    nh, kv = c["num_attention_heads"], c["num_key_value_heads"]
    out = {"model.word_embeddings.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "attention.query_key_value.weight": ((nh + 2 * kv) * hd, h), p + "attention.dense.weight": (h, nh * hd),
                p + "attention.query_layernorm.weight": (hd,), p + "attention.key_layernorm.weight": (hd,)}
        mlps = {"": c["intermediate_size"]}
        if i >= c["first_k_dense_replace"]:
            w = c["moe_intermediate_size"]
            mlps = {f"experts.{e}.": w for e in range(c["num_experts"])} | {"shared_experts.": w * c["num_shared_experts"]}
            out |= {p + "mlp.gate.weight": (c["num_experts"], h), p + "mlp.gate.expert_bias": (c["num_experts"],)}
        for name, w in mlps.items():
            out |= {p + f"mlp.{name}gate_proj.weight": (w, h), p + f"mlp.{name}up_proj.weight": (w, h),
                    p + f"mlp.{name}down_proj.weight": (h, w)}
    return out


@pytest.mark.parametrize("name", [
    pytest.param("inclusionAI--LLaDA2.0-mini", marks=pytest.mark.slow),
    # ~8,000 expert modules: about 40 s to build even on the meta device, so only in the slow tier
    pytest.param("inclusionAI--LLaDA2.0-flash", marks=pytest.mark.slow),
])
def test_real_size_layout_and_parameter_count(name: str, tmp_path: Path) -> None:
    ckpt = tmp_path / name
    ckpt.mkdir()
    shutil.copy(CONFIGS / f"{name}.config.json", ckpt / "config.json")
    assert family_of(ckpt) == "llada2"
    config = load_config(ckpt, "llada2")
    with torch.device("meta"):
        model = family_spec("llada2").model_class(config)
    c = json.loads((CONFIGS / f"{name}.config.json").read_text())
    state = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    expected = official_layout(c)
    assert state == expected, sorted(set(state) ^ set(expected))[:8]
    check_keys(model, {k: torch.empty(s, device="meta") for k, s in expected.items()}, name)
    total = sum(p.numel() for p in model.parameters())
    idle = c["num_experts"] - c["num_experts_per_tok"]  # routed experts a token does not use
    per_expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    active = total - idle * per_expert * (c["num_hidden_layers"] - c["first_k_dense_replace"])
    published, published_active = REAL[name]
    print(f"\n{name}: {total:,} parameters ({total / 1e9:.2f}B), {active / 1e9:.2f}B activated per token")
    assert abs(total / 1e9 - published) / published < 0.05  # mini 16.26B, flash 102.89B (cards: 16B, 100B)
    assert abs(active / 1e9 - published_active) / published_active < 0.03  # mini 1.43B, flash 6.15B


def test_tiny_checkpoint_loads_strictly_and_through_auto(tiny_llada2: Path) -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = spiffy.load_model(tiny_llada2)
    assert isinstance(model, LLaDA2MoeModelLM)
    cfg = json.loads((tiny_llada2 / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["architectures"] == ["LLaDA2MoeModelLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_llada2_moe.LLaDA2MoeModelLM"
    assert {k: tuple(t.shape) for k, t in model.state_dict().items()} == official_layout(cfg)
    assert type(AutoConfig.from_pretrained(tiny_llada2)).__name__ == "LLaDA2MoeConfig"
    auto = AutoModelForCausalLM.from_pretrained(tiny_llada2)
    assert isinstance(auto, LLaDA2MoeModelLM)
    assert type(AutoModel.from_pretrained(tiny_llada2)).__name__ == "LLaDA2MoeModel"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llada2)
    ids = special_token_ids(model, tok)
    assert ids.mask == tok.convert_tokens_to_ids("<|mask|>") and ids.eos == tok.convert_tokens_to_ids("<|endoftext|>")
    assert ids.eot == tok.convert_tokens_to_ids("<|role_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>"
    # a checkpoint missing one expert's weight is refused (strict keys)
    from safetensors.torch import load_file, save_file

    broken = Path(str(tiny_llada2) + "-broken")
    shutil.copytree(tiny_llada2, broken, dirs_exist_ok=True)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = broken / index["weight_map"].pop(key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(spiffy.errors.CheckpointKeyError, match="experts.3.up_proj"):
        spiffy.load_model(broken)


def _gate_restated(gate: LLaDA2MoeGate, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time, in Python: sigmoid scores, biased group-limited choice, unbiased normalised weights."""
    idx, weights = [], []
    for row in h:
        s = torch.sigmoid(gate.weight.double() @ row.double())
        b = s + gate.expert_bias.double()
        groups = b.view(gate.n_group, -1)
        gscore = groups.topk(2).values.sum(-1)
        kept = set(gscore.topk(gate.topk_group).indices.tolist())
        allowed = [e for e in range(gate.num_experts) if e // (gate.num_experts // gate.n_group) in kept]
        chosen = sorted(allowed, key=lambda e: -float(b[e]))[: gate.top_k]
        w = s[chosen] / s[chosen].sum()
        idx.append(chosen)
        weights.append((w * gate.routed_scaling_factor).tolist())
    return torch.tensor(idx), torch.tensor(weights, dtype=torch.float64)


def test_router_is_the_official_rule_per_token(tiny_llada2: Path) -> None:
    model = load_f64(tiny_llada2, cached=True)
    gate = model.model.layers[1].mlp.gate
    g = torch.Generator().manual_seed(0)
    saved = gate.expert_bias.clone()
    try:
        gate.expert_bias.copy_(torch.randn(gate.num_experts, generator=g, dtype=torch.float64) * 0.3)
        h = torch.randn(20, model.config.hidden_size, generator=g, dtype=torch.float64)
        idx, w = gate(h)
        ref_idx, ref_w = _gate_restated(gate, h)
        order = idx.argsort(-1)
        assert torch.equal(idx.gather(1, order), ref_idx.sort(-1).values)
        got_w = dict(zip(map(tuple, idx.tolist()), w.tolist()))
        for r in range(len(h)):  # the bias changed the choice (some rows) but never enters the weights
            pairs = dict(zip(idx[r].tolist(), w[r].tolist()))
            assert all(abs(pairs[e] - x) < 1e-12 for e, x in zip(ref_idx[r].tolist(), ref_w[r].tolist()))
        assert got_w
        # each row is routed and computed on its own: a batch equals its rows alone
        x = torch.randn(3, 7, model.config.hidden_size, generator=g, dtype=torch.float64)
        mlp = model.model.layers[1].mlp
        together = mlp(x)
        for r in range(3):
            torch.testing.assert_close(together[r : r + 1], mlp(x[r : r + 1]), rtol=1e-12, atol=1e-12)
    finally:
        gate.expert_bias.copy_(saved)


@pytest.mark.parametrize(
    "field, value",
    [("score_function", "softmax"), ("router_dtype", "bf16"), ("norm_topk_prob", False), ("rotary_dim", 16),
     ("moe_shared_expert_intermediate_size", 7), ("norm_head", True), ("num_nextn_predict_layers", 1),
     ("use_sliding_window", True), ("moe_router_enable_expert_bias", False), ("n_group", 3),
     ("rope_scaling", {"rope_type": "yarn", "factor": 2.0})],
)
def test_config_values_the_official_code_would_mis_run_are_refused(tiny_llada2: Path, tmp_path: Path, field, value) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llada2, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field if field != "n_group" else "n_group"):
        spiffy.load_model(ckpt)


def test_llada21_token_editing_is_refused(tiny_llada2: Path) -> None:
    model = load_f64(tiny_llada2, cached=True)
    for kw in ({"editing_threshold": 0.9}, {"max_post_steps": 16}):
        with pytest.raises(UnsupportedDecodingError, match="rewrites rows already decoded"):
            make_session(model, torch.tensor([[5, 6, 7]]), gen_length=32, **kw)
    make_session(model, torch.tensor([[5, 6, 7]]), gen_length=32, editing_threshold=0.0)  # 2.0 semantics
    with pytest.raises(ConfigError, match="cache='dual'"):
        make_session(model, torch.tensor([[5, 6, 7]]), gen_length=32, cache="dual")


@settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt_len=st.integers(1, 20),
    block=st.sampled_from([4, 8, 16]),
    steps=st.integers(1, 20),
    threshold=st.sampled_from([0.05, 0.3, 0.95, 1.0]),
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    top=st.sampled_from([(0, 1.0), (20, 1.0), (0, 0.9)]),
    cache=st.sampled_from(["none", "prefix"]),
    minimal_topk=st.sampled_from([1, 1, 3]),
    seed=st.integers(0, 1000),
)
def test_baseline_equals_the_official_generator(tiny_llada2: Path, prompt_len, block, steps, threshold, temperature, top,
                                                cache, minimal_topk, seed) -> None:
    """Tokens of the session equal the re-stated official ``generate`` (float64, random options, both caches)."""
    model = load_f64(tiny_llada2, cached=True)
    ids = special_token_ids(model)
    gen_length = 2 * block
    prompt = torch.randint(5, 500, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    top_k, top_p = top
    ref, calls = reference_generate(
        model, prompt, gen_length=gen_length, block_length=block, steps=steps, threshold=threshold,
        temperature=temperature, top_k=top_k, top_p=top_p, minimal_topk=minimal_topk, eos_id=ids.eos,
        mask_id=ids.mask, generator=torch.Generator().manual_seed(seed),
    )
    s = make_session(model, torch.tensor([prompt]), gen_length=gen_length, block_length=block,
                     denoising_steps=steps, minimal_topk=minimal_topk, threshold=threshold,
                     temperature=temperature, top_k=top_k, top_p=top_p, cache=cache,
                     generator=torch.Generator().manual_seed(seed))
    run_baseline(s)
    out = s.generated()[0, :gen_length].tolist()
    if ids.eos in out:
        out = out[: out.index(ids.eos) + 1]
    assert out == ref
    if cache == "none":
        assert s.nfe == calls  # one model call per official step
