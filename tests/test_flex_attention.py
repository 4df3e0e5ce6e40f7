"""``attn_implementation="flex_attention"`` (flex_attention) against SDPA on every mask form the models see, on CPU.

Kernel level: bool block masks (tree / verification rows, a fully hidden row), additive float masks, no mask, GQA
and a batch-1 cache broadcast through :func:`spiffy.models.layers.attend`. Model level: the tiny LLaDA and SDAR in
float64 with left-padded ragged batches, a Spiffy-style 4-D mask and a baseline + Spiffy decode (tokens equal).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spiffy.api import generate
from spiffy.decoding import DecodeConfig
from spiffy.models import load_model, load_tokenizer
from spiffy.models.flex import flex_attend
from spiffy.models.layers import attend, prepare_forward
from spiffy.models.cache import KVCache
from spiffy.selfspec.calibrate import calibrate

torch.set_num_threads(1)


def _masks(batch: int, length: int, span: int, gen: torch.Generator) -> list[torch.Tensor | None]:
    tree = torch.rand(batch, 1, length, span, generator=gen) > 0.5
    tree[..., 0] = True
    hidden_row = tree.clone()
    hidden_row[:, :, 1] = True  # a row that sees every key ...
    additive = torch.where(tree, 0.0, -1e30).to(torch.float64)
    return [None, tree, torch.where(tree, 0.0, -3.0).to(torch.float64), additive, tree[:1]]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_flex_kernel_matches_sdpa(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    b, h, length, span, d = 2, 4, 5, 13, 8
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for n in (length, span, span))
    for mask in _masks(b, length, span, gen):
        m = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(dtype))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
        torch.testing.assert_close(flex_attend(q, k, v, m, 0.3), ref, rtol=tol, atol=tol)


def test_attend_with_cache_broadcast_and_gqa():
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(1)
    cache.append(0, torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64),
                 torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64))
    q = torch.randn(3, 4, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(3, 1, 4, 10, generator=gen) > 0.3
    outs = {}
    for impl in ("sdpa", "flex_attention", "eager"):
        ctx = prepare_forward(torch.zeros(3, 4, dtype=torch.long), 1, torch.float64, attention_mask=visible,
                              past_key_values=cache, cache_policy="read", attn_implementation=impl)
        outs[impl] = attend(q, k, v, 0, ctx)
    torch.testing.assert_close(outs["flex_attention"], outs["sdpa"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(outs["eager"], outs["sdpa"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["llada", "sdar"])
@torch.no_grad()  # flex_attention has no backward on CPU
def test_flex_model_forward_matches_sdpa(family, request):
    path: Path = request.getfixturevalue(f"tiny_{family}")
    sdpa = load_model(path, dtype="float64")
    flex = load_model(path, dtype="float64", attn_implementation="flex_attention")
    assert flex.config._attn_implementation == "flex_attention"
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (3, 9), generator=gen)
    pad = torch.ones(3, 9, dtype=torch.long)
    pad[1, :4] = 0  # a ragged (left-padded) row
    pad[2, :2] = 0
    spiffy_rows = torch.rand(3, 1, 9, 9, generator=gen) > 0.4  # verification-style custom visibility
    spiffy_rows |= torch.eye(9, dtype=torch.bool)
    for mask in (pad, spiffy_rows):
        a = sdpa(input_ids=ids, attention_mask=mask).logits
        b = flex(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)


def test_flex_decodes_like_sdpa(tiny_llada):
    sdpa = load_model(tiny_llada, dtype="float64")
    flex = load_model(tiny_llada, dtype="float64", attn_implementation="flex_attention")
    tok = load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=8, block_length=4, cache="prefix")
    graph = calibrate(sdpa, tok, ["def f(x):", "import os"], cfg, nodes=3, chat=False, progress=False)
    prompt = torch.tensor([tok.encode("class A:")])
    base = generate(sdpa, prompt, cfg, tokenizer=tok)
    for g in (None, graph):
        out = generate(flex, prompt, cfg, tokenizer=tok, graph=g, budget=3 if g is not None else None)
        assert out.tokens == base.tokens
