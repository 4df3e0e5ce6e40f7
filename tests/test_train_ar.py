"""Tests of the Qwen3 target trainer (spiffy.train.ar): a few steps of a tiny model on a tiny corpus."""

from __future__ import annotations

import json

import pytest
import torch

from spiffy.train import ar
from spiffy.train.common import TRAIN_STATE, cosine_lr, cosine_lr_progress
from spiffy.train.corpus import build_corpus, load_split
from spiffy.train.tokenizer_train import train_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ar_data")
    info = build_corpus(root / "corpus", max_files=12, heldout_percent=30)
    train_tokenizer(load_split(info.out_dir, "train"), "qwen3", root / "tok", vocab_size=300)
    return root


def _args(data, out, *extra):
    return ar.build_parser().parse_args([
        "--out", str(out), "--corpus", str(data / "corpus"), "--max-files", "12", "--heldout-percent", "30",
        "--tokenizer", str(data / "tok"), "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1",
        "--intermediate", "64", "--context", "32", "--batch-size", "4", "--warmup", "2", "--lr", "1e-2",
        "--eval-windows", "8", "--sample-tokens", "4", "--ckpt-every", "2", "--save-dtype", "float32", *extra])


def _state(out):
    return torch.load(out / TRAIN_STATE, map_location="cpu", weights_only=False)


def test_lr_schedules():
    assert cosine_lr(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert cosine_lr(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert cosine_lr(100, 100, 1.0, 10) == pytest.approx(0.1)
    assert cosine_lr_progress(50, 1.0, 1.0, 10) == pytest.approx(0.1)
    assert cosine_lr_progress(50, 0.0, 1.0, 10) == pytest.approx(1.0)


def test_loss_decreases_and_export_loads(data, tmp_path):
    base = ar.train(_args(data, tmp_path / "r0", "--steps", "0"))
    m = ar.train(_args(data, tmp_path / "r1", "--steps", "30"))
    assert m["steps"] == 30 and m["finished"]
    assert m["heldout_loss"] < base["heldout_loss"] - 0.5
    assert m["heldout_accuracy"] > base["heldout_accuracy"]
    final = tmp_path / "r1" / "model"
    saved = json.loads((final / "metrics.json").read_text())
    assert saved["heldout_loss"] == m["heldout_loss"] and (final / "MODEL_CARD.md").is_file()
    from spiffy.models.loading import load_model, load_tokenizer

    model = load_model(final, dtype="float64")
    tok = load_tokenizer(final)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
    ids = torch.tensor([tok("def f(x):", add_special_tokens=False)["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_resume_reproduces_uninterrupted_run_and_seed_matters(data, tmp_path):
    ar.train(_args(data, tmp_path / "full", "--steps", "6"))
    ar.train(_args(data, tmp_path / "split", "--steps", "6", "--stop-after", "3"))
    assert _state(tmp_path / "split")["step"] == 3
    ar.train(_args(data, tmp_path / "split", "--steps", "6", "--resume"))
    a, b = _state(tmp_path / "full"), _state(tmp_path / "split")
    assert b["step"] == 6 and len(b["extra"]["invocations"]) == 2
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # same seed -> same run (the two above); another seed -> different weights
    ar.train(_args(data, tmp_path / "seed1", "--steps", "3", "--seed", "1"))
    ar.train(_args(data, tmp_path / "seed0", "--steps", "3"))
    c, d = _state(tmp_path / "seed1")["model"], _state(tmp_path / "seed0")["model"]
    assert not all(torch.equal(c[k], d[k]) for k in c)


def test_init_from_continues_a_saved_model(data, tmp_path):
    """--init-from starts from a saved model's weights (a shipped model trained further); a wrong shape is refused."""
    from spiffy.errors import ConfigError

    first = ar.train(_args(data, tmp_path / "a", "--steps", "6"))
    again = ar.train(_args(data, tmp_path / "b", "--steps", "0", "--init-from", str(tmp_path / "a" / "model")))
    assert again["heldout_loss"] == pytest.approx(first["heldout_loss"], abs=1e-6)
    fresh = ar.train(_args(data, tmp_path / "c", "--steps", "0"))
    assert fresh["heldout_loss"] > first["heldout_loss"]
    with pytest.raises(ConfigError, match="--init-from"):
        ar.train(_args(data, tmp_path / "d", "--steps", "0", "--layers", "3", "--init-from", str(tmp_path / "a" / "model")))
