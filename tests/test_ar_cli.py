"""`spiffy generate --target DIR ...` (AR mode) end to end on tiny checkpoints with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spiffy.models import make_tiny_dflash

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def drafter_dir(tiny_qwen3: Path, tmp_path_factory) -> Path:
    return make_tiny_dflash(tmp_path_factory.mktemp("ar_cli") / "drafter", tiny_qwen3, seed=1, block_size=4)


def _json_run(argv: list[str], capsys) -> dict:
    from spiffy.cli.main import main

    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_generate_json_all_methods_agree(tiny_qwen3, drafter_dir, capsys):
    common = ["generate", "--target", str(tiny_qwen3), "--prompt", "def f(x):", "--max-new-tokens", "9", "--json",
              "--dtype", "float64", "--no-progress"]
    runs = {}
    for method in ("ar", "dflash", "ddtree"):
        extra = [] if method == "ar" else ["--drafter", str(drafter_dir)]
        budget = ["--tree-budget", "6"] if method == "ddtree" else []
        runs[method] = _json_run(common + extra + ["--method", method] + budget, capsys)
    for payload in runs.values():
        assert {"tokens", "text", "rounds", "tau", "seconds", "acceptance_lengths", "stage_times"} <= set(payload)
        assert payload["tokens"] == runs["ar"]["tokens"]
        assert isinstance(payload["text"], str)
        assert 1 <= len(payload["tokens"]) <= 9
    assert runs["ar"]["method"] == "ar" and runs["ddtree"]["budget"] == 6


def test_generate_sampling_chat_and_text_output(tiny_qwen3, drafter_dir, capsys):
    base = ["generate", "--target", str(tiny_qwen3), "--drafter", str(drafter_dir), "--prompt", "hello", "--chat",
            "--max-new-tokens", "7", "--temperature", "1.0", "--top-k", "20", "--seed", "3", "--dtype", "float64",
            "--no-progress", "--json"]
    a = _json_run(base + ["--method", "ddtree"], capsys)
    plain = [f for f in base if f != str(drafter_dir) and f != "--drafter"]  # plain AR takes no drafter
    b = _json_run(plain + ["--method", "ar"], capsys)
    assert a["tokens"] == b["tokens"] and a["temperature"] == 1.0 and a["top_k"] == 20
    # plain text mode prints the decoded text on stdout, statistics on stderr
    from spiffy.cli.main import main

    assert main(plain[:-1] + ["--method", "ar"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == b["text"].strip()
    assert "tokens in" in captured.err


def test_cli_errors(tiny_qwen3, drafter_dir, capsys):
    from spiffy.cli.main import main

    assert main(["generate", "--target", str(tiny_qwen3), "--method", "ddtree", "--prompt", "x", "--no-progress"]) == 2
    assert "--drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a negative tree budget is no budget (exit 2, usage on stderr)
        main(["generate", "--target", str(tiny_qwen3), "--drafter", str(drafter_dir), "--tree-budget", "-2",
              "--prompt", "x", "--no-progress"])
    assert "--tree-budget must be >= 0" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_qwen3), "--temperature", "-1", "--max-new-tokens", "2",
                 "--prompt", "x", "--no-progress"]) == 2
    assert "temperature" in capsys.readouterr().err
