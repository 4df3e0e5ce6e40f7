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
        "kind": "dllm", "block_size": 5, "mask_token_id": cfg["mask_token_id"], "layout": "root"}
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
            drafts = ["--drafts", "3"] if method == "specdiff" else []  # the SpecDiff-2 draft count
            out = _json_run(common + ["--drafter", str(dllm_dir), "--method", method, *drafts,
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
        assert out["drafter"].endswith("tiny-sdar-d2a") and len(out["tokens"]) == 6
    else:
        assert main(argv) == 2
        assert "ar-dllm-drafter" in capsys.readouterr().err


def test_bench_ar_every_method_and_rule(tiny_qwen3, dllm_dir, tmp_path):
    from spiffy.models import make_tiny_dflash

    dflash = make_tiny_dflash(tmp_path / "dflash", tiny_qwen3, seed=1, block_size=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(["def f(x):", "a = 1"])))
    out = tmp_path / "bench"
    rc = main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(dflash), "--dllm-drafter", str(dllm_dir),
               "--budgets", "4", "--drafts", "1,3", "--accept", "coupled,rejection", "--temperature", "1",
               "--dataset", str(prompts), "--max-prompts", "2", "--max-new-tokens", "8", "--dtype", "float64",
               "--no-chat", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in res["methods"]]
    base = ["dflash", "ddtree@4", "ddtree-dllm@4", "deer", "specdiff@K1", "specdiff@K3"]
    assert names == ["ar"] + base + [f"{n}/rejection" for n in base]
    for m in res["methods"]:
        assert m["nfe_total"] == m["rounds_total"] + 2  # one prefill per prompt
        assert m["nfe_per_token"] == pytest.approx(m["nfe_total"] / m["tokens_total"])
        assert m["speedup_vs_ar"] is not None and m["tau"] >= 1.0
        if m["accept"] == "coupled":
            assert m["identical_expected"] and m["identical_fraction"] == 1.0, m["name"]
        else:
            assert not m["identical_expected"] and m["mismatches"] == []
    assert res["all_identical"] is True
    md = (out / "results.md").read_text()
    assert "| specdiff |" in md and "rejection" in md and "in distribution" in md
