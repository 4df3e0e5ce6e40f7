"""``ARSpecConfig.block_size`` meets the drafter (issue 29, item 2).

A drafter drafts at most ``block_size - 1`` positions of its own block; a config asking for a longer block used to
reach the target's verification forward and fail there with an untyped ``ValueError`` about ``position_ids``.
Both the single and the batched entry points now refuse it up front with a :class:`ConfigError` naming the
drafter's block and the fix; a block no longer than the drafter's decodes exactly like AR (coupled rule).
"""

from __future__ import annotations

import pytest
import torch

from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, speculative_generate, speculative_generate_batch
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target

BLOCK = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("block_size")
    target_dir = make_tiny_target(root / "target", seed=5, num_layers=2, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=4, num_layers=1, block_size=BLOCK)
    return load_target(target_dir, torch.float64, "cpu"), load_drafter(drafter_dir, dtype=torch.float64)


PROMPT = [11, 40, 7, 99, 23]


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_a_block_longer_than_the_drafters_is_a_config_error(pair, method: str) -> None:
    target, model = pair
    cfg = ARSpecConfig(method=method, budget=8, max_new_tokens=24, block_size=BLOCK + 1)
    with pytest.raises(ConfigError, match=rf"drafter's block of {BLOCK}.*fix"):
        speculative_generate(target, DFlashDrafter(model), PROMPT, cfg)
    with pytest.raises(ConfigError, match=rf"drafter's block of {BLOCK}.*fix"):
        speculative_generate_batch(target, [DFlashDrafter(model)], [PROMPT], cfg)


@pytest.mark.parametrize("block", [2, BLOCK - 1, BLOCK])
def test_a_block_up_to_the_drafters_decodes_like_ar(pair, block: int) -> None:
    target, model = pair
    sampling = SamplingConfig(temperature=0.0)
    ar = speculative_generate(target, None, PROMPT, ARSpecConfig(method="ar", max_new_tokens=8, sampling=sampling))
    cfg = ARSpecConfig(method="ddtree", budget=8, max_new_tokens=8, block_size=block, sampling=sampling)
    out = speculative_generate(target, DFlashDrafter(model), PROMPT, cfg)
    assert out.tokens == ar.tokens and out.block_size == block
    batch = speculative_generate_batch(target, [DFlashDrafter(model), DFlashDrafter(model)], [PROMPT, PROMPT[:3]], cfg)
    assert batch[0].tokens == ar.tokens
