"""Property-based exactness (issue 29, item 6): decoding configurations drawn at random, every one checked against
its baseline.

dLLM: family x cache mode x rule (static schedule / threshold) x temperature x dtype (float64, float32, bfloat16) x
one prompt or a ragged batch x graph (the shipped graph's shape, the top-k chain, a random graph) x budget. Checked:
Spiffy == the baseline for every prompt alone (token for token, every dtype); batched Spiffy == the batched baseline
(every dtype); a batched row == its prompt alone (float32/float64 exactly; bfloat16 either equal or a divergence
proven a near tie by :mod:`spiffy.bench.batch_fidelity`).

AR: a tiny Qwen3 target x method (ar, dflash, ddtree with a DFlash drafter; deer, specdiff with a diffusion drafter)
x acceptance rule x temperature x dtype x budget x batch. Checked: under the coupled rule every method == plain AR
(float32/float64, any temperature; the rejection rule at T = 0 too); a batched row == its prompt alone (float32/
float64 exactly, bfloat16 equal or a proven near tie).

The default tier draws a fixed set of examples (``derandomize``: the same ones in CI) within about a minute of CPU;
``SPIFFY_PROPERTY_EXAMPLES=N`` draws ``N`` per test. The longer run (``*_long``: marked ``slow``, 10x the examples
from another seed, or ``N`` each) runs only with ``SPIFFY_PROPERTY_LONG=1``, so the default ``pytest -q`` stays within
its budget: ``SPIFFY_PROPERTY_LONG=1 SPIFFY_PROPERTY_EXAMPLES=500 python -m pytest -q tests/test_property_exactness.py
-m slow`` (about 1000 configurations, a few minutes). Every
failure such a run finds becomes a regular test; those of issue 29's randomized run are
``test_bounded_loops.py`` (the mask id winning), ``test_arspec_block_size.py`` (a block beyond the drafter's, also
drawn here), ``test_tiny_drafter_maker.py``, ``test_batch_near_ties.py`` and ``test_compat_batches.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st
from property_tiers import fast_settings as _settings
from property_tiers import long_run
from property_tiers import long_settings as _long_settings

from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, speculative_generate, speculative_generate_batch
from spiffy.arspec.dllm_drafter import as_drafter
from spiffy.bench.batch_fidelity import explain_dllm_batch_row
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.loading import load_model
from spiffy.selfspec.freedave import chain_formulas
from spiffy.selfspec.graph import DraftGraph, load_graph
from spiffy.selfspec.oracle import random_formulas

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

REPO = Path(__file__).resolve().parent.parent
GEN, BLOCK = 8, 4


# ------------------------------------------------------------------------------------------------------ dLLM
_MODELS: dict[tuple[str, str], Any] = {}


@pytest.fixture(scope="module")
def dllm_paths(tiny_llada, tiny_llada_moe, tiny_dream, tiny_sdar, tiny_sdar_moe, tiny_fast_dllm_v2,
               tiny_llada2) -> dict[str, Path]:
    return {"llada": tiny_llada, "llada_moe": tiny_llada_moe, "dream": tiny_dream, "sdar": tiny_sdar,
            "sdar_moe": tiny_sdar_moe, "fast_dllm_v2": tiny_fast_dllm_v2, "llada2": tiny_llada2}


def _dllm(paths: dict[str, Path], family: str, dtype: str) -> Any:
    if (family, dtype) not in _MODELS:
        _MODELS[family, dtype] = load_model(paths[family], dtype=getattr(torch, dtype))
    return _MODELS[family, dtype]


def _graph(kind: str, family: str, levels: int, graph_seed: int) -> DraftGraph:
    """A graph of the drawn shape, without a ``calibrated_for`` section (any configuration may run it)."""
    if kind == "shipped":
        shipped = load_graph(REPO / "graphs" / ("tiny-sdar-s1.json" if family.startswith("sdar") else "tiny-llada-s1.json"))
        formulas = [(n.level, n.pairs) for n in shipped.nodes]
    elif kind == "chain":
        formulas = chain_formulas(levels)
    else:
        formulas = random_formulas(levels, 6, graph_seed, BLOCK, 3)
    return DraftGraph.from_formulas(formulas)


dllm_cases = st.fixed_dictionaries({
    "family": st.sampled_from(["llada", "llada_moe", "dream", "sdar", "sdar_moe", "fast_dllm_v2", "llada2"]),
    "cache": st.sampled_from(["none", "prefix", "dual"]),
    "rule": st.sampled_from(["static", "threshold"]),
    "steps_per_block": st.sampled_from([1, 2, 4]),
    "threshold": st.sampled_from([0.05, 0.3]),
    "temperature": st.sampled_from([0.0, 0.7]),
    "dtype": st.sampled_from(["float64", "float32", "bfloat16"]),
    "lengths": st.lists(st.integers(1, 7), min_size=1, max_size=3),
    "prompt_seed": st.integers(0, 10_000),
    "graph": st.sampled_from(["shipped", "chain", "random"]),
    "levels": st.integers(1, 3),
    "budget": st.integers(0, 6),
    "seed": st.integers(0, 1000),
})


def _dllm_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = dict(gen_length=GEN, block_length=BLOCK, temperature=case["temperature"], seed=case["seed"])
    if case["family"] == "fast_dllm_v2":  # its rule: sub-blocks and a threshold (1.0: one token per step)
        kw["small_block_size"] = (2, 4)[case["seed"] % 2]
        kw["threshold"] = 1.0 if case["rule"] == "static" else case["threshold"]
        return kw
    if case["family"] == "llada2":  # LLaDA2.0: the official whole-window recompute or the committed-block cache
        kw["cache"] = "none" if case["cache"] == "none" else "prefix"
    elif not case["family"].startswith("sdar"):
        kw["cache"] = case["cache"]
    if case["family"] == "dream":
        kw["alg"] = ("maskgit_plus", "entropy", "topk_margin")[case["seed"] % 3]
        if case["seed"] % 2:  # the Dream-Coder / DiffuCoder calls: top_p 0.95 and the model config's top_k 50
            kw.update(top_p=0.95, top_k=50)
    if case["rule"] == "static":
        kw["steps"] = case["steps_per_block"] * (GEN // BLOCK)
        if case["family"] == "llada2":
            kw["threshold"] = 1.0  # LLaDA2's rule is always thresholded: 1.0 is never crossed, the schedule decides
    else:
        kw["threshold"] = case["threshold"]
    return kw


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, None if bool(mask.all()) else mask


def check_dllm_case(paths: dict[str, Path], case: dict[str, Any]) -> None:
    """Spiffy == baseline alone; batched Spiffy == batched baseline; batched row == alone (or a proven near tie)."""
    model = _dllm(paths, case["family"], case["dtype"])
    kw = _dllm_kwargs(case)
    g = torch.Generator().manual_seed(case["prompt_seed"])
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in case["lengths"]]
    graph = _graph(case["graph"], case["family"], case["levels"], case["seed"])
    alone = []
    for p in prompts:
        base = generate(model, torch.tensor([p]), **kw)
        spec = generate(model, torch.tensor([p]), graph=graph, budget=case["budget"], **kw)
        assert spec.tokens == base.tokens, f"Spiffy differs from the baseline for {case}"
        assert spec.nfe <= base.nfe
        alone.append(base.tokens[0])
    if len(prompts) < 2:
        return
    ids, mask = _left_pad(prompts)
    base = generate(model, ids, attention_mask=mask, **kw)
    spec = generate(model, ids, attention_mask=mask, graph=graph, budget=case["budget"], **kw)
    assert spec.tokens == base.tokens, f"batched Spiffy differs from the batched baseline for {case}"
    for r, tokens in enumerate(base.tokens):
        if tokens == alone[r]:
            continue
        assert case["dtype"] == "bfloat16", f"row {r} differs from its prompt alone in {case['dtype']} for {case}"
        div = explain_dllm_batch_row(model, prompts, r, None, overrides=kw)
        # a mixture-of-experts family's divergence is proven too: by the logit rule, or (a router near tie flipped
        # by rounding sends a token to another expert, moving the logits beyond rounding) by the router kind
        assert div is not None and div.near_tie, f"row {r}: not a proven near tie ({div}) for {case}"


@given(case=dllm_cases)
@_settings(24)
def test_dllm_spiffy_and_batches_are_exact(dllm_paths, case) -> None:
    check_dllm_case(dllm_paths, case)


@pytest.mark.slow
@long_run
@seed(29)
@given(case=dllm_cases)
@_long_settings(24)
def test_dllm_spiffy_and_batches_are_exact_long(dllm_paths, case) -> None:
    check_dllm_case(dllm_paths, case)


# -------------------------------------------------------------------------------------------------------- AR
@pytest.fixture(scope="module")
def ar_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prop_ar")
    target = make_tiny_target(root / "target", seed=3, num_layers=2)
    return {
        "target": target,
        "dflash": make_tiny_dflash(root / "dflash", target, seed=4, num_layers=1, block_size=6),
        "dllm": make_tiny_dllm_drafter(root / "dllm", target, seed=5, block_size=6),
    }


_AR: dict[str, Any] = {}


def _ar_models(paths: dict[str, Path], dtype: str) -> tuple[Any, Any, Any]:
    if dtype not in _AR:
        dt = getattr(torch, dtype)
        _AR[dtype] = (load_target(paths["target"], dt, "cpu"), load_drafter(paths["dflash"], dtype=dt),
                      load_ar_drafter(paths["dllm"], dtype=dt))
    return _AR[dtype]


ar_cases = st.fixed_dictionaries({
    "method": st.sampled_from(["ar", "dflash", "ddtree", "deer", "specdiff"]),
    "accept": st.sampled_from(["coupled", "rejection"]),
    "temperature": st.sampled_from([0.0, 0.8]),
    "dtype": st.sampled_from(["float64", "float32", "bfloat16"]),
    "budget": st.integers(1, 10),
    "drafts": st.integers(1, 3),
    "lengths": st.lists(st.integers(2, 8), min_size=1, max_size=3),
    "prompt_seed": st.integers(0, 10_000),
    "max_new_tokens": st.integers(1, 14),
    "block_size": st.sampled_from([None, None, 2, 6, 7]),  # the drafters' block is 6: 7 must be refused
    "seed": st.integers(0, 1000),
})


def check_ar_case(paths: dict[str, Path], case: dict[str, Any]) -> None:
    """Coupled (and greedy) methods == plain AR; a batched row == its prompt alone (or a proven near tie)."""
    target, dflash, dllm = _ar_models(paths, case["dtype"])
    sampling = SamplingConfig(temperature=case["temperature"], seed=case["seed"])
    cfg = ARSpecConfig(method=case["method"], budget=case["budget"], drafts=case["drafts"], accept=case["accept"],
                       max_new_tokens=case["max_new_tokens"], block_size=case["block_size"], sampling=sampling)
    model = None if case["method"] == "ar" else (dllm if case["method"] in ("deer", "specdiff") else dflash)
    if model is not None and case["block_size"] == 7:  # beyond the drafter's block: a typed error, before any work
        with pytest.raises(ConfigError, match="drafter's block of 6"):
            speculative_generate(target, DFlashDrafter(dflash) if model is dflash else as_drafter(dllm), [5, 6], cfg)
        return

    def make_drafter() -> Any:
        return None if model is None else (as_drafter(model) if model is dllm else DFlashDrafter(model))

    g = torch.Generator().manual_seed(case["prompt_seed"])
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in case["lengths"]]
    exact = case["dtype"] != "bfloat16"
    alone = []
    for p in prompts:
        out = speculative_generate(target, make_drafter(), p, cfg).tokens
        if exact and (case["accept"] == "coupled" or case["temperature"] == 0):
            ar = speculative_generate(target, None, p, ARSpecConfig(method="ar", max_new_tokens=cfg.max_new_tokens,
                                                                    sampling=sampling)).tokens
            assert out == ar, f"{case['method']} differs from AR for {case}"
        alone.append(out)
    if len(prompts) < 2:
        return
    drafters = None if model is None else [make_drafter() for _ in prompts]
    batched = speculative_generate_batch(target, drafters, prompts, cfg)
    for r, res in enumerate(batched):
        if res.tokens == alone[r]:
            continue
        assert not exact, f"row {r} differs from its prompt alone in {case['dtype']} for {case}"
        div = explain_ar_batch_row(target, None if model is None else make_drafter, prompts, r, cfg)
        assert div is not None and div.near_tie, f"row {r}: not a proven near tie ({div}) for {case}"


@given(case=ar_cases)
@_settings(24)
def test_ar_methods_and_batches_are_exact(ar_paths, case) -> None:
    check_ar_case(ar_paths, case)


@pytest.mark.slow
@long_run
@seed(29)
@given(case=ar_cases)
@_long_settings(24)
def test_ar_methods_and_batches_are_exact_long(ar_paths, case) -> None:
    check_ar_case(ar_paths, case)
