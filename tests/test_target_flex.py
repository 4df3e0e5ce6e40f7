"""``attn_implementation="flex_attention"`` on the transformers Qwen3 target against SDPA, on CPU.

The target's flex path is spiffy's flex kernel registered with transformers' AttentionInterface
(:data:`spiffy.models.flex.TARGET_FLEX`): the compiled tree masks of DDTree verification become flex block masks
(built once per forward, reused by every layer). Logits match SDPA with a tolerance (float64), tokens exactly
(DDTree / DFlash / AR, and a batched ragged DDTree generation).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import DynamicCache

import spiffy.models.flex as flex_module
from spiffy.arspec import ARSpecConfig, as_drafter, ddtree_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_model, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.cache import hf_cache
from spiffy.models.flex import TARGET_FLEX, target_attention
from spiffy.verify import compile_tree

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("target_flex")
    target = make_tiny_target(root / "target", seed=3, num_layers=2, with_tokenizer=False)
    return target, make_tiny_dflash(root / "drafter", target, seed=4, num_layers=1, block_size=6)


@pytest.fixture(scope="module")
def models(paths):
    target, drafter = paths
    return {
        "sdpa": load_target(target, torch.float64, "cpu"),
        "flex": load_target(target, torch.float64, "cpu", attn_implementation="flex_attention"),
        "drafter": load_drafter(drafter, dtype=torch.float64),
    }


def test_flex_target_is_spiffys_kernel(models, paths):
    assert models["flex"].config._attn_implementation == TARGET_FLEX
    assert load_model(paths[0], dtype="float64", attn_implementation="flex_attention").config._attn_implementation \
        == TARGET_FLEX
    assert target_attention("sdpa") == "sdpa" and target_attention("flex_attention") == TARGET_FLEX
    with pytest.raises(ConfigError, match="cannot verify draft trees"):
        target_attention("flash_attention_2")


@torch.no_grad()
def test_tree_verification_logits_match_sdpa(models, monkeypatch):
    """A prefill (no mask: causal) then one tree-verification forward on top of the cache, as DDTree runs it."""
    built: list[int] = []
    real = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 250, (1, 7), generator=gen)
    tokens = torch.randint(0, 250, (6,), generator=gen)
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])  # a branching tree under the root
    depths = torch.tensor([1, 2, 2, 3, 3, 3])
    logits = {}
    for name in ("sdpa", "flex"):
        model = models[name]
        cache = DynamicCache(config=model.config)
        first = model(prompt, **hf_cache(cache), use_cache=True).logits
        compiled = compile_tree(tokens, depths + 7, parents, context_len=7, dtype=torch.float64,
                                prefix_rows=(torch.tensor([int(tokens[0])]), torch.tensor([7])))
        out = model(compiled.input_ids, position_ids=compiled.position_ids, attention_mask=compiled.attention_mask,
                    **hf_cache(cache), use_cache=True).logits
        logits[name] = (first, out)
        if name == "flex":
            assert isinstance(flex_module._block_mask(compiled.attention_mask, 1, out.shape[1], 7 + out.shape[1],
                                                      out.device), BlockMask)
    for a, b in zip(logits["flex"], logits["sdpa"]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert len(built) == 2  # one block mask per forward, reused by both layers (and by the explicit check above)


@pytest.mark.parametrize("method", [pytest.param("ar", marks=pytest.mark.slow),
                                    pytest.param("dflash", marks=pytest.mark.slow), "ddtree"])
def test_flex_target_decodes_like_sdpa(models, method):
    prompt = torch.randint(0, 250, (6,), generator=torch.Generator().manual_seed(11)).tolist()
    ref = ddtree_generate(models["sdpa"], models["drafter"], prompt, method=method, budget=12, max_new_tokens=14)
    got = ddtree_generate(models["flex"], models["drafter"], prompt, method=method, budget=12, max_new_tokens=14)
    assert got.tokens == ref.tokens
    assert got.acceptance_lengths == ref.acceptance_lengths


def test_flex_target_batched_ragged_like_sdpa(models):
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    cfg = ARSpecConfig(method="ddtree", budget=10, max_new_tokens=10)
    ref = speculative_generate_batch(models["sdpa"], [as_drafter(models["drafter"]) for _ in prompts], prompts, cfg)
    got = speculative_generate_batch(models["flex"], [as_drafter(models["drafter"]) for _ in prompts], prompts, cfg)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]


@pytest.mark.slow
def test_float32_tokens_equal(paths):
    target, drafter = paths
    sdpa = load_target(target, torch.float32, "cpu")
    flex = load_target(target, torch.float32, "cpu", attn_implementation="flex_attention")
    d = load_drafter(drafter, dtype=torch.float32)
    prompt = [9, 8, 7, 6, 5]
    assert ddtree_generate(flex, d, prompt, budget=12, max_new_tokens=12).tokens == \
        ddtree_generate(sdpa, d, prompt, budget=12, max_new_tokens=12).tokens


@torch.no_grad()
def test_same_shape_different_trees_each_match_sdpa(models):
    """Two verification forwards of the same shape, one after the other, with different trees: the block mask reused
    across calls must follow the mask's contents, not only its shape."""
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 250, (1, 5), generator=gen)
    tokens = torch.randint(0, 250, (4,), generator=gen)
    root = (torch.tensor([int(tokens[0])]), torch.tensor([5]))
    trees = ((torch.tensor([-1, 0, 1, 2]), torch.tensor([1, 2, 3, 4])),  # a chain
             (torch.tensor([-1, -1, -1, 0]), torch.tensor([1, 1, 1, 2])))  # a bush
    logits: dict[str, list[torch.Tensor]] = {}
    for name in ("sdpa", "flex"):
        model = models[name]
        cache = DynamicCache(config=model.config)
        model(prompt, **hf_cache(cache), use_cache=True)
        logits[name] = []
        for parents, depths in trees:
            compiled = compile_tree(tokens, depths + 5, parents, context_len=5, dtype=torch.float64, prefix_rows=root)
            logits[name].append(model(compiled.input_ids, position_ids=compiled.position_ids,
                                      attention_mask=compiled.attention_mask, **hf_cache(copy.deepcopy(cache)),
                                      use_cache=True).logits)
    for got, ref in zip(logits["flex"], logits["sdpa"]):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
