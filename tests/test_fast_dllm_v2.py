"""Fast-dLLM v2 (``model_type`` ``Fast_dLLM_Qwen``): checkpoint layout, config fields, and parity with the official
generators.

``tests/data/fast_dllm_v2/expected.json`` holds what the official code produced (``scripts/fast_dllm_v2_official_parity.py``,
run with transformers 4.53.1 on the official ``modeling.py`` / ``configuration.py`` of the Hub repository and NVlabs'
``v2/generation_functions.py``): per case, the tokens of ``batch_sample`` and of ``generate`` on the checkpoint
``spiffy tiny fast_dllm_v2 --seed 0`` writes, in float32 and bfloat16. Spiffy's baseline must equal them token for
token. Real sizes: the published config.json files on the meta device, counts equal to the published totals.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import expect_official
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import spiffy  # noqa: F401 - registers the families with transformers
from spiffy.decoding import make_session, run_baseline
from spiffy.errors import ConfigError
from spiffy.models.fast_dllm_v2 import FAST_DLLM_V2_AUTO_MAP, Fast_dLLM_QwenForCausalLM
from spiffy.models.loading import check_keys, family_of, load_config, load_model
from spiffy.models.registry import family_spec
from spiffy.models.tiny import make_tiny

DATA = Path(__file__).parent / "data"
CONFIGS = DATA / "real_configs"
#: fixture -> exact published total (7B: the Hub index's total_size 15,231,233,024 bytes in bf16 / 2; 1.5B:
#: Qwen2.5-1.5B's published 1,543,714,304 with tied embeddings)
REAL = {
    "Efficient-Large-Model--Fast_dLLM_v2_7B": (7.6, 7_615_616_512),
    "Efficient-Large-Model--Fast_dLLM_v2_1.5B": (1.5, 1_543_714_304),
}

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _qwen2_layout(c: dict) -> dict[str, tuple[int, ...]]:
    h, ff, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (vocab, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (ff, h),
                p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff)}
    return out


@pytest.mark.parametrize("name", list(REAL))
def test_real_size_layout_and_parameter_count(name: str, tmp_path: Path) -> None:
    shutil.copy(CONFIGS / f"{name}.config.json", tmp_path / "config.json")
    assert family_of(tmp_path) == "fast_dllm_v2"
    config = load_config(tmp_path, "fast_dllm_v2")
    with torch.device("meta"):
        model = Fast_dLLM_QwenForCausalLM(config)
    layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = _qwen2_layout(json.loads((CONFIGS / f"{name}.config.json").read_text()))
    assert layout == expected
    check_keys(model, {k: torch.empty(s, device="meta") for k, s in expected.items()}, name)
    count = sum(p.numel() for p in model.parameters())
    published, exact = REAL[name]
    print(f"\n{name.replace('--', '/')}: {count:,} parameters (published {published}B)")
    assert round(count / 1e9, 1) == published and count == exact


def test_tiny_checkpoint_loads_strictly_and_through_auto_classes(tiny_fast_dllm_v2: Path) -> None:
    cfg = json.loads((tiny_fast_dllm_v2 / "config.json").read_text())
    assert cfg["model_type"] == "Fast_dLLM_Qwen" and cfg["auto_map"] == FAST_DLLM_V2_AUTO_MAP
    assert family_spec("fast_dllm_v2").auto_map == FAST_DLLM_V2_AUTO_MAP
    model = load_model(tiny_fast_dllm_v2)
    assert type(model).__name__ == "Fast_dLLM_QwenForCausalLM"
    assert type(AutoConfig.from_pretrained(tiny_fast_dllm_v2)).__name__ == "Fast_dLLM_QwenConfig"
    assert type(AutoModelForCausalLM.from_pretrained(tiny_fast_dllm_v2)).__name__ == "Fast_dLLM_QwenForCausalLM"
    assert type(AutoModel.from_pretrained(tiny_fast_dllm_v2)).__name__ == "Fast_dLLM_QwenModel"
    keys = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in keys and "lm_head.weight" in keys
    # strict: a checkpoint missing a tensor is refused
    with pytest.raises(Exception, match="lm_head"):
        check_keys(model, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, "tiny")


@pytest.mark.parametrize("field, value", [
    ("use_sliding_window", True), ("layer_types", ["sliding_attention", "full_attention"]), ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unsupported_config_fields_are_refused(tiny_fast_dllm_v2: Path, tmp_path: Path, field: str, value) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_fast_dllm_v2, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field if field != "layer_types" else "layer_types"):
        load_model(ckpt)


def test_official_mask_default(tiny_fast_dllm_v2: Path) -> None:
    """Without a mask the model builds the official one: block-causal in blocks of ``block_size`` (default 32)."""
    model = load_model(tiny_fast_dllm_v2, dtype=torch.float64)
    ids = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)
    for bs in (None, 8):
        blk = 32 if bs is None else bs
        explicit = ((pos[None, :] // blk) <= (pos[:, None] // blk))[None, None]
        a = model(ids, block_size=bs).logits
        b = model(ids, attention_mask=explicit).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    full = model(ids, attention_mask=torch.ones(1, 1, 40, 40, dtype=torch.bool)).logits
    assert not torch.allclose(model(ids).logits, full)


@pytest.mark.parametrize("bad", [dict(steps=16), dict(top_k=5), dict(small_block_size=3), dict(remasking="random"),
                                 dict(cfg_scale=1.0), dict(gen_length=12)])
def test_decoding_options_refused(tiny_fast_dllm_v2: Path, bad: dict) -> None:
    model = load_model(tiny_fast_dllm_v2)
    with pytest.raises(ConfigError):
        make_session(model, torch.tensor([[5, 6, 7]]), **{"gen_length": 16, "block_length": 8, **bad})


def _expected() -> dict:
    return json.loads((DATA / "fast_dllm_v2" / "expected.json").read_text())


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _cut(row: list[int], start: int, stop: int) -> list[int]:
    for i in range(start, len(row)):
        if row[i] == stop:
            return row[: i + 1]
    return row


@pytest.fixture(scope="module")
def official_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    ckpt = make_tiny("fast_dllm_v2", tmp_path_factory.mktemp("fdv2") / "model", seed=0)
    models = {d: load_model(ckpt, dtype=getattr(torch, d)) for d in ("float32", "bfloat16")}
    assert _digest(models["float32"]) == _expected()["weights_sha256"], "spiffy tiny fast_dllm_v2 changed its weights"
    return models


@pytest.mark.parametrize("index", range(24))
def test_baseline_equals_the_official_generators(official_models: dict, index: int) -> None:
    case = _expected()["cases"][index]
    model = official_models[case["dtype"]]
    s = make_session(
        model, torch.tensor([case["prompt"]]), gen_length=case["max_new_tokens"], block_length=case["block_size"],
        small_block_size=case["small_block_size"], threshold=case["threshold"], temperature=case["temperature"],
        top_p=case["top_p"], cache="dual" if case["use_block_cache"] else "prefix", seed=case["seed"],
        stop_token_ids=(case["stop"],) if case["stop"] >= 0 else (),
    )
    run_baseline(s)
    ours = _cut(s.x[0].tolist(), len(case["prompt"]), case["stop"])
    for generator, tokens in case["official"].items():
        expect_official(ours == tokens, f"{generator} differs ({case['dtype']}, case {index})",
                        "python scripts/fast_dllm_v2_official_parity.py")


@pytest.mark.parametrize("threshold", [1.0, 0.3])
def test_freedave_chain_equals_baseline(tiny_fast_dllm_v2: Path, threshold: float) -> None:
    """FreeDave's chain (``freedave:K``) on Fast-dLLM v2: the output is the baseline's and drafts are accepted."""
    from spiffy.api import generate
    from spiffy.decoding.fast_dllm_v2_config import FastDLLMv2DecodeConfig
    from spiffy.selfspec.freedave import freedave_graph

    model = load_model(tiny_fast_dllm_v2, dtype="float64")
    config = FastDLLMv2DecodeConfig(gen_length=16, block_length=8, small_block_size=4, threshold=threshold,
                                    stop_token_ids=())
    accepted = 0
    for steps in (2, 4):
        graph = freedave_graph(model, config, steps)
        for seq in ([3, 9, 11, 4], [17, 2, 5, 8, 9, 10, 11, 12, 40, 41]):
            ids = torch.tensor([seq])
            out = generate(model, ids, config, graph=graph, budget=steps - 1)
            assert out.tokens == generate(model, ids, config).tokens
            accepted += int(out.stats["accepted_total"]) if "accepted_total" in out.stats else 0
    assert accepted > 0


def test_forward_states_is_the_shifted_block_causal_call(tiny_fast_dllm_v2: Path) -> None:
    """``forward_states`` (eager and static) returns the official shifted logits: block position ``i`` gets the logits
    of column ``i - 1``, the block's first position its own, of a call whose committed blocks see only themselves and
    earlier blocks; checked against one uncached call over ``[0, end)`` in blocks of ``B`` (the official-code
    fixtures above skip on a CPU of another kind, this does not)."""
    model = load_model(tiny_fast_dllm_v2, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    kw = dict(gen_length=16, block_length=8, small_block_size=4, threshold=0.05, stop_token_ids=())
    for static in (False, True):
        s = make_session(model, torch.tensor([[5, 6, 7, 8, 9]]), **kw)
        if static:
            s.use_static()
        for block in range(2):
            s.begin_block(block)
            start, end = s.block_bounds(block)
            x = s.x.clone()
            x[:, max(start, 5) : end] = torch.randint(13, 250, (1, end - max(start, 5)), generator=g)
            full = model(x[:, :end], block_size=8).logits[:, start:end]
            want = torch.cat([full[:, :1], full[:, :-1]], dim=1)
            torch.testing.assert_close(s.forward_states(x), want, rtol=1e-9, atol=1e-9)
            s.end_block(block)
