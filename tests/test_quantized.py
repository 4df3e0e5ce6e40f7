"""Quantized models, exact against their own baseline (float32, CPU, tiny random checkpoints).

Speculation never changes the model: a target quantized on load (torchao int8 / int4 weight-only, bitsandbytes NF4)
decodes with spiffy's AR exactly as transformers' ``generate(do_sample=False)`` on the same quantized model, and every
AR method (DFlash, DDTree, DEER, SpecDiff-2 with quantized DFlash and dLLM drafters) equals that AR; LLaDA, Dream and
SDAR quantized on load decode with Spiffy, FreeDave and SSD exactly as their own baseline; batched rows equal the
prompts alone. A checkpoint saved quantized loads quantized by path and by Hub id (offline cache). What cannot run
is refused with a typed error (FP8 on a CPU, a group that does not divide a layer, bitsandbytes on spiffy's own
classes), never dequantized silently. The full matrix (every method x drafter x temperature x quantization, every
cache mode, bitsandbytes LLM.int8()) is the slow tier's (``test_quantized_matrix.py``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import constants as hf_constants

from hf_cache import add_snapshot
from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.methods import METHODS
from spiffy.bench.common import environment_info
from spiffy.bench.report import markdown_ar
from spiffy.cli import names
from spiffy.cli.main import main
from spiffy.decoding import make_session
from spiffy.errors import QuantizationError
from spiffy.models import load_model, load_target, make_tiny_dflash
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.loading import save_checkpoint
from spiffy.models.quantize import QUANTIZATIONS, parse_quantization, quantization_label, quantize_model, weight_bytes
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory
from spiffy.selfspec.rivals import rival_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

BLOCK = 5
#: the tiny models are 64 wide: int4 in groups of 32 (the default 128 does not divide them: refused, tested below)
INT4 = "int4:32"
PROMPTS = [[5, 17, 42, 8, 99, 100], [7, 3, 250], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> SimpleNamespace:
    """A tiny Qwen3 target (3 layers), a DFlash drafter and an SDAR dLLM drafter for it."""
    root = tmp_path_factory.mktemp("quant_pair")
    target = make_tiny("qwen3", root / "target", seed=1, num_hidden_layers=3)
    return SimpleNamespace(root=root, target=target,
                           dflash=make_tiny_dflash(root / "dflash", target, seed=2, block_size=BLOCK),
                           dllm=make_tiny_dllm_drafter(root / "dllm", target, seed=3, block_size=BLOCK))


def ar_config(method: str, n: int, temperature: float, seed: int = 3, stops: tuple[int, ...] = ()) -> ARSpecConfig:
    return ARSpecConfig(method=method, budget=10, drafts=3, max_new_tokens=n, stop_token_ids=stops,
                        sampling=SamplingConfig(temperature=temperature, top_k=40 if temperature else 0, seed=seed))


def _stops(target) -> tuple[int, ...]:  # noqa: ANN001
    eos = target.generation_config.eos_token_id
    return tuple([eos] if isinstance(eos, int) else list(eos or []))


def check_ar_equals_generate(target) -> None:  # noqa: ANN001
    for prompt in PROMPTS[:2]:
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        ours = speculative_generate(target, None, prompt, ar_config("ar", 12, 0.0, stops=_stops(target)))
        assert ours.tokens == ref


def check_methods_equal_ar(target, pair, quantization, temperature: float, methods=METHODS,  # noqa: ANN001
                           kinds=("dflash", "dllm")) -> None:
    prompt = PROMPTS[0]
    ar = speculative_generate(target, None, prompt, ar_config("ar", 14, temperature))
    for kind in kinds:
        for method in methods:
            drafter = load_ar_drafter(getattr(pair, kind), dtype=torch.float32, quantization=quantization)
            res = speculative_generate(target, as_drafter(drafter), prompt, ar_config(method, 14, temperature))
            assert res.tokens == ar.tokens, (kind, method, temperature)


def test_the_cli_offers_the_library_quantizations() -> None:
    assert names.QUANTIZE_NAMES == tuple(QUANTIZATIONS)


def test_int8_target_and_drafters_equal_ar_and_generate(pair) -> None:
    """torchao int8 weight-only target (every linear layer but the head), quantized drafters (a DFlash drafter reads
    the target's embedding and calls its head): AR == transformers' greedy generate; every method == AR."""
    target = load_target(pair.target, torch.float32, "cpu", quantization="int8")
    assert type(target.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    assert type(target.lm_head.weight) is torch.nn.Parameter  # the head stays as transformers keeps it
    assert quantization_label(target) == "torchao Int8WeightOnlyConfig"
    check_ar_equals_generate(target)
    check_methods_equal_ar(target, pair, "int8", 0.0, kinds=("dflash",))
    check_methods_equal_ar(target, pair, "int8", 1.0, methods=("deer", "specdiff"), kinds=("dllm",))
    drafter = load_ar_drafter(pair.dflash, dtype=torch.float32, quantization="int8")
    assert type(drafter.fc.weight).__name__ == "Int8Tensor" and quantization_label(drafter).startswith("int8")


def test_int4_target_equals_ar_and_generate(pair) -> None:
    target = load_target(pair.target, torch.float32, "cpu", quantization=INT4)
    assert type(target.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    check_ar_equals_generate(target)
    check_methods_equal_ar(target, pair, INT4, 1.0, methods=("ddtree", "dflash"), kinds=("dflash",))


def test_bitsandbytes_nf4_target_equals_generate(pair) -> None:
    """bitsandbytes' CPU backend, through transformers' quantizer (every method == AR: the slow tier)."""
    pytest.importorskip("bitsandbytes")
    target = load_target(pair.target, torch.float32, "cpu", quantization="bnb-nf4")
    assert type(target.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    assert quantization_label(target) == "bitsandbytes nf4"
    check_ar_equals_generate(target)


def test_quantized_batched_rows_equal_prompts_alone(pair) -> None:
    target = load_target(pair.target, torch.float32, "cpu", quantization="int8")
    cfgs = [ar_config("ddtree", 10, 1.0, seed=s) for s in (3, 4, 5)]

    def drafter():  # noqa: ANN202
        return as_drafter(load_ar_drafter(pair.dflash, dtype=torch.float32, quantization="int8"))

    alone = [speculative_generate(target, drafter(), p, c).tokens for p, c in zip(PROMPTS, cfgs)]
    batch = speculative_generate_batch(target, [drafter() for _ in PROMPTS], PROMPTS, cfgs)
    assert [r.tokens for r in batch] == alone


DLLM_KW = {"llada": dict(steps=16), "dream": dict(steps=16), "sdar": dict(denoising_steps=8)}


def check_dllm_methods(model, family: str, cache: str | None = None) -> None:  # noqa: ANN001
    """Spiffy (an oracle graph of the baseline's own trajectory: long accepted runs), FreeDave and SSD == baseline."""
    kw = dict(gen_length=16, block_length=8, **DLLM_KW[family], **({"cache": cache} if cache else {}))
    ids = torch.tensor([[5, 6, 7, 8]])
    base = generate(model, ids, **kw)
    session = make_session(model, ids, **kw)
    graph = oracle_graph_from_records(record_trajectory(session), session.mask_id)
    spiffy = generate(model, ids, graph=graph, budget=len(graph.nodes), **kw)
    assert spiffy.tokens == base.tokens and spiffy.nfe < base.nfe, family
    for rival in ("freedave", "ssd"):
        assert generate(model, ids, graph=rival_graph(model, session.config, rival, 4), **kw).tokens == base.tokens


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_quantized_dllms_decode_as_their_baseline(request, family: str) -> None:
    path = request.getfixturevalue(f"tiny_{family}")
    model = load_model(path, dtype="float32", quantization="int8")
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    assert linears and all(type(m.weight).__name__ == "Int8Tensor" for m in linears)
    assert type(head.weight) is torch.nn.Parameter
    check_dllm_methods(model, family)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_quantized_dllm_batch_rows_equal_alone(request, family: str) -> None:
    model = load_model(request.getfixturevalue(f"tiny_{family}"), dtype="float32", quantization="int8")
    kw = dict(gen_length=16, block_length=8, temperature=1.0, **DLLM_KW[family])
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    session = make_session(model, torch.tensor([prompts[0]]), **kw)
    graph = rival_graph(model, session.config, "freedave", 3)
    batch = generate(model, torch.tensor(prompts), graph=graph, seeds=[1, 2], **kw)
    for row, (prompt, seed) in enumerate(zip(prompts, (1, 2))):
        alone = generate(model, torch.tensor([prompt]), graph=graph, seeds=[seed], **kw)
        assert batch.tokens[row] == alone.tokens[0]


def test_saved_quantized_target_loads_by_path_and_hub_id(pair, tmp_path, monkeypatch, capsys) -> None:
    """``save_pretrained`` of a torchao-int8 target writes its ``quantization_config``; the directory and the same
    files under a Hub id in an offline cache load quantized (``Int8Tensor`` weights) and decode the same tokens."""
    target = load_target(pair.target, torch.float32, "cpu", quantization="int8")
    saved = save_checkpoint(target, tmp_path / "int8")
    assert json.loads((saved / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    expected = speculative_generate(target, None, PROMPTS[0], ar_config("ar", 10, 0.0)).tokens
    home = tmp_path / "hf_home"
    add_snapshot(home / "hub", "Qwen/Qwen3-8B-int8", saved)
    for key, value in (("HF_HOME", str(home)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    for source in (saved, "Qwen/Qwen3-8B-int8"):
        for loaded in (load_model(source, dtype="float32"), load_target(source, torch.float32, "cpu")):
            assert type(loaded.model.layers[1].mlp.gate_proj.weight).__name__ == "Int8Tensor"
            assert speculative_generate(loaded, None, PROMPTS[0], ar_config("ar", 10, 0.0)).tokens == expected
    common = ["--prompt", "a b", "--max-new-tokens", "6", "--no-progress", "--json", "--no-chat", "--dtype", "float32"]
    assert main(["generate", "--target", "Qwen/Qwen3-8B-int8", *common]) == 0  # --target by Hub id
    assert main(["generate", "--target", str(saved), *common]) == 0
    by_id, by_path = (json.loads(line)["tokens"] for line in capsys.readouterr().out.strip().splitlines())
    assert by_id == by_path and by_id
    with pytest.raises(QuantizationError, match="saved quantized"):  # quantizing twice is refused, not stacked
        load_target(saved, torch.float32, "cpu", quantization="int8")


def test_cli_generate_and_bench_quantize(pair, tiny_llada, tmp_path, capsys) -> None:
    common = ["--prompt", "x", "--no-progress", "--json", "--no-chat"]
    assert main(["generate", "--model", str(tiny_llada), "--gen-length", "16", "--block-length", "8", "--steps",
                 "16", "--quantize", "int8", "--graph", "freedave:3", *common]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["nfe"] > 0
    argv = ["generate", "--target", str(pair.target), "--drafter", str(pair.dflash), "--method", "ddtree",
            "--max-new-tokens", "8", "--quantize", "int8", *common]
    assert main(argv) == 0  # ddtree == ar, both on the quantized target
    assert main(["generate", "--target", str(pair.target), "--method", "ar", "--max-new-tokens", "8", "--quantize",
                 "int8", *common]) == 0
    ddtree, ar = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert ddtree["tokens"] == ar["tokens"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b"}\n')
    rc = main(["bench", "ar", "--target", str(pair.target), "--drafter", str(pair.dflash), "--budgets", "4",
               "--dataset", str(prompts), "--max-new-tokens", "6", "--no-chat", "--no-progress", "--quantize",
               "int8", "--methods", "ar,ddtree", "--warmup", "0", "--out", str(tmp_path / "bench")])
    assert rc == 0
    res = json.loads((tmp_path / "bench" / "results.json").read_text())
    env = res["environment"]
    assert env["quantization"] == "torchao Int8WeightOnlyConfig" and env["drafter_quantization"].startswith("int8")
    assert env["peak_memory_bytes"] > env["weight_bytes"] > 0 and res["all_identical"]
    assert "- quantization: torchao Int8WeightOnlyConfig (drafter: int8" in markdown_ar(res)


def test_weight_bytes_count_the_quantized_storage(tiny_sdar) -> None:
    """int8 weights take a quarter of float32's bytes (plus one scale per row), int4 an eighth (plus group scales)."""
    dense = load_model(tiny_sdar, dtype="float32")
    linear = sum(m.weight.numel() for m in dense.modules()
                 if isinstance(m, torch.nn.Linear) and m is not dense.get_output_embeddings())
    full = weight_bytes(dense)
    int8 = weight_bytes(quantize_model(load_model(tiny_sdar, dtype="float32"), "int8"))
    assert full - int8 >= 3 * linear - 4 * 8 * linear // 64  # 4 -> 1 byte per weight, minus per-row fp32 scales
    assert environment_info(dense, "cpu")["quantization"] == "none"


@pytest.mark.parametrize(("value", "match"), [
    ("fp8", "no kernels on cpu"), ("int4:48", "power of two"), ("int3", "is not a quantization"),
    ("int8:32", "only int4"),
])
def test_refusals_that_teach(tiny_qwen3, value: str, match: str) -> None:
    with pytest.raises(QuantizationError, match=match):
        load_target(tiny_qwen3, torch.float32, "cpu", quantization=value)


def test_refusals_on_spiffy_classes(tiny_sdar, tmp_path) -> None:
    with pytest.raises(QuantizationError, match="int4:64"):  # the default group (128) does not divide 64 columns
        load_model(tiny_sdar, dtype="float32", quantization="int4")
    pytest.importorskip("bitsandbytes")
    with pytest.raises(QuantizationError, match="only AR targets"):
        load_model(tiny_sdar, dtype="float32", quantization="bnb-nf4")
    saved = tmp_path / "sdar"
    model = load_model(tiny_sdar, dtype="float32")
    model.config.quantization_config = {"quant_method": "torchao"}
    save_checkpoint(model, saved)
    with pytest.raises(QuantizationError, match="saved quantized"):
        load_model(saved, dtype="float32")
    assert parse_quantization("none") is None


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
], ids=["fp8", "awq", "compressed-fp8"])
def test_checkpoints_whose_kernels_do_not_run_on_a_cpu_are_refused(tiny_qwen3, tmp_path, quantization_config) -> None:
    """Not dequantized silently (transformers turns an FP8 checkpoint into bf16 on a CPU with a warning)."""
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["quantization_config"] = quantization_config
    ckpt = tmp_path / "q"
    ckpt.mkdir()
    for f in tiny_qwen3.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="do not run on cpu.*fix: run it on a CUDA GPU"):
        load_target(ckpt, torch.float32, "cpu")
    with pytest.raises(QuantizationError):
        load_model(ckpt, dtype="float32")
