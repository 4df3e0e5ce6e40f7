"""The command line of dLLM drafters: `spiffy tiny dllm-drafter`, `spiffy generate --method deer|specdiff|ddtree
--drafts K --accept coupled|rejection --json`, and the embedded fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spiffy.cli.main import main
from spiffy.embedded import is_embedded_available

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dllm_dir(tiny_qwen3: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arspec_cli") / "dllm"
    assert main(["tiny", "dllm-drafter", str(out), "--target", str(tiny_qwen3), "--seed", "3",
                 "--set", "block_size=5"]) == 0
    return out


def _json_run(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_tiny_dllm_drafter_command(dllm_dir, tiny_qwen3, capsys):
    cfg = json.loads((dllm_dir / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["drafter_config"] == {
        "kind": "dllm", "block_size": 5, "mask_token_id": cfg["mask_token_id"]}
    assert cfg["vocab_size"] == json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    assert main(["tiny", "dllm-drafter", str(dllm_dir.parent / "x")]) == 2  # --target is required
    assert "needs --target" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_generate_every_method_and_rule(tiny_qwen3, dllm_dir, capsys, temperature):
    common = ["generate", "--target", str(tiny_qwen3), "--prompt", "def f(x):", "--max-new-tokens", "12", "--json",
              "--dtype", "float64", "--no-progress", "--temperature", temperature, "--seed", "5"]
    ar = _json_run(common + ["--method", "ar"], capsys)
    for method in ("deer", "specdiff", "ddtree"):
        for accept in ("coupled", "rejection"):
            out = _json_run(common + ["--drafter", str(dllm_dir), "--method", method, "--drafts", "3",
                                      "--accept", accept], capsys)
            assert {"tokens", "tau", "accept", "drafts"} <= set(out) and out["accept"] == accept
            assert out["method"] == method and out["tau"] >= 1.0 and len(out["tokens"]) == 12
            if accept == "coupled" or temperature == "0":
                assert out["tokens"] == ar["tokens"], (method, accept)


def test_generate_bad_flags(tiny_qwen3, dllm_dir, capsys):
    base = ["generate", "--target", str(tiny_qwen3), "--prompt", "x", "--no-progress"]
    assert main(base + ["--method", "specdiff"]) == 2
    assert "needs --drafter" in capsys.readouterr().err
    assert main(base + ["--drafter", str(dllm_dir), "--method", "specdiff", "--drafts", "-1"]) == 2
    assert "drafts" in capsys.readouterr().err
    assert main(base + ["--drafter", str(tiny_qwen3), "--method", "deer"]) == 2
    assert "not a drafter" in capsys.readouterr().err


def test_deer_without_paths_uses_the_embedded_models(capsys):
    argv = ["generate", "--method", "deer", "--prompt", "def f(x):", "--max-new-tokens", "6", "--json", "--no-progress"]
    if is_embedded_available("ar-dllm-drafter"):
        out = _json_run(argv, capsys)
        assert out["drafter"].endswith("tiny-sdar") and len(out["tokens"]) == 6
    else:
        assert main(argv) == 2
        assert "ar-dllm-drafter" in capsys.readouterr().err
