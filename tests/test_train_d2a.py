"""dLLM drafter recipes (spiffy.train.d2a): the training layout, each recipe's loss, and a resumable smoke run whose
output loads as a drafter and drafts losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from spiffy.arspec import ARSpecConfig, DLLMDrafter, speculative_generate
from spiffy.arspec.dllm_drafter import drafter_block_mask
from spiffy.cli.main import main
from spiffy.models import load_target
from spiffy.models.ar_drafters import drafter_kind, load_ar_drafter
from spiffy.models.cache import KVCache
from spiffy.train import d2a
from spiffy.train.common import TRAIN_STATE, step_generator
from spiffy.train.corpus import build_corpus

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from spiffy.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("d2a_env")
    make_tiny("qwen3", root / "target", seed=0, num_hidden_layers=2)
    build_corpus(root / "corpus", max_files=12, heldout_percent=30)
    return root


def _argv(env, out, recipe, *extra, init="target"):
    return ["train-drafter", "--recipe", recipe, "--init", str(init), "--target", str(env / "target"), "--out", str(out),
            "--corpus", str(env / "corpus"), "--max-files", "12", "--heldout-percent", "30", "--block-size", "4",
            "--seq-len", "24", "--prompt-len", "8", "--num-anchors", "3", "--batch-size", "2", "--warmup", "1",
            "--lr", "1e-3", "--steps", "3", "--ckpt-every", "1", "--save-dtype", "float32", "--eval-prompts", "2",
            "--eval-new-tokens", "8", "--max-masked", "6", *extra]


def test_block_inputs_match_the_drafting_layout(env):
    """The training forward's block logits equal what DLLMDrafter computes for the same prefix and root."""
    target = load_target(env / "target", torch.float64, "cpu")
    model = d2a.sdar_from_target(target, mask_token_id=5, block_size=4).eval()
    seqs = torch.arange(20, 32)[None]
    inputs = d2a.dllm_block_inputs(seqs, torch.tensor([[3, 7]]), 4, 5)
    assert inputs["ids"][0, 12:].tolist() == [23, 5, 5, 5, 27, 5, 5, 5]
    assert inputs["positions"][0, 12:].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    logits = model(inputs["ids"], attention_mask=inputs["mask"], position_ids=inputs["positions"]).logits[0, 12:]
    for j, anchor in enumerate((3, 7)):
        ids = seqs[0, :anchor].tolist() + [int(seqs[0, anchor])] + [5] * 3
        mask = drafter_block_mask(anchor, 4, 0, "cpu")
        ref = model(torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(len(ids)).view(1, -1),
                    past_key_values=KVCache(model.config.num_hidden_layers), cache_policy="read").logits[0, anchor:]
        torch.testing.assert_close(logits[4 * j: 4 * j + 4], ref, rtol=1e-9, atol=1e-9)


def test_sdar_copy_of_the_target_predicts_like_it_causally(env):
    target = load_target(env / "target", torch.float64, "cpu")
    model = d2a.sdar_from_target(target, mask_token_id=5, block_size=4).eval()
    ids = torch.arange(30, 40)[None]
    # same weights, own implementation (RoPE angles in float32): equal up to rounding
    torch.testing.assert_close(model(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("recipe", d2a.RECIPES)
def test_recipe_losses_are_finite_and_differentiable(env, recipe):
    target = load_target(env / "target", torch.float32, "cpu")
    model = d2a.sdar_from_target(target, mask_token_id=5, block_size=4)
    seqs = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[4, 9], [6, 10]])
    t_logits = target(input_ids=seqs).logits.detach() if recipe == "streak" else None
    loss, stats = d2a.recipe_loss(recipe, model, seqs, anchors, 4, 5, step_generator(0, 0), target_logits=t_logits)
    loss.backward()
    assert torch.isfinite(loss) and stats["tau_teacher_forced"] >= 1.0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    if recipe == "streak":
        assert 0.0 <= stats["expected_streak"] <= 3.0


def test_stage2_weights_stress_early_slots():
    w = torch.tensor([1.01 ** (5 - i) for i in range(1, 6)])
    assert bool((w[:-1] > w[1:]).all())


def test_smoke_run_resumes_and_writes_a_drafter(env, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_argv(env, out, "d2a-stage1", "--stop-after", "2")) == 0
    assert (out / TRAIN_STATE).is_file()
    assert main(_argv(env, out, "d2a-stage1", "--resume")) == 0
    metrics = json.loads((out / "model" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["finished"] and len(metrics["invocations"]) == 2
    assert metrics["heldout"]["prompts"] == 2 and metrics["heldout_tau_deer_greedy"] >= 1.0
    assert "Held-out acceptance" in (out / "model" / "MODEL_CARD.md").read_text()
    assert drafter_kind(out / "model") == "dllm"
    # stage 2 from the stage-1 checkpoint, then streak; the result drafts losslessly
    out2 = tmp_path / "run2"
    assert main(_argv(env, out2, "d2a-stage2", init=out / "model")) == 0
    assert json.loads((out2 / "model" / "metrics.json").read_text())["init"] == str(out / "model")
    out3 = tmp_path / "run3"
    assert main(_argv(env, out3, "streak", "--init-layers", "1")) == 0
    assert json.loads((out3 / "model" / "config.json").read_text())["num_hidden_layers"] == 1
    target = load_target(env / "target", torch.float64, "cpu")
    drafter = DLLMDrafter(load_ar_drafter(out3 / "model", dtype=torch.float64))
    ar = speculative_generate(target, None, [10, 11, 12], ARSpecConfig(method="ar", max_new_tokens=10))
    assert speculative_generate(target, drafter, [10, 11, 12], ARSpecConfig(method="deer", max_new_tokens=10)).tokens \
        == ar.tokens


def test_shifted_slot_logits_read_the_previous_row(env):
    target = load_target(env / "target", torch.float64, "cpu")
    model = d2a.sdar_from_target(target, mask_token_id=5, block_size=4)
    assert model.config.drafter_config["shifted"] is True
    assert DLLMDrafter(model).shifted  # the drafter reads the AR way too
    inputs = d2a.dllm_block_inputs(torch.arange(20, 32)[None], torch.tensor([[3]]), 4, 5)
    plain = d2a._slot_logits(model, inputs, 12, 1, 4)
    shifted = d2a._slot_logits(model, inputs, 12, 1, 4, shifted=True)
    torch.testing.assert_close(shifted[:, :, 1:], plain[:, :, :-1], rtol=0, atol=0)
