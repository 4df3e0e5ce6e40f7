"""Forward-contract equalities for the bidirectional families (LLaDA, Dream), float64.

A prefix cache, a dual (prefix + suffix) cache and a batch-1 cache broadcast to several query rows must reproduce
the rows of a full forward exactly; a 4-D bool mask equals the same additive mask; a left-padded row equals the
unpadded sequence with positions ``cumsum(mask) - 1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_f64

from spiffy.models.cache import KVCache

ATOL = 1e-12


@pytest.fixture(params=["llada", "dream"])
def bidir(request: pytest.FixtureRequest) -> torch.nn.Module:
    return load_f64(request.getfixturevalue(f"tiny_{request.param}"), cached=True)


def _ids(length: int, batch: int = 1, seed: int = 0, vocab: int = 500) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def _full_cache(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    out = model(ids, use_cache=True)
    assert isinstance(out.past_key_values, KVCache)
    assert out.past_key_values.get_seq_length() == ids.shape[1]
    return out.logits, out.past_key_values


def test_prefix_cache_equals_full_forward(bidir: torch.nn.Module) -> None:
    ids = _ids(24)
    prefix = 10
    full, cache = _full_cache(bidir, ids)
    cache.crop(prefix)
    rest = ids[:, prefix:]
    pos = torch.arange(prefix, ids.shape[1])[None]
    out = bidir(rest, position_ids=pos, past_key_values=cache, cache_policy="read")
    torch.testing.assert_close(out.logits, full[:, prefix:], rtol=0, atol=ATOL)
    assert cache.get_seq_length() == prefix  # read policy left the cache alone
    # default positions are cache_len + arange(L): same result without explicit positions
    again = bidir(rest, past_key_values=cache, use_cache=False)
    torch.testing.assert_close(again.logits, out.logits, rtol=0, atol=ATOL)


def test_prefix_cache_detects_wrong_positions(bidir: torch.nn.Module) -> None:
    """Sanity: the comparison above is sensitive (shifted positions change the logits)."""
    ids = _ids(24)
    full, cache = _full_cache(bidir, ids)
    cache.crop(10)
    wrong = bidir(ids[:, 10:], position_ids=torch.arange(11, 25)[None], past_key_values=cache, cache_policy="read")
    assert (wrong.logits - full[:, 10:]).abs().max() > 1e-6


def test_dual_cache_equals_full_forward(bidir: torch.nn.Module) -> None:
    ids = _ids(30, seed=1)
    start, end = 12, 20  # the block
    full, cache = _full_cache(bidir, ids)
    keep = torch.cat([torch.arange(0, start), torch.arange(end, ids.shape[1])])
    dual = cache.select(keep)
    assert dual.get_seq_length() == ids.shape[1] - (end - start)
    out = bidir(ids[:, start:end], position_ids=torch.arange(start, end)[None], past_key_values=dual, store_kv=False)
    torch.testing.assert_close(out.logits, full[:, start:end], rtol=0, atol=ATOL)


def test_batch1_cache_broadcasts_to_batch3(bidir: torch.nn.Module) -> None:
    ids = _ids(20, seed=2)
    prefix = 8
    _, cache = _full_cache(bidir, ids)
    cache.crop(prefix)
    rows = torch.cat([ids[:, prefix:], _ids(12, seed=3), _ids(12, seed=4)], dim=0)  # three "drafts"
    pos = torch.arange(prefix, prefix + 12)[None]
    batched = bidir(rows, position_ids=pos, past_key_values=cache, cache_policy="read").logits
    for b in range(3):
        single = bidir(rows[b : b + 1], position_ids=pos, past_key_values=cache, cache_policy="read").logits
        torch.testing.assert_close(batched[b : b + 1], single, rtol=0, atol=ATOL)
    assert (batched[1] - batched[2]).abs().max() > 1e-6


def test_append_policy_grows_cache_and_matches_incremental(bidir: torch.nn.Module) -> None:
    """Appending a chunk computes its K/V while attending to [cache ; chunk]."""
    ids = _ids(16, seed=5)
    cache = KVCache(len(_layers(bidir)))
    bidir(ids[:, :6], past_key_values=cache, cache_policy="append")
    assert cache.get_seq_length() == 6
    out = bidir(ids[:, 6:], past_key_values=cache, use_cache=True)
    assert out.past_key_values is cache and cache.get_seq_length() == 16
    # reference: the same two-stage visibility expressed as a 4-D mask over the full sequence
    vis = torch.ones(16, 16, dtype=torch.bool)
    vis[:6, 6:] = False
    ref = bidir(ids, attention_mask=vis[None, None]).logits
    torch.testing.assert_close(out.logits, ref[:, 6:], rtol=0, atol=ATOL)


def _layers(model: torch.nn.Module) -> list:
    return list(model.model.transformer["blocks"]) if hasattr(model.model, "transformer") else list(model.model.layers)


def test_dynamic_cache_equals_kvcache(bidir: torch.nn.Module) -> None:
    from transformers import DynamicCache

    ids = _ids(18, seed=6)
    dyn = DynamicCache()
    bidir(ids[:, :9], past_key_values=dyn, use_cache=True)
    assert dyn.get_seq_length() == 9
    a = bidir(ids[:, 9:], past_key_values=dyn, use_cache=False).logits
    kv = KVCache(len(_layers(bidir)))
    bidir(ids[:, :9], past_key_values=kv, use_cache=True)
    b = bidir(ids[:, 9:], past_key_values=kv, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    assert dyn.get_seq_length() == 9


def test_bool_mask_equals_additive_mask(bidir: torch.nn.Module) -> None:
    ids = _ids(14, batch=2, seed=7)
    g = torch.Generator().manual_seed(0)
    vis = torch.rand(2, 1, 14, 14, generator=g) > 0.4
    vis |= torch.eye(14, dtype=torch.bool)
    additive = torch.zeros(vis.shape, dtype=torch.float64).masked_fill(~vis, torch.finfo(torch.float64).min)
    a = bidir(ids, attention_mask=vis).logits
    b = bidir(ids, attention_mask=additive).logits
    c = bidir(ids, attention_mask=additive.float().masked_fill(~vis, float("-inf"))).logits
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    torch.testing.assert_close(a, c, rtol=0, atol=ATOL)
    assert (a - bidir(ids).logits).abs().max() > 1e-6


def test_fully_masked_row_is_finite(bidir: torch.nn.Module) -> None:
    ids = _ids(6, seed=8)
    vis = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    vis[:, :, 2] = False
    assert torch.isfinite(bidir(ids, attention_mask=vis).logits).all()
    add = torch.zeros(1, 1, 6, 6, dtype=torch.float64)
    add[:, :, 2] = float("-inf")
    assert torch.isfinite(bidir(ids, attention_mask=add).logits).all()


def test_left_padding_invariance(bidir: torch.nn.Module) -> None:
    seq = _ids(9, seed=9)
    pad = 4
    pad_id = int(bidir.config.pad_token_id)
    padded = torch.cat([torch.full((1, pad), pad_id), seq], dim=1)
    other = _ids(13, seed=10)
    batch = torch.cat([padded, other], dim=0)
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = bidir(batch, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(out[0:1, pad:], bidir(seq).logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out[1:2], bidir(other).logits, rtol=0, atol=ATOL)


def test_two_d_mask_for_new_positions_only(bidir: torch.nn.Module) -> None:
    """With a cache, a [B, L] mask covers the new positions; cached ones stay visible."""
    ids = _ids(12, seed=11)
    _, cache = _full_cache(bidir, ids)
    cache.crop(5)
    new = ids[:, 5:]
    short = torch.ones(1, 7, dtype=torch.long)
    short[0, -1] = 0
    long = torch.cat([torch.ones(1, 5, dtype=torch.long), short], dim=1)
    a = bidir(new, attention_mask=short, past_key_values=cache, cache_policy="read").logits
    b = bidir(new, attention_mask=long, past_key_values=cache, cache_policy="read").logits
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_hidden_states_follow_transformers_convention(bidir: torch.nn.Module) -> None:
    ids = _ids(5, seed=12)
    out = bidir(ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(_layers(bidir)) + 1
    assert out.hidden_states[0].shape == (1, 5, bidir.config.hidden_size)


def test_append_to_broadcast_cache_is_rejected(bidir: torch.nn.Module) -> None:
    ids = _ids(8, seed=13)
    _, cache = _full_cache(bidir, ids)
    with pytest.raises(spiffy_config_error()):
        bidir(_ids(4, batch=2), past_key_values=cache, cache_policy="append")


def spiffy_config_error() -> type:
    from spiffy.errors import ConfigError

    return ConfigError


def test_eager_path_matches_sdpa(tiny_llada: Path) -> None:
    from spiffy.models import load_model

    sdpa = load_f64(tiny_llada, cached=True)
    eager = load_model(tiny_llada, dtype=torch.float64, attn_implementation="eager")
    ids = _ids(10, seed=14)
    vis = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    torch.testing.assert_close(eager(ids, attention_mask=vis).logits, sdpa(ids, attention_mask=vis).logits, rtol=0, atol=ATOL)
