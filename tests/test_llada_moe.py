"""LLaDA-MoE (``llada_moe``): parity with the official model + generator, the real size, strict keys, config fields,
Auto classes and per-row routing.

Official parity: ``tests/data/llada_moe/expected.json`` holds the tokens the official ``modeling_lladamoe.py``
(inclusionAI/LLaDA-MoE-7B-A1B, as copied in ZHZisZZ/dllm at commit 03270de7) and ML-GSAI/LLaDA's ``generate()``
(commit b7e6c356; the LLaDA-MoE model card's sampler) produced on two tiny checkpoints written by ``make_tiny``, in
float32 and bfloat16 (``scripts/llada_moe_official_parity.py``, transformers 4.57.6). The checkpoints are rebuilt
here from the same seed and overrides (their tensor digest must match) and decoded by spiffy's LLaDA baseline
(``spiffy.compat.llada_generate``, global RNG as the official script).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import expect_official
import torch
from safetensors.torch import load_file, save_file

from conftest import load_f64
from spiffy.compat import llada_generate
from spiffy.errors import CheckpointError, ConfigError
from spiffy.models import family_of
from spiffy.models.llada_moe import LLaDAMoEConfig, LLaDAMoEModelLM, LLaDAMoESparseMoeBlock
from spiffy.models.loading import load_model
from spiffy.models.registry import family_spec
from spiffy.models.tiny import make_tiny

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA.parent.parent / "scripts"))
from llada_moe_official_parity import CASES, logits_digest, logits_probe, tensor_digest  # noqa: E402

EXPECTED = json.loads((DATA / "llada_moe" / "expected.json").read_text())
REAL_CONFIG = DATA / "real_configs" / "inclusionAI--LLaDA-MoE-7B-A1B-Instruct.config.json"
#: the two recorded checkpoints: the default tiny shape, and every optional field at a non-default value (a dense
#: first layer, a shared expert, expert bias, clip_qkv, half-width RoPE, GQA, attention biases, 6 experts / 3 routed)
VARIANTS: dict[str, tuple[int, dict]] = {
    "a": (0, {}),
    "b": (1, dict(num_hidden_layers=3, moe_layer_freq=[0, 1, 1], shared_expert_intermediate_size=48,
                  moe_router_enable_expert_bias=True, clip_qkv=2.5, partial_rotary_factor=0.5, num_key_value_heads=2,
                  attention_bias=True, num_experts=6, num_experts_per_tok=3)),
}

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("llada_moe_parity")
    return {name: make_tiny("llada_moe", base / name, seed=seed, **kw) for name, (seed, kw) in VARIANTS.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_checkpoints_are_the_recorded_ones(checkpoints, name: str) -> None:
    assert tensor_digest(checkpoints[name]) == EXPECTED["checkpoints"][name]["digest"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_baseline_equals_official_generator(checkpoints, name: str, dtype: str) -> None:
    entry = EXPECTED["checkpoints"][name]
    model = load_model(checkpoints[name], dtype=dtype)
    with torch.no_grad():  # one forward, bit for bit
        logits = model(logits_probe(model.config.vocab_size, entry["mask_id"])).logits
    expect_official(logits_digest(logits) == entry["logits"][dtype], f"{name} {dtype}: logits differ from the official "
                    "model's", "python scripts/llada_moe_official_parity.py")
    for case, _plen, gen_length, block, steps, temp, remasking, seed in CASES:
        run = entry["runs"][f"{dtype}/{case}"]
        torch.manual_seed(seed)
        out = llada_generate(model, torch.tensor(run["prompt"]), steps=steps, gen_length=gen_length,
                             block_length=block, temperature=temp, remasking=remasking, mask_id=entry["mask_id"])
        expect_official(out.tolist() == run["output"], f"{name} {dtype} {case}", "python scripts/llada_moe_official_parity.py")


# ------------------------------------------------------------------------------------------------ real size
def test_real_size_on_meta() -> None:
    """LLaDA-MoE-7B-A1B from its config.json: the official key layout and the published 7B total / 1.4B active."""
    data = json.loads(REAL_CONFIG.read_text())
    assert family_of(data) == "llada_moe"
    cfg = LLaDAMoEConfig.from_dict(data)
    with torch.device("meta"):
        model = LLaDAMoEModelLM(cfg)
    h, ff, e, k, v, layers = 2048, 1024, 64, 8, 157184, 16
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    expect = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        expect |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h, h),
                   p + "self_attn.v_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
                   p + "mlp.gate.weight": (e, h)}
        for j in range(e):
            expect |= {f"{p}mlp.experts.{j}.gate_proj.weight": (ff, h), f"{p}mlp.experts.{j}.up_proj.weight": (ff, h),
                       f"{p}mlp.experts.{j}.down_proj.weight": (h, ff)}
    assert shapes == expect
    total = sum(p.numel() for p in model.parameters())
    # the official bf16 shards (5 GB + 5 GB + 4.72 GB) hold ~7.36B parameters; the model card says 7B in total
    assert total == 7_356_880_896
    attn = 4 * h * h + 2 * 128 + 2 * h
    active = v * h + layers * (attn + k * 3 * h * ff + e * h) + h  # head + the 8 routed experts (no input embedding)
    assert round(active / 1e9, 1) == 1.4  # "1.4B activated" (1,397,823,488)
    # the GPU cost script's random-weight builder picks the MoE class for this "llada" config too
    from spiffy.bench.gpu_costs import build_random, count_parameters

    built = build_random(data, "meta", torch.bfloat16)
    assert type(built) is LLaDAMoEModelLM and count_parameters(built) == total


# ------------------------------------------------------------------------------------------------ loading
def test_auto_classes_and_family(tiny_llada_moe, tiny_llada) -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    assert family_of(tiny_llada_moe) == "llada_moe" and family_of(tiny_llada) == "llada"
    assert type(AutoConfig.from_pretrained(tiny_llada_moe)).__name__ == "LLaDAMoEConfig"
    assert type(AutoConfig.from_pretrained(tiny_llada)).__name__ == "LLaDAConfig"  # the shared model type still works
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(0))
    ours = load_model(tiny_llada_moe)(ids).logits
    for auto in (AutoModel, AutoModelForCausalLM):
        model = auto.from_pretrained(tiny_llada_moe)
        assert type(model) is LLaDAMoEModelLM
        assert torch.equal(model(ids).logits, ours)
    cfg = json.loads((tiny_llada_moe / "config.json").read_text())
    assert cfg["auto_map"] == dict(family_spec("llada_moe").auto_map) and cfg["model_type"] == "llada"


def test_strict_keys(tmp_path: Path) -> None:
    path = make_tiny("llada_moe", tmp_path / "m", seed=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = next(k for k in index["weight_map"] if ".experts.1." in k)
    shard = path / index["weight_map"][victim]
    state = load_file(str(shard))
    state.pop(victim)
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.1"):
        load_model(path)
    state[victim] = torch.zeros(1)
    state["model.layers.0.mlp.experts.99.up_proj.weight"] = torch.zeros(32, 64)
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError):
        load_model(path)


@pytest.mark.parametrize("field, value", [
    ("moe_router_score_function", "sigmoid"), ("routed_scaling_factor", 2.5), ("router_num_group", 8),
    ("hidden_act", "gelu"), ("partial_rotary_factor", 0.0), ("moe_layer_freq", 1),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unsupported_fields_are_refused(field: str, value) -> None:
    kw = dict(family_spec("llada_moe").tiny_config, vocab_size=64)
    kw[field] = value
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        LLaDAMoEModelLM(LLaDAMoEConfig(**kw))


def test_norm_topk_prob_is_not_applied_as_in_the_official_block() -> None:
    """The official MoE block hard-codes ``norm_topk_prob = False``: the config value changes nothing."""
    kw = dict(family_spec("llada_moe").tiny_config, vocab_size=64)
    torch.manual_seed(0)
    a = LLaDAMoEModelLM(LLaDAMoEConfig(**kw, norm_topk_prob=True)).eval()
    b = LLaDAMoEModelLM(LLaDAMoEConfig(**kw, norm_topk_prob=False)).eval()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 64, (1, 6))
    assert torch.equal(a(ids).logits, b(ids).logits)


# ------------------------------------------------------------------------------------------------ routing
def test_each_row_is_routed_on_its_own(tiny_llada_moe) -> None:
    """Routing and the MoE output of a token depend on that token's hidden state alone (float64)."""
    model = load_f64(tiny_llada_moe, cached=True)
    block = next(m for m in model.modules() if isinstance(m, LLaDAMoESparseMoeBlock))
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, 5, 64, generator=g, dtype=torch.float64)
    weights, chosen = block.route(h.reshape(-1, 64))
    together = block(h)
    for r in range(3):
        alone = block(h[r : r + 1])
        assert torch.allclose(alone[0], together[r], rtol=0, atol=1e-12)
        w, c = block.route(h[r])
        assert torch.equal(c, chosen[r * 5 : (r + 1) * 5]) and torch.equal(w, weights[r * 5 : (r + 1) * 5])
    # the routing weights are the top-k softmax probabilities, not renormalised
    probs = torch.softmax(block.gate(h.reshape(-1, 64)).float(), dim=-1)
    assert torch.allclose(weights.float(), probs.gather(1, chosen), atol=1e-6)
    assert bool((weights.sum(-1) < 1).all())
    ids = torch.randint(0, 500, (3, 9), generator=g)
    batched = model(ids).logits
    for r in range(3):
        assert torch.allclose(model(ids[r : r + 1]).logits[0], batched[r], rtol=0, atol=1e-10)


def test_calibrate_and_freedave_on_tiny(tiny_llada_moe, tmp_path: Path) -> None:
    """``spiffy calibrate`` writes a graph for the tiny checkpoint that decodes other prompts losslessly; FreeDave's
    chain is lossless on it too."""
    from spiffy.api import generate
    from spiffy.cli.main import main
    from spiffy.decoding import DecodeConfig
    from spiffy.selfspec.freedave import freedave_graph
    from spiffy.selfspec.graph import load_graph

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "import os\n")))
    out = tmp_path / "graph.json"
    argv = ["calibrate", "--model", str(tiny_llada_moe), "--prompts", str(prompts), "--out", str(out), "--nodes", "5",
            "--gen-length", "16", "--block-length", "8", "--dtype", "float64", "--no-progress", "--seed", "1"]
    assert main(argv) == 0
    graph = load_graph(out)
    assert graph.calibrated_for["family"] == "llada_moe" and len(graph.nodes) > 0
    model = load_f64(tiny_llada_moe, cached=True)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, temperature=1.0, seed=3)
    chain = freedave_graph(model, cfg, 4)
    for seq in ([3, 9, 11, 4], [17, 2, 40]):
        ids = torch.tensor([seq])
        base = generate(model, ids, cfg)
        assert generate(model, ids, cfg, graph=graph, budget=3).tokens == base.tokens
        assert generate(model, ids, cfg, graph=chain, budget=3).tokens == base.tokens
