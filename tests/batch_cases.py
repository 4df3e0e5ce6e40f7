"""Shared cases of the batched-decoding tests (baseline rows and Spiffy rows): ragged prompts, decoding kwargs and
the float64 tiny models (module fixtures: a test module imports them by name)."""

from __future__ import annotations

import pytest
import torch

from conftest import load_f64
from spiffy.decoding import make_session

#: generated positions and block length of every batched case; per-row seeds of the T > 0 cases
GEN, BLOCK = 16, 8
SEEDS = [7, 11, 5]


def ragged_prompts(lengths: list[int]) -> list[torch.Tensor]:
    """Random prompts (token ids 5..249, fixed seed) of the given lengths."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 250, (n,), generator=g) for n in lengths]


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, P], attention_mask [B, P])`` of ``prompts`` left-padded with ``pad_id`` to the longest."""
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), pad_id, dtype=torch.long)
    am = torch.zeros((len(prompts), p), dtype=torch.long)
    for r, x in enumerate(prompts):
        ids[r, p - len(x) :] = x
        am[r, p - len(x) :] = 1
    return ids, am


def static_forward_pairs(model, prompt: torch.Tensor, kw: dict, seed: int, blocks: int = 2):
    """``[(eager logits, static logits)]``, per block: two sessions of ``prompt [P]`` under ``kw``, one on the static
    path (``use_static``), each forwarding the same 3 states (the real one and two random ones) at each of the first
    ``blocks`` blocks, after the block-start forward (its logits a pair too, where it returns them). The states are
    copies, so a static path that read the session's own tensors, or padded the states, would show."""
    eager = make_session(model, prompt[None], **kw)
    static = make_session(model, prompt[None], **kw)
    static.use_static()
    g = torch.Generator().manual_seed(seed)
    out = []
    for block in range(blocks):
        first = eager.begin_block(block), static.begin_block(block)  # a cache's refresh: its window's logits
        if first[0] is not None:
            out.append(first)
        states = eager.x.repeat(3, 1)
        width = states.shape[1] - eager.prompt_len
        states[1:, eager.prompt_len:] = torch.randint(5, 250, (2, width), generator=g)
        out.append((eager.forward_states(states), static.forward_states(states)))
        eager.end_block(block)
        static.end_block(block)
    assert static.nfe == eager.nfe
    return out


def decode_kwargs(rule: str, cache: str, temp: float, **extra) -> dict:
    """``generate`` kwargs of one case: ``rule`` "static" (two tokens per step) or "threshold" (0.05)."""
    kw = dict(gen_length=GEN, block_length=BLOCK, cache=cache, temperature=temp, **extra)
    if rule == "static":
        kw["steps"] = GEN // 2
    else:
        kw["threshold"] = 0.05
    return kw


@pytest.fixture(scope="module")
def llada(tiny_llada):
    return load_f64(tiny_llada, cached=True)


@pytest.fixture(scope="module")
def llada_moe(tiny_llada_moe):
    return load_f64(tiny_llada_moe, cached=True)


@pytest.fixture(scope="module")
def dream(tiny_dream):
    return load_f64(tiny_dream, cached=True)


@pytest.fixture(scope="module")
def sdar(tiny_sdar):
    return load_f64(tiny_sdar, cached=True)


@pytest.fixture(scope="module")
def fast_dllm_v2(tiny_fast_dllm_v2):
    return load_f64(tiny_fast_dllm_v2, cached=True)


@pytest.fixture(scope="module")
def llada2(tiny_llada2):
    return load_f64(tiny_llada2, cached=True)


@pytest.fixture(scope="module")
def sdar_moe(tiny_sdar_moe):
    return load_f64(tiny_sdar_moe, cached=True)
