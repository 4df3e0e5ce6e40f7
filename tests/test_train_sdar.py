"""Tests of the SDAR block-diffusion trainer (spiffy.train.sdar): the training layout equals decoding, the noise,
the Qwen3 weight copy, a few steps that lower the loss, resume, and an export that spiffy.load_model reads."""

from __future__ import annotations

import pytest
import torch

from spiffy.models.sdar import block_causal_mask
from spiffy.errors import ConfigError
from spiffy.models.loading import load_model
from spiffy.models.tiny import make_tiny
from spiffy.train import sdar
from spiffy.train.common import step_generator
from spiffy.train.corpus import build_corpus


@pytest.fixture(scope="module")
def qwen3_tied(tmp_path_factory):
    return make_tiny("qwen3", tmp_path_factory.mktemp("sdar_init") / "q", tie_word_embeddings=True, min_shards=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("sdar_corpus") / "c", max_files=12, heldout_percent=30).out_dir


def test_init_copies_qwen3_and_training_layout_matches_decoding(qwen3_tied, tiny_qwen3):
    for src in (qwen3_tied, tiny_qwen3):  # tied and untied heads
        model, tok = sdar.init_from_qwen3(src)
        ar = load_model(src, dtype="float32")
        assert model.config.tie_word_embeddings == ar.config.tie_word_embeddings
        assert model.config.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
        x = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
        # with no mask the SDAR model is causal: the copied weights give the AR model's logits
        torch.testing.assert_close(model(input_ids=x).logits, ar(input_ids=x).logits, rtol=1e-4, atol=1e-4)
        # block b of the [noisy ; clean] forward = the decoder's forward of block b over the clean prefix
        xt, masked = sdar.noise_blocks(x, 8, model.config.mask_token_id, step_generator(0, 0))
        logits = sdar.noisy_logits(model, xt, x, 8)
        for b in range(4):
            s, e = 8 * b, 8 * b + 8
            rows = torch.cat([x[:, :s], xt[:, s:e]], dim=1)
            ref = model(input_ids=rows, attention_mask=block_causal_mask(e, 8, device="cpu")).logits[:, s:e]
            torch.testing.assert_close(logits[:, s:e], ref, rtol=1e-4, atol=1e-4)


def test_training_mask_and_noise():
    m = sdar.training_mask(8, 4)[0, 0]
    assert m.shape == (16, 16)
    assert bool(m[1, :4].all()) and not bool(m[1, 4:8].any()) and not bool(m[1, 8:].any())  # noisy block 0
    assert bool(m[5, 4:8].all()) and bool(m[5, 8:12].all()) and not bool(m[5, 12:].any())  # noisy block 1
    assert not bool(m[8:, :8].any()) and bool(m[9, 8:12].all()) and not bool(m[9, 12:].any())  # clean rows
    with pytest.raises(Exception, match="multiple of block"):
        sdar.training_mask(10, 4)
    x0 = torch.arange(1, 1 + 256 * 64).view(256, 64)
    xt, masked = sdar.noise_blocks(x0, 16, 0, step_generator(0, 1))
    assert torch.equal(xt == 0, masked) and torch.equal(xt[~masked], x0[~masked])
    # each block has its own ratio: the per-block masked counts of a row differ
    per_block = masked.view(256, 4, 16).sum(-1)
    assert bool((per_block.max(1).values != per_block.min(1).values).float().mean() > 0.8)
    assert masked.float().mean().item() == pytest.approx(0.5, abs=0.05)
    # prompt rows keep a clean prefix in some block
    _, mp = sdar.noise_blocks(x0, 16, 0, step_generator(0, 1), prompt_frac=1.0)
    assert mp.sum() < masked.sum()


def _args(corpus, init, out, *extra):
    return sdar.build_parser().parse_args([
        "--out", str(out), "--init", str(init), "--corpus", str(corpus), "--max-files", "12",
        "--heldout-percent", "30", "--context", "32", "--blocks", "8,16", "--batch-size", "4", "--warmup", "2",
        "--lr", "1e-2", "--eval-windows", "4", "--sample-tokens", "8", "--ckpt-every", "2",
        "--save-dtype", "float32", *extra])


def test_train_lowers_loss_resumes_and_exports(corpus, qwen3_tied, tmp_path):
    base = sdar.train(_args(corpus, qwen3_tied, tmp_path / "r0", "--steps", "0"))
    run = sdar.train(_args(corpus, qwen3_tied, tmp_path / "r1", "--steps", "12"))
    ce0, ce1 = (m["heldout_masked"]["b8_mask_0.5"]["ce"] for m in (base, run))
    assert ce1 < ce0 - 0.5
    model = load_model(tmp_path / "r1" / "model", dtype="float32")
    assert model.config.model_type == "sdar" and "AutoModelForCausalLM" in model.config.auto_map
    assert (tmp_path / "r1" / "model" / "MODEL_CARD.md").is_file()
    # 6 steps + resume 6 steps = 12 steps in one go
    sdar.train(_args(corpus, qwen3_tied, tmp_path / "r2", "--steps", "12", "--stop-after", "6"))
    sdar.train(_args(corpus, qwen3_tied, tmp_path / "r2", "--steps", "12", "--resume"))
    split = load_model(tmp_path / "r2" / "model", dtype="float32").state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(split[k], v, rtol=1e-5, atol=1e-6)


def test_continue_from_state_with_teacher_windows(corpus, qwen3_tied, tmp_path):
    first = sdar.train(_args(corpus, qwen3_tied, tmp_path / "a", "--steps", "6"))
    extra = ["--steps", "4", "--start-from", str(tmp_path / "a" / "train_state.pt"), "--teacher", str(qwen3_tied),
             "--teacher-windows", "6", "--teacher-prefix", "4,12", "--teacher-frac", "0.5"]
    cont = sdar.train(_args(corpus, qwen3_tied, tmp_path / "b", *extra))
    # the continued run starts from the first run's final weights (same held-out figures), not from the Qwen3 copy
    for key, value in first["heldout_masked"].items():
        assert cont["heldout_masked_init"][key]["ce"] == pytest.approx(value["ce"], abs=1e-3)
    assert cont["heldout_masked_init"]["b8_mask_0.5"]["ce"] < first["heldout_masked_init"]["b8_mask_0.5"]["ce"] - 0.3
    info = cont["train"]["teacher"]
    assert info["count"] == 6 and info["prefix"] == [4, 12] and info["frac"] == 0.5
    assert (tmp_path / "b" / "data" / "teacher_windows.pt").is_file()
    assert "continued greedily" in (tmp_path / "b" / "MODEL_CARD.md").read_text()
    # an exported checkpoint directory is a valid starting point too; a Qwen3 directory is not
    from_dir = sdar.train(_args(corpus, qwen3_tied, tmp_path / "c", "--steps", "0", "--save-dtype", "float32",
                                "--start-from", str(tmp_path / "a" / "model")))
    assert from_dir["heldout_masked_init"]["b8_mask_0.5"]["ce"] == pytest.approx(
        first["heldout_masked"]["b8_mask_0.5"]["ce"], abs=1e-3)
    with pytest.raises(ConfigError, match="SDAR"):
        sdar.train(_args(corpus, qwen3_tied, tmp_path / "d", "--steps", "0", "--start-from", str(qwen3_tied)))
    with pytest.raises(ConfigError, match="neither"):
        sdar.train(_args(corpus, qwen3_tied, tmp_path / "e", "--steps", "0", "--start-from", str(tmp_path / "nope")))
