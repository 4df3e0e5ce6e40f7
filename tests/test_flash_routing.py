"""``attn_implementation="flash_attention_2"`` on the dLLM families: flash-attn only where no mask is needed.

flash-attn cannot be installed on this CPU-only machine, so these tests check what can be checked without it:
the typed error at load time, that masked forwards never reach flash-attn (they run, equal to SDPA, with flash-attn
absent and the kernel declared usable), and the routing itself with a stand-in kernel that records its calls and
computes the same attention with SDPA (mask-free LLaDA forwards -> non-causal flash calls, SDAR's default causal
forward -> causal flash calls; a baseline and a Spiffy decode through the routed path equal the SDPA ones). The
real flash-attn kernel (numerics, CUDA dispatch) is untested here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import spiffy.models.flash as flash_module
import spiffy.models.layers as layers_module
from spiffy.api import generate
from spiffy.decoding import DecodeConfig
from spiffy.errors import MissingDependencyError
from spiffy.models import load_model, load_tokenizer
from spiffy.models.flash import FLASH
from spiffy.selfspec.calibrate import calibrate

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def reference_flash(calls: list[bool]):  # noqa: ANN201
    """A stand-in for ``flash_attn_func`` (``[B, L, H, D]`` layout, GQA, bottom-right causal) computed with SDPA."""

    def kernel(q, k, v, softmax_scale=None, causal=False):  # noqa: ANN001, ANN202
        calls.append(bool(causal))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        length, span = q.shape[2], k.shape[2]
        mask = torch.arange(span)[None] <= torch.arange(length)[:, None] + span - length if causal else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)\
            .transpose(1, 2)

    return kernel


@pytest.fixture
def no_flash_attn(monkeypatch):
    """flash-attn absent (``import flash_attn`` fails) and nothing cached from an earlier import."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(flash_module, "_KERNEL", [])


@pytest.fixture
def stand_in_flash(monkeypatch):
    calls: list[bool] = []
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=reference_flash(calls)))
    monkeypatch.setattr(flash_module, "_KERNEL", [])
    monkeypatch.setattr(layers_module, "flash_applicable", lambda q: True)  # as on a CUDA half-precision tensor
    return calls


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_missing_flash_attn_is_a_typed_error_at_load(family, request, no_flash_attn):
    path = request.getfixturevalue(f"tiny_{family}")
    with pytest.raises(MissingDependencyError, match=r"pip install 'spiffy-decoding\[flash\]'"):
        load_model(path, dtype="float32", attn_implementation=FLASH)


@pytest.mark.parametrize("family", ["llada", "sdar"])
@torch.no_grad()
def test_masked_forwards_never_need_flash_attn(family, request, no_flash_attn, monkeypatch):
    path = request.getfixturevalue(f"tiny_{family}")
    sdpa = load_model(path, dtype="float64")
    routed = load_model(path, dtype="float64")
    routed.config._attn_implementation = FLASH  # as a flash load leaves it (the load itself needs flash-attn)
    monkeypatch.setattr(layers_module, "flash_applicable", lambda q: True)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (3, 9), generator=gen)
    pad = torch.ones(3, 9, dtype=torch.long)
    pad[1, :4] = 0  # ragged left-padded rows
    tree = (torch.rand(3, 1, 9, 9, generator=gen) > 0.4) | torch.eye(9, dtype=torch.bool)  # verification rows
    for mask in (pad, tree):
        torch.testing.assert_close(routed(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)
    with pytest.raises(MissingDependencyError):  # while a mask-free call does go to flash-attn
        routed(ids)


@pytest.mark.parametrize("family,causal", [("llada", False), ("sdar", True)])
@torch.no_grad()
def test_mask_free_forwards_route_to_flash(family, causal, request, stand_in_flash):
    path = request.getfixturevalue(f"tiny_{family}")
    routed = load_model(path, dtype="float64", attn_implementation=FLASH)
    assert routed.config._attn_implementation == FLASH
    sdpa = load_model(path, dtype="float64")
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(routed(ids).logits, sdpa(ids).logits, rtol=1e-10, atol=1e-10)
    layers = routed.config.num_hidden_layers if family == "sdar" else routed.config.n_layers
    assert stand_in_flash == [causal] * layers  # every layer of the mask-free forward went to the flash kernel
    stand_in_flash.clear()
    routed(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))  # an explicit mask: SDPA, whatever its content
    assert stand_in_flash == []


def test_decodes_through_the_routed_path_equal_sdpa(tiny_llada, stand_in_flash):
    sdpa = load_model(tiny_llada, dtype="float64")
    routed = load_model(tiny_llada, dtype="float64", attn_implementation=FLASH)
    tok = load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=8, block_length=4, cache="prefix")
    graph = calibrate(sdpa, tok, ["def f(x):", "import os"], cfg, nodes=3, chat=False, progress=False)
    prompt = torch.tensor([tok.encode("class A:")])
    base = generate(sdpa, prompt, cfg, tokenizer=tok)
    for g in (None, graph):
        stand_in_flash.clear()
        out = generate(routed, prompt, cfg, tokenizer=tok, graph=g, budget=3 if g is not None else None)
        assert out.tokens == base.tokens
        assert stand_in_flash  # some calls of the decode were mask-free and went to the flash kernel
