"""Fused exact stages (:mod:`spiffy.fused_stages`): the batch-invariant mode's element-wise work compiled by
TorchInductor gives the eager stages' numbers bit for bit (every operation in a stage is exact, or the one last
rounding of each element), on random inputs; a stage that cannot compile runs eagerly; a captured step is kept per
numerics (a graph captured outside the mode never replays inside it); weights' integer copies kept for captured steps
are shared by every mode and die with the weight.

The fast tier compiles one variant of each linear stage (bfloat16, int8 digits, a bias; about 20 s on a CPU); the
slow tier every dtype, backend and bias, the mode's other stages, and whole decodes.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import spiffy
from spiffy import batch_invariance, fused_stages
from spiffy import exact_linear as exact_linear_module
from spiffy.arspec import ddtree_generate
from spiffy.batch_invariance import batch_invariant, exact_matmul, exact_sum, numerics
from spiffy.capture import StepGraphs
from spiffy.decoding import DecodeConfig
from spiffy.exact_linear import WeightGrid, activation_stage, digit_sums_stage, exact_linear
from spiffy.fused_stages import run_stage
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.loading import load_model
from spiffy.selfspec.freedave import chain_graph_for

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

LINEAR_STAGES = ("activation_stage", "digit_sums_stage", "finish_stage")


def _linear_case(rows: int, k: int, n: int, dtype: torch.dtype, outlier: float, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x[:, 0] *= 1.0 + outlier  # an activation outlier sets its row's grid
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _assert_fused(names: tuple[str, ...]) -> None:
    """The stages did run compiled (none fell back to eager), so an equality really compared two code paths."""
    assert not [key for key in fused_stages.FELL_BACK if key[0] in names], fused_stages.FELL_BACK
    assert all(fused_stages.compiled_stages().get(name) for name in names), fused_stages.compiled_stages()


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 7), st.integers(1, 70), st.integers(1, 20), st.sampled_from([0.0, 1e3]),
       st.integers(0, 2**31 - 1))
def test_a_fused_linear_layer_gives_the_eager_numbers(rows, k, n, outlier, seed) -> None:
    """The stages' own outputs (the activation's digits and grid; the digit sums in float64, before any rounding: a
    last-bit error shows) and the bfloat16 layer."""
    x, w, b = _linear_case(rows, k, n, torch.bfloat16, outlier, seed)
    grid = WeightGrid(int8=True, fused=False)
    digits, unscale = run_stage(activation_stage, False, x, True)
    fused_digits, fused_unscale = run_stage(activation_stage, True, x, True)
    assert torch.equal(digits, fused_digits) and torch.equal(unscale, fused_unscale)
    weight = grid.get(w)
    products = torch._int_mm(digits, weight.digits.t())
    sums = [run_stage(digit_sums_stage, fused, products, rows, n, unscale, weight.unscale, b, torch.float64)
            for fused in (False, True)]
    assert torch.equal(*sums)
    eager = exact_linear(grid, x, w, b)
    assert torch.equal(eager, exact_linear(WeightGrid(int8=True, fused=True), x, w, b))
    _assert_fused(("activation_stage", "digit_sums_stage"))


def _host_read_stage(x: torch.Tensor) -> torch.Tensor:
    """A stage TorchDynamo cannot trace as one graph: a host read decides a branch."""
    return x * 2 if x.sum().item() > 0 else x * 3


def test_a_stage_that_does_not_compile_runs_eagerly(monkeypatch) -> None:
    monkeypatch.setattr(fused_stages, "FELL_BACK", {})
    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="_host_read_stage did not compile here.*runs eagerly"):
        assert torch.equal(fused_stages.run_stage(_host_read_stage, True, x), x * 2)
    assert [name for name, _ in fused_stages.FELL_BACK] == ["_host_read_stage"]
    assert torch.equal(fused_stages.run_stage(_host_read_stage, True, -x), -x * 3)  # eager now, no second warning
    assert "_host_read_stage" not in fused_stages.compiled_stages()


def test_a_captured_step_is_kept_per_numerics() -> None:
    """A CUDA graph replays the kernels it was captured with: the default's step must not serve the mode."""
    built = []

    def factory(key):
        built.append((key, numerics()))
        return lambda: torch.ones(2)

    graphs = StepGraphs(factory, torch.device("cpu"), capture=False)
    graphs.run("bucket")
    graphs.run("bucket")
    with batch_invariant(fused=False):
        assert "bucket" not in graphs
        graphs.run("bucket")
        assert "bucket" in graphs
        with batch_invariant(fused=True):  # already on: the outer mode's numerics
            graphs.run("bucket")
    with batch_invariant(fused=True):
        graphs.run("bucket")
    assert "bucket" in graphs
    assert built == [("bucket", None), ("bucket", ("batch-invariant", False)), ("bucket", ("batch-invariant", True))]


def test_kept_weight_copies_are_shared_and_die_with_the_weight(monkeypatch) -> None:
    """On CUDA (:data:`~spiffy.exact_linear.KEEP_DEVICES`) a weight's integer copy outlives the mode (a graph
    captured in one block replays reading it in the next) and dies with the weight; elsewhere each mode has its
    own."""
    monkeypatch.setattr(exact_linear_module, "KEEP_DEVICES", {"cpu"})
    w = torch.randn(4, 8)
    copies = []
    for _ in range(2):
        with batch_invariant():
            copies.append(batch_invariance._ACTIVE[0].weights.get(w))
    assert copies[0] is copies[1]
    with torch.no_grad():
        w.mul_(2)  # a changed weight gets a new copy
    with batch_invariant():
        assert batch_invariance._ACTIVE[0].weights.get(w) is not copies[0]
    kept = weakref.ref(copies[0])
    del w, copies
    gc.collect()
    assert kept() is None
    monkeypatch.setattr(exact_linear_module, "KEEP_DEVICES", set())
    w = torch.randn(4, 8)
    with batch_invariant():
        first = batch_invariance._ACTIVE[0].weights.get(w)
    with batch_invariant():
        assert batch_invariance._ACTIVE[0].weights.get(w) is not first


# ------------------------------------------------------------------------------------------------ slow tier
@pytest.mark.slow  # every variant compiles (about 3 s each on a CPU)
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.integers(1, 70), st.integers(1, 20),
       st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]), st.booleans(), st.booleans(),
       st.sampled_from([0.0, 1.0, 1e3]), st.integers(0, 2**31 - 1))
def test_every_fused_linear_variant_gives_the_eager_numbers(rows, k, n, dtype, int8, bias, outlier, seed) -> None:
    x, w, b = _linear_case(rows, k, n, dtype, outlier, seed)
    b = b if bias else None
    eager = exact_linear(WeightGrid(int8=int8, fused=False), x, w, b)
    assert torch.equal(eager, exact_linear(WeightGrid(int8=int8, fused=True), x, w, b))
    _assert_fused(("activation_stage", "digit_sums_stage" if int8 else "finish_stage"))


@pytest.mark.slow  # each variant (dtype, sizes of 1 or more) compiles: about 3 s each on a CPU
@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.integers(1, 5),
       st.sampled_from([torch.bfloat16, torch.float32, torch.float64]), st.integers(0, 2**31 - 1))
def test_the_mode_s_other_fused_stages_give_the_eager_numbers(batch, queries, keys, dim, dtype, seed) -> None:
    """Exact sums (norms, softmax), exact matrix products (scores) and attention's weighted values."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 2, n, 8, generator=g).to(dtype) for n in (queries, keys, keys))
    terms = torch.randn(batch, queries, dim, generator=g).to(dtype) * 10.0 ** torch.randint(-3, 4, (1,), generator=g)
    runs = []
    for fused in (False, True):
        with batch_invariant(fused=fused):
            runs.append((exact_sum(terms, -1), exact_sum(terms, (0, 2), keepdim=True), exact_sum(terms),
                         exact_matmul(q, k.transpose(-1, -2)), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         F.rms_norm(terms, (dim,))))
    for eager, fused in zip(*runs):
        assert torch.equal(eager, fused)
    _assert_fused(("_grid_sum_stage", "grid_ints_stage"))


@pytest.mark.slow  # compiles the stages of two models' decodes
def test_fused_decodes_equal_the_eager_mode(tiny_llada, tmp_path) -> None:
    """End to end: a batched bfloat16 LLaDA decode with Spiffy's states, and DDTree on a Qwen3 target with a DFlash
    drafter, in the mode with fused stages (int8 digits, the CUDA backend) and eager ones: the same tokens."""
    llada = load_model(tiny_llada, dtype=torch.bfloat16)
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=4, cache="prefix", temperature=0.0)
    graph = chain_graph_for(llada, cfg, 3)  # FreeDave's chain: Spiffy's states without a calibration
    ids = torch.tensor([[0, 0, 11, 25, 47], [5, 9, 13, 17, 21]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    t = make_tiny_target(tmp_path / "target", seed=3, num_layers=2, with_tokenizer=False)
    d = make_tiny_dflash(tmp_path / "drafter", t, seed=4, num_layers=1, block_size=8)
    target, drafter = load_target(t, torch.bfloat16, "cpu"), load_drafter(d, dtype=torch.bfloat16)
    runs = []
    for fused in (False, True):
        with batch_invariant(fused=fused), pytest.MonkeyPatch.context() as patch:
            patch.setattr(exact_linear_module, "INT8_DEVICES", {"cpu"})
            dllm = spiffy.generate(llada, ids, cfg, attention_mask=mask, graph=graph, budget=3, batch_invariant=True)
            tree = ddtree_generate(target, drafter, [11, 25, 47, 3], method="ddtree", budget=8, max_new_tokens=12,
                                   temperature=0.0)
            runs.append((dllm.tokens, dllm.nfe, list(tree.tokens)))
    assert runs[0] == runs[1]
    _assert_fused(LINEAR_STAGES[:2] + ("_grid_sum_stage", "grid_ints_stage"))
