"""``spiffy bench dllm|ar --batch-sizes``: one run, every method at every batch size, identical outputs across sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spiffy.bench.throughput import parse_batch_sizes
from spiffy.cli.main import main
from spiffy.errors import ConfigError

torch.set_num_threads(1)
GEN = ["--gen-length", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp_prompts") / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"prompt": "for i in range(3):"}, {"prompt": "x = 1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def llada_graph(tiny_llada: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spiffy.decoding import DecodeConfig
    from spiffy.models import load_model, load_tokenizer
    from spiffy.selfspec.calibrate import calibrate

    model = load_model(tiny_llada, dtype="float64")
    graph = calibrate(model, load_tokenizer(tiny_llada), ["def f(x):", "import os", "class A:"],
                      DecodeConfig(gen_length=8, block_length=4), nodes=4, chat=False, progress=False)
    path = tmp_path_factory.mktemp("tp_graph") / "graph.json"
    graph.save(path)
    return path


def _check(out: Path, methods: list[str], sizes: list[int], prompts: int) -> dict:
    res = json.loads((out / "throughput.json").read_text())
    assert [(r["method"], r["batch_size"]) for r in res["rows"]] == [(m, b) for m in methods for b in sizes]
    plain = res["rows"][0]["method"]
    for r in res["rows"]:
        assert r["prompts"] == prompts and r["tokens"] > 0 and r["tokens_per_second"] > 0
        assert r["latency_per_token_ms"] > 0 and r["speedup"] is not None
        assert len(r["call_seconds"]) == -(-prompts // r["batch_size"])
        # the speedup's interval over the calls: none against itself or from a single call
        iv = r["speedup_interval"]
        if r["method"] == plain or len(r["call_seconds"]) < 2:
            assert iv is None
        else:
            assert iv["low"] <= r["speedup"] * (1 + 1e-12) and r["speedup"] <= iv["high"] * (1 + 1e-12)
    md = (out / "throughput.md").read_text()
    assert "| method | batch | tokens/s |" in md and md.count("\n|") == 2 + len(res["rows"])
    return res


def test_dllm_throughput(tiny_llada: Path, llada_graph: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "dllm"
    rc = main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(llada_graph), "--budgets", "3",
               "--dataset", str(prompt_file), "--max-prompts", "3", *GEN, "--dtype", "float64", "--no-chat",
               "--no-progress", "--warmup", "0", "--batch-sizes", "1,2,4", "--out", str(out)])
    assert rc == 0
    res = _check(out, ["baseline", "Spiffy D*=3"], [1, 2, 4], 4)  # 3 prompts cycled up to the largest batch
    spiffy = [r for r in res["rows"] if r["method"] == "Spiffy D*=3"]
    assert all(r["identical_to_batch_1"] == 1.0 for r in spiffy)
    base = {r["batch_size"]: r for r in res["rows"] if r["method"] == "baseline"}
    assert base[1]["forwards"] == 4 * base[4]["forwards"]  # one forward per step serves the whole batch
    assert spiffy[0]["forwards"] < base[1]["forwards"]


def test_ar_throughput(tiny_qwen3: Path, prompt_file: Path, tmp_path: Path) -> None:
    from spiffy.models.tiny import make_tiny

    drafter = make_tiny("dflash", tmp_path / "drafter", seed=0, target=str(tiny_qwen3), block_size=4)
    out = tmp_path / "ar"
    rc = main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--budgets", "6",
               "--dataset", str(prompt_file), "--max-prompts", "2", "--max-new-tokens", "6", "--dtype", "float64",
               "--no-chat", "--no-progress", "--warmup", "0", "--batch-sizes", "1,2", "--out", str(out)])
    assert rc == 0
    res = _check(out, ["AR", "DFlash", "DDTree 6"], [1, 2], 2)
    assert all(r["identical_to_batch_1"] == 1.0 for r in res["rows"])


def test_ar_throughput_with_a_diffusion_drafter(tiny_qwen3: Path, prompt_file: Path, tmp_path: Path) -> None:
    from spiffy.models.tiny import make_tiny

    drafter = make_tiny("dflash", tmp_path / "drafter", seed=0, target=str(tiny_qwen3), block_size=4)
    dllm = tmp_path / "dllm"
    assert main(["tiny", "dllm-drafter", str(dllm), "--target", str(tiny_qwen3), "--set", "block_size=4"]) == 0
    out = tmp_path / "ar"
    rc = main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--dllm-drafter", str(dllm),
               "--budgets", "6", "--drafts", "3", "--dataset", str(prompt_file), "--max-prompts", "3",
               "--max-new-tokens", "6", "--dtype", "float64", "--temperature", "1", "--no-chat", "--no-progress",
               "--warmup", "0", "--batch-sizes", "1,3", "--out", str(out)])
    assert rc == 0
    res = _check(out, ["AR", "DFlash", "DDTree 6", "DEER", "SpecDiff-2 K=3", "DDTree 6 (dLLM)"], [1, 3], 3)
    # T = 1: every row keeps its seeded draws whatever the batch, so batch 3 repeats batch 1 token for token
    assert all(r["identical_to_batch_1"] == 1.0 for r in res["rows"]), res["rows"]


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("1,4,16") == [1, 4, 16] and parse_batch_sizes([2]) == [2]
    for bad in ("", "0", "a,b"):
        with pytest.raises(ConfigError, match="batch-sizes"):
            parse_batch_sizes(bad)
    rc = main(["bench", "ar", "--batch-size", "2", "--batch-sizes", "1,2", "--out", "unused"])
    assert rc == 2  # both flags: a clear error, nothing measured
