"""Losslessness in half precision (bfloat16, float16), measured where users run it.

* Spiffy: the verification forward evaluates each candidate state as one row of a batch of same-shaped rows, which
  computes every row exactly as the baseline's batch-1 forward; so Spiffy equals its baseline **token for token**
  in bfloat16 and float16 too, in every cache mode (tiny random LLaDA/Dream/SDAR and the shipped trained LLaDA with
  its shipped graph). Any difference fails.
* DFlash/DDTree: the tree verification forward has a different shape from AR's one-row decode, so half-precision
  logits differ by rounding; outputs may then diverge at a near tie. Every divergence must be one by the rule of
  :mod:`spiffy.bench.fidelity` (same state, AR's rule replayed on the tree's logits, logits and the flipped top-2 gap
  within rounding: :func:`spiffy.bench.spec_fidelity.prove_ar_divergence`); anything else fails. That the proof can
  refuse: tests/test_spec_near_ties.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, ddtree_generate
from spiffy.models import load_drafter, make_tiny_dflash, make_tiny_target
from spiffy.bench.fidelity import NEAR_TIE_ULPS, rounding_bound, spacing
from spiffy.bench.spec_fidelity import prove_ar_divergence
from spiffy.decoding import make_session
from spiffy.api import generate
from spiffy.embedded import embedded_model_path
from spiffy.models.loading import load_model
from spiffy.models import load_tokenizer
from spiffy.selfspec.graph import load_graph
from spiffy.selfspec.oracle import record_trajectory
from spiffy.selfspec.prompts import prompt_token_ids
from test_spiffy_runtime import BLOCK, GEN, SDAR_RULES, _bidir_kw, _check, _prompt

REPO = Path(__file__).resolve().parent.parent
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16", marks=pytest.mark.slow)]


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


_MODELS: dict[tuple[str, torch.dtype], tuple[torch.nn.Module, float]] = {}


def _model(request: pytest.FixtureRequest, family: str, dtype: torch.dtype) -> tuple[torch.nn.Module, float]:
    """The tiny random checkpoint in ``dtype`` and a threshold crossing a few positions per step (90th pct)."""
    if (family, dtype) not in _MODELS:
        model = load_model(request.getfixturevalue(f"tiny_{family}"), dtype=dtype)
        recs = record_trajectory(make_session(model, _prompt(), gen_length=GEN, block_length=BLOCK))
        conf = torch.cat([r.logits[0].float().softmax(-1).max(-1).values for r in recs])
        _MODELS[family, dtype] = (model, float(torch.quantile(conf, 0.9)))
    return _MODELS[family, dtype]


# ------------------------------------------------------------------------------------------ Spiffy: bitwise
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_spiffy_lossless_in_half_precision(request, family, cache, dtype):
    model, thr = _model(request, family, dtype)
    extra = {"alg": "entropy"} if family == "dream" else {}
    _check(model, _bidir_kw("several_per_step", cache, 1.0, thr, **extra))
    _check(model, _bidir_kw("threshold", cache, 0.0, thr, **({"alg": "topk_margin"} if extra else {})))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", ["several_per_step", "threshold"])
def test_spiffy_sdar_lossless_in_half_precision(request, rule, dtype):
    model, thr = _model(request, "sdar", dtype)
    kw = dict(gen_length=GEN, block_length=BLOCK, temperature=1.0, seed=7, **SDAR_RULES[rule])
    if rule == "threshold":
        kw.update(threshold=thr, temperature=0.0)
    _check(model, kw)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "graph_name"), [("dllm", "tiny-sdar-s1"), ("dllm-llada", "tiny-llada-s1")])
def test_spiffy_shipped_model_and_graph_in_bfloat16(kind, graph_name):
    """The shipped trained dLLMs (tiny-sdar, tiny-llada) with their shipped graphs: Spiffy == baseline on code
    prompts in bfloat16."""
    model_dir = embedded_model_path(kind)
    model = load_model(model_dir, dtype=torch.bfloat16)
    tok = load_tokenizer(model_dir)
    graph = load_graph(REPO / "graphs" / f"{graph_name}.json")
    kw = dict(gen_length=64, block_length=32, steps=64)
    accepted = 0
    for text in ("def fib(n):\n", "import os\n\ndef list_files(path):\n"):
        ids = torch.tensor([prompt_token_ids(tok, text, chat=False)])
        base = generate(model, ids, **kw)
        spec = generate(model, ids, graph=graph, budget=5, **kw)
        assert torch.equal(spec.sequences, base.sequences)
        assert spec.nfe < base.nfe
        accepted += base.nfe - spec.nfe
    assert accepted > 0


# ------------------------------------------------------------------------------------------ AR: near ties only
def _ar_runs(target, drafter, prompts, new_tokens):  # noqa: ANN001
    """(method, prompt, divergence or None) of DFlash and DDTree against plain AR, greedy."""
    out = []
    for ids in prompts:
        ar = ddtree_generate(target, None, ids, method="ar", max_new_tokens=new_tokens).tokens
        for method, budget in (("dflash", None), ("ddtree", 16)):
            spec = ddtree_generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=new_tokens).tokens
            proof = None
            if spec != ar:
                cfg = ARSpecConfig(method=method, max_new_tokens=new_tokens, sampling=SamplingConfig(temperature=0.0),
                                   **({} if budget is None else {"budget": budget}))
                proof = prove_ar_divergence(target, as_drafter(drafter), ids, cfg, outputs=(ar, spec))
                assert proof is not None, f"{method}: the divergence from AR did not reproduce in the proof's re-run"
            out.append((method, ids, proof))
    return out


@pytest.mark.slow  # the rule itself: tests/test_spec_near_ties.py (fast)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ar_divergences_are_near_ties_on_the_shipped_pair(dtype):
    target_dir = embedded_model_path("ar-target")
    target = load_model(target_dir, dtype=dtype)
    drafter = load_drafter(embedded_model_path("ar-drafter"), dtype=dtype)
    tok = load_tokenizer(target_dir)
    texts = ["def add(a, b):\n", "Write a function that reverses a string.", "def is_prime(n):\n", "import math\n"]
    runs = _ar_runs(target, drafter, [prompt_token_ids(tok, t, chat=True) for t in texts], 32)
    for method, _ids, div in runs:
        assert div is None or div.near_tie, f"{method} diverged from AR beyond rounding: {div}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_ar_divergences_are_near_ties_on_a_tiny_random_pair(tmp_path, dtype):
    target_dir = make_tiny_target(tmp_path / "target", seed=3, num_layers=3, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(tmp_path / "drafter", target_dir, seed=4, num_layers=2, block_size=8)
    target = load_model(target_dir, dtype=dtype)
    drafter = load_drafter(drafter_dir, dtype=dtype)
    prompts = [torch.randint(0, 250, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    for method, _ids, div in _ar_runs(target, drafter, prompts, 24):
        assert div is None or div.near_tie, f"{method} diverged from AR beyond rounding: {div}"


def test_rounding_bound_is_ulps_of_the_larger_logit():
    assert spacing(1.0, torch.bfloat16) == 2.0**-7
    assert spacing(5.0, torch.bfloat16) == 2.0**-5  # 4 <= 5 < 8: ulp = 4 * 2**-7
    assert spacing(-5.0, torch.float16) == 2.0**-8
    assert rounding_bound(3.0, -5.0, torch.bfloat16) == NEAR_TIE_ULPS * 2.0**-5
    assert spacing(0.0, torch.float32) > 0
