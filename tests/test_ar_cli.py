"""`spiffy generate --target DIR ...` (AR mode) end to end on tiny checkpoints with a real tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from spiffy.models import make_tiny_dflash
from spiffy.cli.generate_ar import add_ar_arguments, main as ar_main

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
        runs[method] = _json_run(common + extra + ["--method", method, "--budget", "6"], capsys)
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
    b = _json_run(base + ["--method", "ar"], capsys)
    assert a["tokens"] == b["tokens"] and a["temperature"] == 1.0 and a["top_k"] == 20
    # plain text mode prints the decoded text on stdout, statistics on stderr
    from spiffy.cli.main import main

    assert main(base[:-1] + ["--method", "ar"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == b["text"].strip()
    assert "tokens in" in captured.err


def test_cli_errors(tiny_qwen3, drafter_dir, capsys):
    from spiffy.cli.main import main

    assert main(["generate", "--target", str(tiny_qwen3), "--method", "ddtree", "--prompt", "x", "--no-progress"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_qwen3), "--drafter", str(drafter_dir), "--budget", "-2",
                 "--prompt", "x", "--no-progress"]) == 2
    assert "budget" in capsys.readouterr().err
    # the stand-alone entry point adds the shared flags itself
    assert ar_main(["--target", str(tiny_qwen3), "--temperature", "-1", "--max-new-tokens", "2"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_add_ar_arguments_skips_existing_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=3)
    add_ar_arguments(parser, shared=True)
    add_ar_arguments(parser, shared=True)  # idempotent
    args = parser.parse_args(["--target", "t", "--method", "dflash", "--top-p", "0.5"])
    assert args.target == "t" and args.method == "dflash" and args.budget == 3 and args.top_p == 0.5
    assert args.max_new_tokens == 128
