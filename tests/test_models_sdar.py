"""SDAR block-causal forward: incremental block decoding with a cache equals one full block-causal forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_f64

from spiffy.models.cache import KVCache
from spiffy.models.sdar import block_causal_mask

ATOL = 1e-12
BLOCK = 4


@pytest.fixture()
def sdar(tiny_sdar: Path) -> torch.nn.Module:
    return load_f64(tiny_sdar, cached=True)


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (batch, length), generator=g)


def test_block_causal_mask_shape_and_pattern() -> None:
    m = block_causal_mask(6, 2)
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.bool
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[0, 0], expected)
    tail = block_causal_mask(2, 2, start=4)
    assert torch.equal(tail[0, 0], expected[4:])
    add = block_causal_mask(6, 2, dtype=torch.float64)
    assert torch.equal(add == 0, m)


def _incremental(sdar: torch.nn.Module, x: torch.Tensor, cache, block: int = BLOCK) -> torch.Tensor:  # noqa: ANN001
    """Prefill all blocks but the last with store_kv=True, then the last with store_kv=False (reference style)."""
    n = x.shape[1]
    prefill = n - block
    sdar(
        x[:, :prefill],
        attention_mask=block_causal_mask(prefill, block),
        position_ids=torch.arange(prefill)[None],
        past_key_values=cache,
        use_cache=True,
        store_kv=True,
    )
    assert cache.get_seq_length() == prefill
    out = sdar(
        x[:, prefill:],
        attention_mask=block_causal_mask(block, block, start=prefill),
        position_ids=torch.arange(prefill, n)[None],
        past_key_values=cache,
        use_cache=True,
        store_kv=False,
    ).logits
    assert cache.get_seq_length() == prefill
    return out


def test_incremental_block_decode_equals_full_forward(sdar: torch.nn.Module) -> None:
    x = _ids(4 * BLOCK)
    full = sdar(x, attention_mask=block_causal_mask(x.shape[1], BLOCK)).logits
    cache = KVCache(sdar.config.num_hidden_layers)
    inc = _incremental(sdar, x, cache)
    torch.testing.assert_close(inc, full[:, -BLOCK:], rtol=0, atol=ATOL)
    # the block-causal structure matters: a causal mask gives different logits
    causal = sdar(x).logits
    assert (causal[:, -BLOCK:] - full[:, -BLOCK:]).abs().max() > 1e-6


def test_dynamic_cache_and_reference_float_mask(sdar: torch.nn.Module) -> None:
    """The reference passes a float 0/1 mask and a DynamicCache; both are accepted."""
    from transformers import DynamicCache

    x = _ids(3 * BLOCK, seed=1)
    n = x.shape[1]
    blocks = n // BLOCK
    ref_mask = torch.tril(torch.ones(blocks, blocks)).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[None]
    full = sdar(x, attention_mask=ref_mask[:, None]).logits
    torch.testing.assert_close(full, sdar(x, attention_mask=block_causal_mask(n, BLOCK)).logits, rtol=0, atol=ATOL)
    dyn = DynamicCache()
    prefill = n - BLOCK
    sdar(x[:, :prefill], attention_mask=ref_mask[:, None, :prefill, :prefill], position_ids=torch.arange(prefill)[None],
         past_key_values=dyn, use_cache=True, store_kv=True)
    out = sdar(x[:, prefill:], attention_mask=ref_mask[:, None, prefill:, :n], position_ids=torch.arange(prefill, n)[None],
               past_key_values=dyn, use_cache=True, store_kv=False)
    assert out.past_key_values is dyn and dyn.get_seq_length() == prefill
    torch.testing.assert_close(out.logits, full[:, prefill:], rtol=0, atol=ATOL)


def test_commit_then_next_block(sdar: torch.nn.Module) -> None:
    """Decode loop shape: denoise (read) -> commit (append) -> next block (read) equals the full forward."""
    x = _ids(3 * BLOCK, seed=2)
    full = sdar(x, attention_mask=block_causal_mask(12, BLOCK)).logits
    cache = KVCache(sdar.config.num_hidden_layers)
    for b in range(3):
        rows = slice(b * BLOCK, (b + 1) * BLOCK)
        kw = dict(attention_mask=block_causal_mask(BLOCK, BLOCK, start=b * BLOCK), past_key_values=cache)
        step = sdar(x[:, rows], cache_policy="read", **kw).logits  # default positions = cache_len + arange
        torch.testing.assert_close(step, full[:, rows], rtol=0, atol=ATOL)
        sdar(x[:, rows], cache_policy="append", **kw)
    assert cache.get_seq_length() == 12


def test_drafts_share_prefix_cache(sdar: torch.nn.Module) -> None:
    """Several candidate blocks (batch 3) against one batch-1 committed prefix, read-only."""
    x = _ids(2 * BLOCK, seed=3)
    cache = KVCache(sdar.config.num_hidden_layers)
    sdar(x[:, :BLOCK], attention_mask=block_causal_mask(BLOCK, BLOCK), past_key_values=cache, store_kv=True)
    drafts = torch.cat([x[:, BLOCK:], _ids(BLOCK, seed=4), _ids(BLOCK, seed=5)], dim=0)
    mask = block_causal_mask(BLOCK, BLOCK, start=BLOCK)
    batched = sdar(drafts, attention_mask=mask, past_key_values=cache, store_kv=False).logits
    for b in range(3):
        seq = torch.cat([x[:, :BLOCK], drafts[b : b + 1]], dim=1)
        full = sdar(seq, attention_mask=block_causal_mask(2 * BLOCK, BLOCK)).logits[:, BLOCK:]
        torch.testing.assert_close(batched[b : b + 1], full, rtol=0, atol=ATOL)


def test_no_mask_means_causal_over_cache_and_new(sdar: torch.nn.Module) -> None:
    x = _ids(9, seed=6)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(sdar(x).logits, sdar(x, attention_mask=causal).logits, rtol=0, atol=ATOL)
    cache = KVCache(sdar.config.num_hidden_layers)
    sdar(x[:, :5], past_key_values=cache, store_kv=True)
    inc = sdar(x[:, 5:], past_key_values=cache, store_kv=False).logits
    torch.testing.assert_close(inc, sdar(x).logits[:, 5:], rtol=0, atol=ATOL)


def test_use_cache_without_cache_creates_one(sdar: torch.nn.Module) -> None:
    x = _ids(8, seed=7)
    out = sdar(x, attention_mask=block_causal_mask(8, BLOCK), use_cache=True)
    assert isinstance(out.past_key_values, KVCache) and out.past_key_values.get_seq_length() == 8
    assert sdar(x).past_key_values is None
