"""Tests of the LLaDA masked-diffusion trainer (spiffy.train.dllm): objective, a few steps, resume, export."""

from __future__ import annotations

import pytest
import torch

from spiffy.train import dllm
from spiffy.train.common import TRAIN_STATE, step_generator
from spiffy.train.corpus import build_corpus, load_split
from spiffy.train.tokenizer_train import train_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dllm_data")
    info = build_corpus(root / "corpus", max_files=12, heldout_percent=30)
    train_tokenizer(load_split(info.out_dir, "train"), "llada", root / "tok", vocab_size=300)
    return root


def _args(data, out, *extra):
    return dllm.build_parser().parse_args([
        "--out", str(out), "--corpus", str(data / "corpus"), "--max-files", "12", "--heldout-percent", "30",
        "--tokenizer", str(data / "tok"), "--hidden", "32", "--layers", "2", "--heads", "2", "--mlp", "64",
        "--context", "32", "--batch-size", "4", "--warmup", "2", "--lr", "1e-2", "--eval-windows", "8",
        "--sample-tokens", "4", "--ckpt-every", "2", "--save-dtype", "float32", *extra])


def test_noise_batch_objective():
    x0 = torch.arange(1, 1 + 8 * 64).view(8, 64)
    xt, masked, w = dllm.noise_batch(x0, mask_id=0, gen=step_generator(0, 0), prompt_frac=0.5)
    assert torch.equal(xt == 0, masked)
    assert torch.equal(xt[~masked], x0[~masked])
    assert bool((w[~masked] == 0).all() and (w[masked] > 0).all())
    # pretraining rows: weight = 1 / (p * L) is constant within a row; the expected weight sum is 1 per row
    xt2, m2, w2 = dllm.noise_batch(x0.repeat(64, 1), 0, step_generator(0, 1), eps=1e-3, prompt_frac=0.0)
    for r in range(4):
        vals = w2[r][m2[r]]
        if vals.numel():
            assert torch.allclose(vals, vals[0].expand_as(vals))
    assert w2.sum(1).mean().item() == pytest.approx(1.0, abs=0.15)
    # "mean" weighting: every masked token weighs the same, weights sum to the batch size
    _, m4, w4 = dllm.noise_batch(x0, 0, step_generator(0, 3), weighting="mean")
    assert torch.allclose(w4[m4], w4[m4][0].expand_as(w4[m4])) and w4.sum().item() == pytest.approx(8.0)
    # prompt-conditioned rows keep a clean prefix
    xt3, m3, _ = dllm.noise_batch(x0, 0, step_generator(0, 2), prompt_frac=1.0)
    assert all(not bool(m3[r, 0]) for r in range(8))
    first_masked = [int(m3[r].nonzero()[0]) if m3[r].any() else 64 for r in range(8)]
    assert all(f >= 1 for f in first_masked)


def test_loss_decreases_export_loads_and_resume(data, tmp_path):
    from spiffy.models.loading import load_model, load_tokenizer

    base = dllm.train(_args(data, tmp_path / "r0", "--steps", "0"))
    m = dllm.train(_args(data, tmp_path / "r1", "--steps", "30"))
    acc0 = base["heldout_masked"]["mask_0.5"]["accuracy"]
    acc1 = m["heldout_masked"]["mask_0.5"]["accuracy"]
    assert acc1 > acc0 and m["heldout_masked"]["mask_0.5"]["ce"] < base["heldout_masked"]["mask_0.5"]["ce"] - 0.5
    model = load_model(tmp_path / "r1" / "model", dtype="float64")
    tok = load_tokenizer(tmp_path / "r1" / "model")
    assert type(model).__name__ == "LLaDAModelLM"
    assert model.config.mask_token_id == tok.convert_tokens_to_ids("<|mdm_mask|>")
    ids = torch.tensor([[model.config.mask_token_id] * 5])
    assert model(input_ids=ids).logits.shape == (1, 5, len(tok))
    # resume = uninterrupted
    dllm.train(_args(data, tmp_path / "full", "--steps", "4"))
    dllm.train(_args(data, tmp_path / "split", "--steps", "4", "--stop-after", "2"))
    dllm.train(_args(data, tmp_path / "split", "--steps", "4", "--resume"))
    a = torch.load(tmp_path / "full" / TRAIN_STATE, weights_only=False)
    b = torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=False)
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
