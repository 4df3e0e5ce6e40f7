"""Tests of the DFlash drafter trainer (spiffy.train.drafter) on a tiny random Qwen3 target in the real layout."""

from __future__ import annotations

import json

import pytest
import torch

from spiffy.train import drafter as dtrain
from spiffy.train.common import TRAIN_STATE, step_generator
from spiffy.train.corpus import build_corpus


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from spiffy.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("drafter_env")
    make_tiny("qwen3", root / "target", seed=0, num_hidden_layers=3)
    build_corpus(root / "corpus", max_files=12, heldout_percent=30)
    return root


def _args(env, out, *extra):
    from argparse import ArgumentParser

    return dtrain.add_arguments(ArgumentParser()).parse_args([
        "--target", str(env / "target"), "--out", str(out), "--corpus", str(env / "corpus"), "--max-files", "12",
        "--heldout-percent", "30", "--num-layers", "1", "--block-size", "4", "--seq-len", "24", "--prompt-len", "8",
        "--num-anchors", "4", "--batch-size", "2", "--warmup", "2", "--lr", "5e-3", "--eval-batches", "2",
        "--ckpt-every", "2", "--save-dtype", "float32", *extra])


def test_block_inputs_semantics():
    seqs = torch.arange(100, 112)[None, :]  # [1, 12]
    anchors = torch.tensor([[3, 7]])
    noise, pos, mask, labels, valid = dtrain.block_inputs(seqs, anchors, 4, mask_id=-1)
    assert noise.tolist() == [[103, -1, -1, -1, 107, -1, -1, -1]]
    assert pos.tolist() == [list(range(12)) + [3, 4, 5, 6, 7, 8, 9, 10]]
    assert labels.tolist() == [[[103, 104, 105, 106], [107, 108, 109, 110]]]
    assert valid.all()
    m = mask[0, 0]  # [8 queries, 12 context + 8 block keys]
    for q in range(8):
        j = q // 4
        anchor = int(anchors[0, j])
        assert m[q, :12].tolist() == [k < anchor for k in range(12)]  # context strictly before the anchor
        assert m[q, 12:].tolist() == [k // 4 == j for k in range(8)]  # own block only, bidirectional
    # labels past the end are flagged invalid
    _, _, _, _, valid2 = dtrain.block_inputs(seqs, torch.tensor([[10]]), 4, mask_id=-1)
    assert valid2[0, 0].tolist() == [True, True, False, False]


def test_slot_weights_and_anchors():
    w = dtrain.slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == pytest.approx(1.0) and bool((w[2:] < w[1:-1]).all())
    assert dtrain.slot_weights(4, 0.0).tolist() == [0.0, 1.0, 1.0, 1.0]
    a = dtrain.sample_anchors(3, 5, 20, 6, step_generator(0, 1))
    b = dtrain.sample_anchors(3, 5, 20, 6, step_generator(0, 1))
    assert torch.equal(a, b) and a.shape == (3, 6)
    assert bool((a >= 5).all() and (a <= 20).all())
    assert all(len(set(r.tolist())) == 6 and r.tolist() == sorted(r.tolist()) for r in a)


def test_parallel_training_blocks_equal_inference_forward(env):
    """Each training block (several per sequence, one masked forward) must equal the drafter's inference call
    for that block alone: context = target features strictly before the anchor, block = [anchor token, MASK...]."""
    from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks

    target, tok = dtrain.load_frozen_target(env / "target", dtype="float64")
    cfg = dtrain.build_drafter_config(target.config, 2, 4, [0, 2], dtrain.mask_token_of(tok, target.config.vocab_size))
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).double().eval()
    seqs = torch.randint(0, 200, (2, 14), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[2, 6, 9], [1, 5, 10]])
    with TargetFeatureHooks(target, drafter.target_layer_ids) as hooks:
        with torch.no_grad():
            _, logits, _, _ = dtrain.drafter_loss(drafter, target, hooks, seqs, anchors, 7.0)
            feats = hooks.features()
            emb = target.get_input_embeddings()
            for b in range(2):
                for j in range(3):
                    a = int(anchors[b, j])
                    block = torch.full((1, 4), drafter.mask_token_id)
                    block[0, 0] = seqs[b, a]
                    pos = torch.cat([torch.arange(a), a + torch.arange(4)])
                    h = drafter(feats[b:b + 1, :a], emb(block), pos)
                    ref = drafter.compute_logits(h, target.get_output_embeddings())[0]
                    torch.testing.assert_close(logits[b, j], ref, rtol=1e-9, atol=1e-9)


def test_train_loss_decreases_saves_loadable_drafter(env, tmp_path):
    from spiffy.models.dflash import check_compatible, load_drafter

    base = dtrain.train(_args(env, tmp_path / "d0", "--steps", "0"))
    m = dtrain.train(_args(env, tmp_path / "d1", "--steps", "25"))
    assert m["steps"] == 25 and m["heldout_loss"] < base["heldout_loss"]
    assert m["heldout_tau_greedy"] >= 1.0 and len(m["heldout_per_slot_acc"]) == 3
    final = tmp_path / "d1" / "model"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 4 and cfg["num_target_layers"] == 3
    target, tok = dtrain.load_frozen_target(env / "target")
    assert cfg["dflash_config"]["mask_token_id"] == tok.convert_tokens_to_ids("<|MASK|>")
    d = load_drafter(final, dtype="float32")
    check_compatible(d, target)
    assert (final / "MODEL_CARD.md").is_file() and json.loads((final / "metrics.json").read_text())["steps"] == 25


def test_resume_reproduces_uninterrupted_run(env, tmp_path):
    dtrain.train(_args(env, tmp_path / "full", "--steps", "4"))
    dtrain.train(_args(env, tmp_path / "split", "--steps", "4", "--stop-after", "2"))
    dtrain.train(_args(env, tmp_path / "split", "--steps", "4", "--resume"))
    a = torch.load(tmp_path / "full" / TRAIN_STATE, weights_only=False)
    b = torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=False)
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_cli_train_drafter(env, tmp_path):
    from spiffy.cli.main import main

    argv = ["train-drafter", "--target", str(env / "target"), "--out", str(tmp_path / "cli"), "--corpus",
            str(env / "corpus"), "--max-files", "12", "--heldout-percent", "30", "--block-size", "4", "--seq-len",
            "20", "--prompt-len", "6", "--batch-size", "1", "--steps", "2", "--eval-batches", "1", "--data", "corpus"]
    assert main(argv) == 0
    assert (tmp_path / "cli" / "model" / "config.json").is_file()
    # a non-Qwen3 target is refused with a typed error (exit code 2)
    from spiffy.models.tiny import make_tiny

    make_tiny("llada", tmp_path / "llada")
    assert main(argv[:2] + [str(tmp_path / "llada")] + argv[3:]) == 2
