"""``device_map`` placement through accelerate (spiffy.models.placement), on CPU with disk offload.

Dict device maps that send some layers to disk (accelerate's disk offload: weights written to ``offload_folder`` and
read back at each forward) for the tiny Qwen3 target, its DFlash drafter, a tiny dLLM drafter and tiny SDAR / LLaDA
dLLMs: the loaded tensors equal the plain load exactly, and DDTree / DFlash / AR / DEER and Spiffy outputs equal the
plain-load outputs token for token (float32, T = 0), acceptance included. Also ``"auto"`` with a memory cap, a
tied LM head whose embedding is offloaded, the CLI flag, and the typed errors.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, as_drafter, ddtree_generate, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.cli.main import main as cli_main
from spiffy.cli.placement import parse_device_map, parse_max_memory
from spiffy.decoding import DecodeConfig
from spiffy.errors import ConfigError, MissingDependencyError
from spiffy.models import load_drafter, load_model, load_target, load_tokenizer, make_tiny_dflash, make_tiny_target
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.calibrate import calibrate
from spiffy.torch_utils import execution_device, model_device

pytest.importorskip("accelerate")
pytestmark = pytest.mark.usefixtures("one_thread_per_module")

TARGET_MAP = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
              "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
DFLASH_MAP = {"fc": "disk", "hidden_norm": "cpu", "layers.0": "disk", "layers.1": "cpu", "norm": "disk",
              "rotary_emb": "cpu"}
SDAR_MAP = {"model.embed_tokens": "disk", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
            "lm_head": "disk"}
LLADA_MAP = {"model.transformer.wte": "disk", "model.transformer.blocks.0": "cpu", "model.transformer.blocks.1": "disk",
             "model.transformer.ln_f": "cpu", "model.transformer.ff_out": "disk", "model.rotary_emb": "cpu"}


def offloaded_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the placed model holds it: resident tensors as they are, disk-offloaded ones read back
    through their accelerate hook's weights map."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.is_meta:
            out[name] = param.detach()
            continue
        owner, _, short = name.rpartition(".")
        while owner and getattr(model.get_submodule(owner), "_hf_hook", None) is None:
            owner, _, last = owner.rpartition(".")
            short = f"{last}.{short}" if short else last
        hook = model.get_submodule(owner)._hf_hook
        out[name] = hook.weights_map[short]
    return out


def assert_same_weights(plain: torch.nn.Module, placed: torch.nn.Module) -> None:
    ref = dict(plain.named_parameters())
    got = offloaded_tensors(placed)
    assert sorted(got) == sorted(ref)
    assert any(p.is_meta for p in placed.parameters()), "nothing was offloaded: the test would prove nothing"
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].to("cpu"), tensor.detach()), name


@pytest.fixture(scope="module")
def ar_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement_ar")
    target = make_tiny_target(root / "target", seed=3, num_layers=3)
    dflash = make_tiny_dflash(root / "dflash", target, seed=4, num_layers=2, block_size=8)
    dllm = make_tiny_dllm_drafter(root / "dllm", target, seed=1, block_size=6)
    return {"target": target, "dflash": dflash, "dllm": dllm, "root": root}


@pytest.fixture(scope="module")
def ar_models(ar_paths, tmp_path_factory):
    off = tmp_path_factory.mktemp("offload")
    plain = {
        "target": load_target(ar_paths["target"], torch.float32, "cpu"),
        "dflash": load_drafter(ar_paths["dflash"], dtype=torch.float32),
        "dllm": load_ar_drafter(ar_paths["dllm"], dtype=torch.float32),
    }
    placed = {
        "target": load_target(ar_paths["target"], torch.float32, device_map=TARGET_MAP, offload_folder=off / "t"),
        "dflash": load_drafter(ar_paths["dflash"], dtype=torch.float32, device_map=DFLASH_MAP,
                               offload_folder=off / "d"),
        "dllm": load_ar_drafter(ar_paths["dllm"], dtype=torch.float32, device_map=SDAR_MAP, offload_folder=off / "s"),
    }
    return plain, placed


@pytest.mark.parametrize("kind", ["target", "dflash", "dllm"])
def test_placed_ar_models_hold_the_plain_tensors(ar_models, kind):
    plain, placed = ar_models
    assert placed[kind].hf_device_map  # placed by accelerate, with disk entries
    assert "disk" in placed[kind].hf_device_map.values()
    assert_same_weights(plain[kind], placed[kind])


def test_execution_device_sees_through_offload(ar_models):
    _, placed = ar_models
    target = placed["target"]
    assert target.get_input_embeddings().weight.is_meta  # offloaded: the weight itself says nothing
    assert execution_device(target.get_input_embeddings()) == torch.device("cpu")
    assert model_device(target) == torch.device("cpu")
    assert placed["dflash"].device == torch.device("cpu")
    assert execution_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert execution_device(object()) == torch.device("cpu")


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_dflash_methods_equal_plain_load(ar_models, method):
    plain, placed = ar_models
    prompt = torch.randint(0, 250, (6,), generator=torch.Generator().manual_seed(11)).tolist()
    ref = ddtree_generate(plain["target"], plain["dflash"], prompt, method=method, budget=16, max_new_tokens=20)
    got = ddtree_generate(placed["target"], placed["dflash"], prompt, method=method, budget=16, max_new_tokens=20)
    assert got.tokens == ref.tokens
    assert got.acceptance_lengths == ref.acceptance_lengths


@pytest.mark.parametrize("method", ["deer", "ddtree"])
def test_dllm_drafter_methods_equal_plain_load(ar_models, method):
    plain, placed = ar_models
    prompt = [5, 9, 17, 33]
    cfg = ARSpecConfig(method=method, budget=12, max_new_tokens=14)
    ref = speculative_generate(plain["target"], as_drafter(plain["dllm"]), prompt, cfg)
    got = speculative_generate(placed["target"], as_drafter(placed["dllm"]), prompt, cfg)
    assert got.tokens == ref.tokens
    assert got.acceptance_lengths == ref.acceptance_lengths


@pytest.mark.parametrize("family,device_map", [("sdar", SDAR_MAP),
                                               pytest.param("llada", LLADA_MAP, marks=pytest.mark.slow)])
def test_dllm_placed_spiffy_equals_plain(family, device_map, request, tmp_path):
    path = request.getfixturevalue(f"tiny_{family}")
    plain = load_model(path, dtype="float32")
    placed = load_model(path, dtype="float32", device_map=device_map, offload_folder=tmp_path)
    assert_same_weights(plain, placed)
    assert placed.name_or_path == plain.name_or_path
    tok = load_tokenizer(path)
    cfg = DecodeConfig(gen_length=8, block_length=4, cache="prefix")
    graph = calibrate(plain, tok, ["def f(x):", "import os"], cfg, nodes=3, chat=False, progress=False)
    prompt = torch.tensor([tok.encode("class A:")])
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(placed(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    base = generate(plain, prompt, cfg, tokenizer=tok)
    for g in (None, graph):
        ref = generate(plain, prompt, cfg, tokenizer=tok, graph=g, budget=3 if g is not None else None)
        out = generate(placed, prompt, cfg, tokenizer=tok, graph=g, budget=3 if g is not None else None)
        assert out.tokens == ref.tokens == base.tokens
        assert out.nfe == ref.nfe


def test_tied_head_with_offloaded_embedding(tmp_path):
    path = make_tiny("sdar", tmp_path / "tied", seed=5, tie_word_embeddings=True)
    plain = load_model(path, dtype="float32")
    assert "lm_head.weight" not in dict(plain.named_parameters())
    dm = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu"}
    placed = load_model(path, dtype="float32", device_map=dm, offload_folder=tmp_path / "off")
    assert placed.get_input_embeddings().weight.is_meta
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(placed(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_auto_map_with_a_memory_cap_offloads_and_decodes_the_same(tiny_sdar, tmp_path):
    plain = load_model(tiny_sdar, dtype="float32")
    total = sum(p.numel() * p.element_size() for p in plain.parameters())
    placed = load_model(tiny_sdar, dtype="float32", device_map="auto", max_memory={"cpu": int(0.55 * total)},
                        offload_folder=tmp_path)
    assert "disk" in placed.hf_device_map.values() and "cpu" in placed.hf_device_map.values()
    assert_same_weights(plain, placed)
    tok = load_tokenizer(tiny_sdar)
    cfg = DecodeConfig(gen_length=8, block_length=4, cache="prefix")
    prompt = torch.tensor([tok.encode("def g(y):")])
    assert generate(placed, prompt, cfg, tokenizer=tok).tokens == generate(plain, prompt, cfg, tokenizer=tok).tokens


def test_single_device_map_is_a_plain_load(tiny_sdar):
    model = load_model(tiny_sdar, dtype="float32", device_map="cpu")
    assert getattr(model, "hf_device_map", None) is None
    assert not any(p.is_meta for p in model.parameters())


def test_bad_device_maps_raise_config_errors(tiny_sdar, ar_paths):
    with pytest.raises(ConfigError, match="does not have"):
        load_model(tiny_sdar, dtype="float32", device_map={"model.nothing": "cpu", "": "cpu"})
    with pytest.raises(ConfigError, match="unplaced"):
        load_model(tiny_sdar, dtype="float32", device_map={"model.layers.0": "cpu"})
    with pytest.raises(ConfigError, match="neither a device"):
        load_model(tiny_sdar, dtype="float32", device_map="everywhere")
    with pytest.raises(ConfigError, match="disk"):
        load_model(tiny_sdar, dtype="float32", device_map="disk")
    with pytest.raises(ConfigError, match="nothing but disk"):
        load_model(tiny_sdar, dtype="float32", device_map="auto", max_memory={"cpu": 1000})
    with pytest.raises(ConfigError, match="cannot verify draft trees"):
        load_target(ar_paths["target"], torch.float32, "cpu", attn_implementation="flash_attention_2")


def test_missing_accelerate_is_a_typed_error(tiny_sdar, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    with pytest.raises(MissingDependencyError, match=r"spiffy-decoding\[placement\]"):
        load_model(tiny_sdar, dtype="float32", device_map={"": "cpu", "model.layers.1": "disk"})
    assert load_model(tiny_sdar, dtype="float32", device_map="cpu") is not None  # one device needs no accelerate


def test_cli_flag_parsing(tmp_path):
    assert parse_device_map(None) is None
    assert parse_device_map("auto") == "auto" and parse_device_map("0") == 0
    assert parse_device_map('{"": "cpu"}') == {"": "cpu"}
    f = tmp_path / "map.json"
    f.write_text(json.dumps(SDAR_MAP))
    assert parse_device_map(str(f)) == SDAR_MAP
    with pytest.raises(ConfigError):
        parse_device_map("{not json")
    assert parse_max_memory("0=20GiB,cpu=64GiB") == {0: "20GiB", "cpu": "64GiB"}
    with pytest.raises(ConfigError):
        parse_max_memory("cpu")


def test_cli_generate_with_device_map(ar_paths, tmp_path, capsys):
    common = ["generate", "--target", str(ar_paths["target"]), "--drafter", str(ar_paths["dflash"]), "--prompt",
              "hello world", "--max-new-tokens", "12", "--json", "--no-progress"]
    assert cli_main(common) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_main(common + ["--device-map", json.dumps(TARGET_MAP), "--offload-folder", str(tmp_path)]) == 0
    placed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert placed["tokens"] == plain["tokens"] and len(plain["tokens"]) > 0
    assert cli_main(["generate", "--model", str(ar_paths["dllm"]), "--prompt", "x", "--offload-folder", "d"]) == 2


def test_cli_generate_dllm_with_device_map(tiny_sdar, tmp_path, capsys):
    common = ["generate", "--model", str(tiny_sdar), "--prompt", "def f(x):", "--gen-length", "8", "--block-length",
              "4", "--dtype", "float32", "--json", "--no-progress"]
    assert cli_main(common) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_main(common + ["--device-map", json.dumps(SDAR_MAP), "--offload-folder", str(tmp_path)]) == 0
    placed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert placed["tokens"] == plain["tokens"] and placed["nfe"] == plain["nfe"]


def test_cli_bench_ar_with_device_map(ar_paths, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n")
    common = ["bench", "ar", "--target", str(ar_paths["target"]), "--drafter", str(ar_paths["dflash"]), "--budgets",
              "4", "--dataset", str(prompts), "--max-prompts", "1", "--max-new-tokens", "8", "--warmup", "0",
              "--dtype", "float32", "--no-chat", "--no-progress", "--no-plots"]
    assert cli_main(common + ["--out", str(tmp_path / "plain")]) == 0
    assert cli_main(common + ["--out", str(tmp_path / "placed"), "--device-map", json.dumps(TARGET_MAP),
                              "--offload-folder", str(tmp_path / "off")]) == 0
    plain, placed = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("plain", "placed"))
    assert placed["all_identical"] is True
    for a, b in zip(plain["methods"], placed["methods"]):
        assert (a["name"], a["tokens_total"], a["tau_per_response"]) == (b["name"], b["tokens_total"],
                                                                        b["tau_per_response"])


def test_batched_ragged_ddtree_equals_plain_load(ar_models):
    plain, placed = ar_models
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    cfg = ARSpecConfig(method="ddtree", budget=10, max_new_tokens=10)
    ref = speculative_generate_batch(plain["target"], [as_drafter(plain["dflash"]) for _ in prompts], prompts, cfg)
    got = speculative_generate_batch(placed["target"], [as_drafter(placed["dflash"]) for _ in prompts], prompts, cfg)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]
