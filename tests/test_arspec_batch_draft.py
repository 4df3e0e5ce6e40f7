"""One drafter forward for all rows of a batched AR round: DFlash and dLLM drafters sharing a model (float64).

The shared forward pads ragged caches, contexts and blocks; each row must still draft exactly what it drafts alone
(logits within float tolerance; tokens, rounds and acceptance of whole generations equal), in one call per round.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spiffy.arspec import ARSpecConfig, ContextUpdate, SamplingConfig, speculative_generate
from spiffy.arspec.batch import ddtree_generate_batch, speculative_generate_batch
from spiffy.arspec.stages import draft as draft_rows
from spiffy.arspec.dllm_drafter import DLLMDrafter
from spiffy.arspec.generate import ddtree_generate
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter

BLOCK = 6
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7], [120, 2, 9, 4, 61, 33, 8, 1, 14], [31, 6, 200]]

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("batch_draft")
    target = make_tiny_target(base / "target", seed=5, num_layers=2, with_tokenizer=False)
    return {
        "target": target,
        "dllm": make_tiny_dllm_drafter(base / "dllm", target, seed=1, block_size=BLOCK),
        "dflash": make_tiny_dflash(base / "dflash", target, seed=2, num_layers=1, block_size=BLOCK),
    }


@pytest.fixture(scope="module")
def target(paths):
    return load_target(paths["target"], torch.float64, "cpu")


def _dllm(paths, layout: str) -> torch.nn.Module:
    model = load_ar_drafter(paths["dllm"], dtype=torch.float64)
    if layout == "aligned":  # SDAR's own block-causal layout, blocks of 4 aligned to absolute positions
        model.config.drafter_config = {**model.config.drafter_config, "layout": "aligned", "attention_block": 4}
    return model


def _count_calls(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("layout", ["root", "aligned"])
def test_dllm_rows_draft_what_they_draft_alone(target, paths, layout):
    """Ragged committed contexts (some already cached, some pending) -> each row's logits and cache as alone."""
    model = _dllm(paths, layout)
    calls = _count_calls(model)
    together = [DLLMDrafter(model) for _ in PROMPTS]
    alone = [DLLMDrafter(model) for _ in PROMPTS]
    for d in together + alone:
        d.attach(target)
    for step, depths in enumerate(([5, 3, 4, 2], [2, 5, 5, 3])):
        roots = []
        for r, prompt in enumerate(PROMPTS):
            # round 0: the prompt; round 1: the previous root and a few accepted tokens (ragged per row)
            ctx = prompt if step == 0 else [3 + r] + [11 + r, 12 + r, 13][: r % 3]
            start = 0 if step == 0 else len(prompt)
            for d in (together[r], alone[r]):
                d.commit(ContextUpdate(ctx, start, range(len(ctx))))
            roots.append((3 + r, start + len(ctx)))
        before = calls[0]
        got = draft_rows(together, roots, depths)
        assert calls[0] == before + 1  # one drafter forward for every row
        for r, ((tok, pos), depth) in enumerate(zip(roots, depths)):
            want = alone[r].propose(tok, pos, depth)
            torch.testing.assert_close(got[r], want, rtol=1e-10, atol=1e-10)
            assert together[r]._pending == alone[r]._pending
            assert together[r]._cache.get_seq_length() == alone[r]._cache.get_seq_length()
            if alone[r]._cache.get_seq_length():
                for k_t, k_a in zip(together[r]._cache.keys, alone[r]._cache.keys):
                    torch.testing.assert_close(k_t, k_a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("layout", ["root", "aligned"])
def test_dllm_batched_generation_equals_rows_alone(target, paths, layout, temperature):
    model = _dllm(paths, layout)
    calls = _count_calls(model)
    for method in ("deer", "specdiff", "ddtree"):
        cfg = ARSpecConfig(method=method, budget=6, drafts=3, max_new_tokens=14,
                           sampling=SamplingConfig(temperature=temperature, seed=2))
        solo = [speculative_generate(target, DLLMDrafter(model), p, cfg) for p in PROMPTS]
        calls[0] = 0
        batch = speculative_generate_batch(target, [DLLMDrafter(model) for _ in PROMPTS], PROMPTS, cfg)
        for a, b in zip(solo, batch):
            assert b.tokens == a.tokens, method
            assert b.acceptance_lengths == a.acceptance_lengths and b.nodes_per_round == a.nodes_per_round
        assert calls[0] <= max(r.rounds for r in batch) < sum(r.rounds for r in batch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_dflash_batched_generation_equals_rows_alone(target, paths, method, temperature):
    drafter = load_drafter(paths["dflash"], dtype=torch.float64)
    calls = _count_calls(drafter)
    seeds = [7, 8, 9, 10]
    kw = dict(method=method, budget=12, max_new_tokens=14, temperature=temperature)
    solo = [ddtree_generate(target, drafter, p, seed=s, **kw) for p, s in zip(PROMPTS, seeds)]
    calls[0] = 0
    batch = ddtree_generate_batch(target, drafter, PROMPTS, seed=seeds, **kw)
    for a, b in zip(solo, batch):
        assert b.tokens == a.tokens
        assert b.acceptance_lengths == a.acceptance_lengths and b.nodes_per_round == a.nodes_per_round
    assert calls[0] <= max(r.rounds for r in batch) < sum(r.rounds for r in batch)


def test_rows_with_their_own_models_draft_alone(target, paths):
    """Drafters of different model objects (or several denoising steps) cannot share a forward: each proposes."""
    models = [_dllm(paths, "root") for _ in range(2)]
    calls = [_count_calls(m) for m in models]
    drafters = [DLLMDrafter(models[0]), DLLMDrafter(models[1]), DLLMDrafter(models[0], denoise_steps=2), None]
    for d in drafters[:3]:
        d.attach(target)  # type: ignore[union-attr]
        d.commit(ContextUpdate([4, 5, 6], 0, range(3)))  # type: ignore[union-attr]
    out = draft_rows(drafters, [(9, 3)] * 4, [3, 3, 3, 3])
    assert out[3] is None and all(o.shape[0] == 3 for o in out[:3])  # type: ignore[union-attr]
    assert calls[0][0] == 1 + 2 and calls[1][0] == 1  # row 2 denoises in 2 forwards of its own


def _masked(src: Path, dst: Path) -> Path:
    """A copy of the DFlash checkpoint at ``src`` whose one layer is causal with a sliding window of 3 positions."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(is_causal=True, layer_types=["sliding_attention"], sliding_window=3, use_sliding_window=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "causal-sliding"])
def test_dflash_rows_draft_what_they_draft_alone(target, paths, masked, tmp_path):
    """Ragged pending target features and cached contexts -> each row's DFlash logits and cache as alone, in one
    forward (a causal sliding-window drafter too: its masks read each row's cached positions in the left-padded
    stacked cache)."""
    from spiffy.arspec.drafter import DFlashDrafter

    drafter = load_drafter(_masked(paths["dflash"], tmp_path / "masked") if masked else paths["dflash"],
                           dtype=torch.float64)
    assert [layer.window for layer in drafter.layer_attention] == ([3] if masked else [None])
    calls = _count_calls(drafter)
    width = len(drafter.target_layer_ids) * int(drafter.config.hidden_size)
    together = [DFlashDrafter(drafter) for _ in PROMPTS]
    alone = [DFlashDrafter(drafter) for _ in PROMPTS]
    g = torch.Generator().manual_seed(0)
    positions = [0] * len(PROMPTS)
    try:
        for d in together + alone:
            d.attach(target)
        for depths in ([5, 3, 4, 2], [2, 5, 5, 3]):
            roots = []
            for r, prompt in enumerate(PROMPTS):
                n = len(prompt) if positions[r] == 0 else 1 + r % 3  # features of the newly committed rows
                feats = torch.randn((1, n, width), generator=g, dtype=torch.float64)
                together[r]._pending, alone[r]._pending = feats, feats.clone()
                positions[r] += n
                roots.append((3 + r, positions[r]))
            before = calls[0]
            got = draft_rows(together, roots, depths)
            assert calls[0] == before + 1
            for r, ((tok, pos), depth) in enumerate(zip(roots, depths)):
                torch.testing.assert_close(got[r], alone[r].propose(tok, pos, depth), rtol=1e-10, atol=1e-10)
                for k_t, k_a in zip(together[r]._cache.keys, alone[r]._cache.keys):
                    torch.testing.assert_close(k_t, k_a, rtol=1e-10, atol=1e-10)
    finally:
        for d in together + alone:
            d.detach()
