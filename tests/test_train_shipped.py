"""The trained tiny checkpoints shipped in spiffy/data/models load through the library and fit together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import spiffy

MODELS = Path(spiffy.__file__).parent / "data" / "models"
QWEN3 = MODELS / "tiny-qwen3"
DRAFTER = MODELS / "tiny-qwen3-dflash-b16"
LLADA = MODELS / "tiny-llada"
SDAR = MODELS / "tiny-sdar"
SDAR_DRAFTER = MODELS / "tiny-sdar-d2a"
SMALL = MODELS / "small-qwen3"
SMALL_DRAFTER = MODELS / "small-qwen3-dflash-b16"


def _need(path: Path) -> None:
    if not (path / "config.json").is_file():
        pytest.skip(f"{path.name} not shipped in this build")


def test_total_size_within_budget():
    if not MODELS.is_dir():
        pytest.skip("no shipped models")
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    # the demo models (~37 MB) and the wall-clock pair (~27 MB): tens of MB, well under PyPI's 100 MB per file
    assert total <= 70 * 1024 * 1024


def test_every_shipped_model_has_card_and_metrics():
    dirs = [d for d in (QWEN3, DRAFTER, LLADA, SDAR, SDAR_DRAFTER, SMALL, SMALL_DRAFTER) if (d / "config.json").is_file()]
    if not dirs:
        pytest.skip("no shipped models")
    for d in dirs:
        assert (d / "MODEL_CARD.md").read_text().strip()
        metrics = json.loads((d / "metrics.json").read_text())
        assert metrics["steps"] > 0


def test_qwen3_target_and_drafter_load_and_fit():
    _need(QWEN3)
    from spiffy.models.loading import load_model, load_tokenizer

    target = load_model(QWEN3, dtype="float32")
    tok = load_tokenizer(QWEN3)
    assert type(target).__name__ == "Qwen3ForCausalLM" and target.config.vocab_size == len(tok)
    ids = torch.tensor([tok("def f(x):\n    return", add_special_tokens=False)["input_ids"]])
    assert torch.isfinite(target(input_ids=ids).logits).all()
    if (DRAFTER / "config.json").is_file():
        from spiffy.models.dflash import check_compatible, load_drafter

        drafter = load_drafter(DRAFTER, dtype="float32")
        check_compatible(drafter, target)
        assert drafter.block_size == 16
        assert drafter.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")


def test_llada_loads():
    _need(LLADA)
    from spiffy.models.loading import load_model, load_tokenizer

    model = load_model(LLADA, dtype="float32")
    tok = load_tokenizer(LLADA)
    assert type(model).__name__ == "LLaDAModelLM"
    assert model.config.mask_token_id == tok.convert_tokens_to_ids("<|mdm_mask|>")
    x = torch.tensor([tok("import os\n", add_special_tokens=False)["input_ids"] + [model.config.mask_token_id] * 4])
    assert model(input_ids=x).logits.shape[-1] == len(tok)


def test_sdar_loads_and_shares_the_target_tokenizer():
    _need(SDAR)
    from spiffy.models.loading import load_model, load_tokenizer

    model = load_model(SDAR, dtype="float32")
    tok = load_tokenizer(SDAR)
    assert type(model).__name__ == "SDARForCausalLM"
    assert model.config.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    if (QWEN3 / "config.json").is_file():  # same tokenizer as the AR target: it can draft for it
        target_tok = load_tokenizer(QWEN3)
        text = "def f(x):\n    return x + 1\n"
        assert tok(text)["input_ids"] == target_tok(text)["input_ids"] and len(tok) == len(target_tok)
    x = torch.tensor([tok("import os\n", add_special_tokens=False)["input_ids"] + [model.config.mask_token_id] * 4])
    assert model(input_ids=x).logits.shape[-1] == len(tok)


def test_dllm_drafter_is_a_dllm_drafter_of_the_target():
    _need(SDAR_DRAFTER)
    _need(QWEN3)
    from spiffy.models.ar_drafters import drafter_kind, load_ar_drafter
    from spiffy.models.loading import load_tokenizer

    assert drafter_kind(SDAR_DRAFTER) == "dllm"
    drafter = load_ar_drafter(SDAR_DRAFTER, dtype="float32")
    tok, target_tok = load_tokenizer(SDAR_DRAFTER), load_tokenizer(QWEN3)
    text = "def f(x):\n    return x + 1\n"
    assert tok(text)["input_ids"] == target_tok(text)["input_ids"] and len(tok) == len(target_tok)
    assert drafter.config.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    # the card's held-out acceptance is the one measured after D2A stage II
    assert json.loads((SDAR_DRAFTER / "metrics.json").read_text())["recipe"] == "d2a-stage2"


def test_small_pair_target_is_ten_times_its_drafter():
    """The wall-clock pair: the target has at least 10x the drafter's own parameters (the drafter borrows the target's
    embedding and head), so the target's forward dominates a round as it does for real pairs."""
    _need(SMALL)
    _need(SMALL_DRAFTER)
    from spiffy.models.dflash import check_compatible, load_drafter
    from spiffy.models.loading import load_model, load_tokenizer

    target = load_model(SMALL, dtype="float32")
    drafter = load_drafter(SMALL_DRAFTER, dtype="float32")
    check_compatible(drafter, target)
    n_target = sum(p.numel() for p in target.parameters())
    n_drafter = sum(p.numel() for p in drafter.parameters())
    assert n_target >= 10 * n_drafter, (n_target, n_drafter)
    assert load_tokenizer(SMALL).get_vocab() == load_tokenizer(QWEN3).get_vocab()  # the two pairs share token ids
