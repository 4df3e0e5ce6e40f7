"""SDAR-MoE (SDAR-30B-A3B-Chat / -Sci, ``model_type="sdar_moe"``) and TraDo (the SDAR architecture) in spiffy.

* the baseline equals SDAR's official generator on the official MoE modeling code token for token, float32 and
  bfloat16 (fixture ``tests/data/sdar_moe_official.json``, written by ``scripts/sdar_moe_official_parity.py``);
* routing: float32 softmax, top-k, ``norm_topk_prob``, experts summed in index order, each token on its own (a row
  of a batch routes as it would alone);
* every MoE field of the real config is honoured (``decoder_sparse_step``, ``mlp_only_layers``, ``num_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``attention_bias``) or refused;
* ``spiffy tiny sdar_moe``, strict loading, the Auto classes after ``import spiffy``, ``spiffy calibrate`` and
  FreeDave's chain on the tiny checkpoint; bfloat16 Spiffy equals the baseline;
* TraDo: a config with the keys of SDAR-4B-Chat's real config.json (TraDo-4B-Instruct's base) loads and decodes as
  SDAR under TraDo's generator options.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import expect_official
import torch
from safetensors.torch import load_file

from conftest import load_f64
from reference_sdar import reference_block_diffusion_generate
from spiffy.api import generate
from spiffy.compat import sdar_block_diffusion_generate
from spiffy.decoding import make_session, run_baseline
from spiffy.errors import CheckpointKeyError, ConfigError
from spiffy.models import load_model
from spiffy.models.qwen_moe import SparseMoeBlock
from spiffy.models.sdar import SDARMoeConfig, SDARMoeForCausalLM
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.freedave import chain_graph_for
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory
from spiffy.selfspec.runtime import speculative_generate

DATA = Path(__file__).resolve().parent / "data"
OFFICIAL = json.loads((DATA / "sdar_moe_official.json").read_text())
GEN_KEYS = ("gen_length", "block_length", "denoising_steps", "temperature", "top_k", "top_p", "remasking_strategy",
            "confidence_threshold", "eb_threshold")

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's checkpoint: ``spiffy tiny sdar_moe --seed 0`` (its weights' digest is recorded there)."""
    return make_tiny("sdar_moe", tmp_path_factory.mktemp("sdar_moe") / "m", seed=0)


def _digest(path: Path) -> str:
    """The fixture script's weight digest: sha256 over the tensors, names sorted, float32 bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_baseline_equals_the_official_generator(moe_ckpt: Path, dtype: str) -> None:
    """27 runs per dtype (3 prompt lengths x 3 block/step shapes x 3 strategies, T > 0 with top-k / top-p): the
    official ``block_diffusion_generate`` on the official ``SDARMoeForCausalLM`` against spiffy's wrapper with the
    same global seed. ``overwrite_quirk=True``: the official top-k also re-picks decoded rows when a step's count
    exceeds the masks left (spiffy's default clamps). The official ``entropy_bounded`` branch fails
    (UnboundLocalError), so those runs are recorded but not compared."""
    assert _digest(moe_ckpt) == OFFICIAL["weights_sha256"], "make_tiny('sdar_moe', seed=0) changed: rerun the script"
    model = load_model(moe_ckpt, dtype=dtype)
    runs = [r for r in OFFICIAL["runs"] if r["dtype"] == dtype]
    compared = [r for r in runs if "output" in r]
    assert len(compared) == 27 and {r.get("error") for r in runs} == {None, "UnboundLocalError"}
    for r in compared:
        torch.manual_seed(r["seed"])
        x = sdar_block_diffusion_generate(model, {"input_ids": torch.tensor([r["prompt"]])}, OFFICIAL["mask_id"],
                                          **{k: r[k] for k in GEN_KEYS}, overwrite_quirk=True)
        expect_official(x[0].tolist() == r["output"], f"run {r}", "python scripts/sdar_moe_official_parity.py")


def _restated_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The official routing restated token by token: float32 softmax, top-k, renormalised, experts in index order."""
    h = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        p = torch.softmax(block.gate(h[t]).float(), dim=-1)
        w, e = torch.topk(p, block.top_k)
        if block.norm_topk_prob:
            w = w / w.sum()
        for weight, expert in sorted(zip(w.to(h.dtype).tolist(), e.tolist()), key=lambda we: we[1]):
            out[t] += block.experts[expert](h[t][None])[0] * weight
    return out.view_as(x)


@pytest.mark.parametrize("norm", [True, False])
def test_routing_is_the_official_rule_and_per_token(norm: bool) -> None:
    torch.manual_seed(3)
    block = SparseMoeBlock(16, 8, num_experts=6, top_k=2, norm_topk_prob=norm).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(block(x), _restated_moe(block, x))
    # a row routes as it would alone: the same experts and weights, the same output up to matmul rounding
    w_all, e_all = block.route(x.reshape(-1, 16))
    for r in range(3):
        w_r, e_r = block.route(x[r])
        assert torch.equal(e_all[5 * r: 5 * r + 5], e_r) and torch.equal(w_all[5 * r: 5 * r + 5], w_r)
        torch.testing.assert_close(block(x[r: r + 1])[0], block(x)[r], rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        SparseMoeBlock(16, 8, num_experts=2, top_k=3, norm_topk_prob=True)


def _keys(**fields) -> set[str]:  # noqa: ANN003
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4,
                bos_token_id=0, eos_token_id=0)
    config = SDARMoeConfig(**{**base, **fields})
    with torch.device("meta"):
        return set(SDARMoeForCausalLM(config).state_dict())


def test_every_moe_field_is_honoured_or_refused() -> None:
    def sparse(keys: set[str]) -> list[int]:
        return [i for i in range(4) if f"model.layers.{i}.mlp.gate.weight" in keys]

    assert sparse(_keys()) == [0, 1, 2, 3]
    assert sparse(_keys(decoder_sparse_step=2)) == [1, 3]  # (i + 1) % step == 0, as the official layer rule
    assert sparse(_keys(mlp_only_layers=[0, 2])) == [1, 3]
    dense = _keys(num_experts=0)
    assert sparse(dense) == [] and "model.layers.0.mlp.gate_proj.weight" in dense
    keys = _keys(decoder_sparse_step=2)
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.experts.2.down_proj.weight" in keys
    assert "model.layers.1.mlp.experts.3.up_proj.weight" not in keys
    biased = _keys(attention_bias=True)  # the official q/k/v and o projections all take attention_bias
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= biased
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        _keys(decoder_sparse_step=0)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _keys(num_experts_per_tok=4)
    with pytest.raises(ConfigError, match="hidden_act"):
        _keys(hidden_act="gelu")
    with pytest.raises(ConfigError, match="rope_scaling"):
        _keys(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    # norm_topk_prob reaches every MoE block; the training-only fields round-trip
    config = SDARMoeConfig(norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=0.01)
    assert config.to_dict()["router_aux_loss_coef"] == 0.01 and config.output_router_logits
    with torch.device("meta"):
        m = SDARMoeForCausalLM(SDARMoeConfig(num_hidden_layers=1, num_experts=8, num_experts_per_tok=4,
                                             norm_topk_prob=False, vocab_size=32, hidden_size=16, eos_token_id=0,
                                             bos_token_id=0,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert m.model.layers[0].mlp.norm_topk_prob is False and m.model.layers[0].mlp.top_k == 8 // 2


def test_tiny_checkpoint_loads_strictly_and_through_auto_classes(moe_ckpt: Path, tmp_path: Path) -> None:
    import spiffy  # noqa: F401 - registers the families with the Auto classes
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = json.loads((moe_ckpt / "config.json").read_text())
    assert config["model_type"] == "sdar_moe" and config["architectures"] == ["SDARMoeForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sdar_moe.SDARMoeForCausalLM"
    assert type(AutoConfig.from_pretrained(moe_ckpt)).__name__ == "SDARMoeConfig"
    auto = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    assert type(auto).__name__ == "SDARMoeForCausalLM"
    assert type(AutoModel.from_pretrained(moe_ckpt)).__name__ == "SDARMoeModel"
    model = load_model(moe_ckpt, dtype="float32")
    ids = torch.tensor([[5, 9, 23, 7]])
    torch.testing.assert_close(model(ids).logits, auto(ids).logits, rtol=0, atol=0)
    # strict: a checkpoint missing one expert weight is refused, naming it
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in moe_ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import save_file

    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = next(p for p in sorted(broken.glob("*.safetensors")) if gone in load_file(str(p)))
    tensors = {k: v for k, v in load_file(str(shard)).items() if k != gone}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = broken / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop(gone, None)
        index.write_text(json.dumps(data))
    with pytest.raises(CheckpointKeyError, match="experts.3.up_proj"):
        load_model(broken)


def test_spiffy_bfloat16_equals_the_baseline(moe_ckpt: Path) -> None:
    """bfloat16: the oracle graph's Spiffy run gives the baseline's tokens bitwise (one row, threshold and static)."""
    model = load_model(moe_ckpt, dtype="bfloat16")
    ids = torch.tensor([[11, 40, 7, 99, 3]])
    for kw in (dict(strategy="low_confidence_static"), dict(strategy="low_confidence_dynamic", threshold=0.05)):
        kw = dict(kw, gen_length=16, block_length=8, denoising_steps=4, temperature=1.0, seed=2)
        base = make_session(model, ids, **kw)
        records = record_trajectory(base)
        s = make_session(model, ids, **kw)
        st = speculative_generate(s, oracle_graph_from_records(records, base.mask_id), budget=4)
        assert torch.equal(s.x, base.x) and st.accepted_total > 0


def test_calibrate_and_freedave_on_the_tiny_checkpoint(moe_ckpt: Path, tmp_path: Path) -> None:
    from spiffy.cli.main import main
    from spiffy.decoding.sdar_config import SDARDecodeConfig
    from spiffy.selfspec.graph.core import load_graph

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["def f(x):", "x = 1"])))
    out = tmp_path / "g.json"
    assert main(["calibrate", "--model", str(moe_ckpt), "--prompts", str(prompts), "--out", str(out), "--nodes", "4",
                 "--gen-length", "8", "--block-length", "4", "--no-chat", "--no-progress", "--dtype", "float64"]) == 0
    graph = load_graph(out)
    assert graph.nodes
    model = load_f64(moe_ckpt)
    cfg = SDARDecodeConfig(gen_length=8, block_length=4)  # what the graph was calibrated for
    for seq in ([3, 9, 11, 4], [17, 2, 40]):
        ids = torch.tensor([seq])
        base = generate(model, ids, cfg)
        assert generate(model, ids, cfg, graph=graph, budget=3).tokens == base.tokens
        for depth in (1, 3):  # FreeDave's top-k chain
            chain = chain_graph_for(model, cfg, depth)
            assert generate(model, ids, cfg, graph=chain, budget=depth).tokens == base.tokens


# --------------------------------------------------------------------------------------------------------------
# TraDo-4B / 8B (Gen-Verse): the SDAR architecture, fine-tuned from SDAR-4B-Chat / SDAR-8B-Chat
# --------------------------------------------------------------------------------------------------------------

#: dLLM-RL's TraDo generation settings (configs/trado_eval.yaml and the README's block_diffusion_generate call)
TRADO_OPTIONS = dict(block_length=4, denoising_steps=4, remasking_strategy="low_confidence_dynamic",
                     confidence_threshold=0.9, temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def trado_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDAR checkpoint whose config.json carries every key of SDAR-4B-Chat's real config (the shape keys at
    tiny size): ``block_size``, ``mask_token_id``, ``attn_implementation``, ``fuse_cross_entropy``, ``debug``,
    ``ep_size``, ``micro_forward``, ``skip_checkpoint``, ``use_deepep`` included."""
    path = make_tiny("sdar", tmp_path_factory.mktemp("trado") / "m", seed=4)
    real = json.loads((DATA / "real_configs" / "JetLM--SDAR-4B-Chat.config.json").read_text())
    tiny = json.loads((path / "config.json").read_text())
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_window_layers", "max_position_embeddings", "mask_token_id",
             "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")
    (path / "config.json").write_text(json.dumps({**real, **{k: tiny[k] for k in shape if k in tiny}}))
    return path


def test_trado_config_loads_and_decodes_as_sdar(trado_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(trado_ckpt, dtype="float32")
    assert type(model).__name__ == "SDARForCausalLM" and model.config.block_size == 4
    auto = AutoModelForCausalLM.from_pretrained(trado_ckpt, dtype=torch.float32)
    assert type(auto).__name__ == "SDARForCausalLM"
    ids = torch.tensor([[17, 4, 99, 31, 8, 250]])
    mask = int(model.config.mask_token_id)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        ours = sdar_block_diffusion_generate(model, {"input_ids": ids}, mask, gen_length=16, **TRADO_OPTIONS)
        torch.manual_seed(seed)
        ref, _ = reference_block_diffusion_generate(model, ids, mask, gen_length=16, **TRADO_OPTIONS)
        assert torch.equal(ours, ref)
    # Spiffy under TraDo's options equals the baseline (the dynamic threshold, T = 1 seeded)
    kw = dict(gen_length=16, block_length=4, denoising_steps=4, strategy="low_confidence_dynamic", threshold=0.9,
              temperature=1.0, seed=5)
    m64 = load_f64(trado_ckpt)
    base = make_session(m64, ids, **kw)
    records = record_trajectory(base)
    s = make_session(m64, ids, **kw)
    speculative_generate(s, oracle_graph_from_records(records, base.mask_id), budget=4)
    assert torch.equal(s.x, base.x)

