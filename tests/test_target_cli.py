"""The command line over every target architecture: ``spiffy tiny ARCH``, ``spiffy tiny dflash --target``,
``spiffy generate --target T --drafter D --method ar|dflash|ddtree`` (transformers' greedy tokens, float32; the hybrids
Qwen3.5 and Qwen3-Next included) and a two-step ``spiffy train-drafter`` for each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spiffy.cli.main import main
from spiffy.models.prompting import prompt_token_ids
from spiffy.train.corpus import build_corpus

torch.set_num_threads(1)

ARCHS = ("qwen3_moe", "qwen2", "llama", "mistral", "qwen3_5", "qwen3_next")
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """``{arch: (target dir, drafter dir)}`` written by the CLI."""
    root = tmp_path_factory.mktemp("target_cli")
    out = {}
    for arch in ARCHS:
        target, drafter = root / arch, root / f"{arch}-dflash"
        assert main(["tiny", arch, str(target), "--seed", "1"]) == 0
        assert main(["tiny", "dflash", str(drafter), "--target", str(target), "--seed", "2"]) == 0
        out[arch] = (target, drafter)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_returns_transformers_greedy_tokens(checkpoints, arch, capsys):
    target, drafter = checkpoints[arch]
    config = json.loads((drafter / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] < json.loads((target / "config.json").read_text())["vocab_size"]
    capsys.readouterr()
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    assert type(model).__name__.lower().replace("_", "").startswith(arch.replace("_", ""))  # transformers' own class
    ids = prompt_token_ids(AutoTokenizer.from_pretrained(str(target)), PROMPT, chat=False)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    for method in ("ar", "dflash", "ddtree"):
        pair = ["--target", str(target)] + ([] if method == "ar" else ["--drafter", str(drafter)])  # ar takes none
        assert main(["generate", *pair, "--method", method, "--prompt",
                     PROMPT, "--max-new-tokens", "20", "--dtype", "float32", "--no-chat", "--json", "--no-progress"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["tokens"] == ref, method


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("target_cli_corpus")
    build_corpus(root / "corpus", max_files=8, heldout_percent=30)
    return root / "corpus"


@pytest.mark.parametrize("arch", ARCHS)
def test_train_drafter_for_every_architecture(checkpoints, corpus, arch, tmp_path):
    from spiffy.models import load_drafter, load_target
    from spiffy.models.dflash import check_compatible

    target, _ = checkpoints[arch]
    out = tmp_path / "run"
    assert main(["train-drafter", "--target", str(target), "--out", str(out), "--corpus", str(corpus), "--max-files",
                 "8", "--heldout-percent", "30", "--block-size", "4", "--seq-len", "20", "--prompt-len", "6",
                 "--batch-size", "1", "--steps", "2", "--eval-batches", "1"]) == 0
    drafter = load_drafter(out / "model", dtype=torch.float32)
    check_compatible(drafter, load_target(target, torch.float32, "cpu"))
