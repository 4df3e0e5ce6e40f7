"""`spiffy generate --prompt A --prompt B ...`: one batch, one JSON object per prompt in order, each equal to the prompt
decoded alone (dLLM with a graph: batched Spiffy; AR mode: batched DDTree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spiffy.cli.main import main
from spiffy.models import make_tiny_dflash

torch.set_num_threads(1)
PROMPTS = ["def f(x):", "import os", "x = [1, 2, 3]"]


def _rows(argv: list[str], capsys) -> list[dict]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_dllm_batch_prompts_match_alone(capsys, tiny_llada: Path, tmp_path: Path):
    from conftest import load_f64
    from spiffy.decoding import DecodeConfig
    from spiffy.models import load_tokenizer
    from spiffy.selfspec.calibrate import calibrate

    model, tok = load_f64(tiny_llada, cached=True), load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=8, block_length=8, steps=8, temperature=1.0, seed=3)
    graph = calibrate(model, tok, PROMPTS, cfg, nodes=4, progress=False, chat=False)
    path = tmp_path / "graph.json"
    graph.save(path)
    common = ["generate", "--model", str(tiny_llada), "--gen-length", "8", "--block-length", "8", "--steps", "8",
              "--temperature", "1.0", "--seed", "3", "--dtype", "float64", "--json", "--no-progress"]
    tokens = []
    for extra in ([], ["--graph", str(path), "--budget", "3"], ["--graph", str(path), "--budget", "3", "--score", "reach"]):
        alone = [_rows(common + extra + ["--prompt", p], capsys)[0] for p in PROMPTS]
        tokens.append([a["tokens"] for a in alone])
        if extra:  # the score that pruned (the graph records none: gm unless --score)
            assert {a["stats"]["score"] for a in alone} == {"reach" if "--score" in extra else "gm"}
        batched = _rows(common + extra + [a for p in PROMPTS for a in ("--prompt", p)], capsys)
        assert len(batched) == len(PROMPTS)
        assert [b["prompt_tokens"] for b in batched] == [a["prompt_tokens"] for a in alone]
        if extra:  # batched Spiffy: every row equals the prompt decoded alone, at T > 0 too
            assert [b["tokens"] for b in batched] == [a["tokens"] for a in alone]
            assert [b["nfe"] for b in batched] == [a["nfe"] for a in alone]
            assert all(b["batch_size"] == 3 and b["batch_nfe"] < sum(a["nfe"] for a in alone) for b in batched)
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]  # Spiffy under either pruning score = the baseline
    with pytest.raises(SystemExit):  # argparse names the choices
        main(common + ["--graph", str(path), "--score", "nope", "--prompt", PROMPTS[0]])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def drafter_dir(tiny_qwen3: Path, tmp_path_factory) -> Path:
    return make_tiny_dflash(tmp_path_factory.mktemp("cli_batch") / "drafter", tiny_qwen3, seed=1, block_size=4)


def test_ar_batch_prompts_match_alone(capsys, tiny_qwen3: Path, drafter_dir: Path):
    common = ["generate", "--target", str(tiny_qwen3), "--drafter", str(drafter_dir), "--method", "ddtree",
              "--max-new-tokens", "7", "--temperature", "1.0", "--seed", "5", "--dtype", "float64", "--json",
              "--no-progress"]
    alone = [_rows(common + ["--prompt", p], capsys)[0] for p in PROMPTS]
    batched = _rows(common + [a for p in PROMPTS for a in ("--prompt", p)], capsys)
    assert [b["tokens"] for b in batched] == [a["tokens"] for a in alone]
    assert [b["prompt"] for b in batched] == PROMPTS
