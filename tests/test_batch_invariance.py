"""Batch-invariant mode (issue 38, :mod:`spiffy.batch_invariance`): exact sums make a row's numbers independent of
the other rows, of padding and of the summation order, so batched rows, Spiffy states and tree nodes equal the
baseline bitwise in bfloat16 too.

The primitives are checked on random inputs (hypothesis): an exact sum does not move under permutation or inserted
zeros and stays within its error bound of the true sum; a linear layer's row and an attention query do not move
when other rows, queries or masked keys join the call; the linear layer's two backends (int8 digit products, what
CUDA runs, and float64) give the same integers, at the bounds too, within the stated error. End to end, batched rows that diverge in bfloat16 by default
(a dLLM case and an AR case) are identical under the mode; breaking the mode on purpose (default attention kernel
back in, or the padded row's positions counting its padding) brings the divergence back.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import spiffy
from spiffy import batch_invariance
from spiffy import exact_linear as exact_linear_module
from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig
from spiffy.batch_invariance import SUM_BITS, batch_invariant, exact_sum, is_batch_invariant
from spiffy.bench.batch_fidelity import explain_dllm_batch_row
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.errors import ConfigError
from spiffy.exact_linear import (ACTIVATION_BITS, MAX_REDUCTION, WEIGHT_BITS, WeightGrid, balanced_digits,
                                  exact_linear)
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

_values = st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(_values, st.randoms(use_true_random=False), st.integers(0, 5))
def test_exact_sum_ignores_order_and_zeros(values, rnd, zeros) -> None:
    t = torch.tensor(values, dtype=torch.float64)
    base = exact_sum(t, 0)
    shuffled = list(values) + [0.0] * zeros
    rnd.shuffle(shuffled)
    assert torch.equal(exact_sum(torch.tensor(shuffled, dtype=torch.float64), 0), base)
    bound = len(values) * 2.0 ** -(SUM_BITS - 1) * max(abs(v) for v in values)  # grid 2**(e - SUM_BITS) <= 2 max
    assert abs(float(base) - math.fsum(values)) <= bound


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(1, 24), st.sampled_from([torch.bfloat16, torch.float16]),
       st.integers(0, 2**31 - 1))
def test_linear_row_does_not_depend_on_other_rows(rows, k, n, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    with batch_invariant():
        whole = F.linear(x, w, b)
        alone = torch.cat([F.linear(x[r : r + 1], w, b) for r in range(rows)])
        assert torch.equal(whole, alone)
    ref = (x.double() @ w.double().t() + b.double()).to(dtype)
    assert torch.allclose(whole.double(), ref.double(), rtol=2e-2, atol=2e-2)  # as accurate as the dtype


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 70), st.integers(1, 20), st.sampled_from([torch.bfloat16, torch.float16,
       torch.float32]), st.sampled_from([0.0, 1.0, 1e3]), st.integers(0, 2**31 - 1))
def test_int8_digits_give_the_float64_products(rows, k, n, dtype, outlier, seed) -> None:
    """The CUDA backend (int8 digit products through ``torch._int_mm``, run here on the CPU) computes the very
    integers of the CPU's float64 product: outputs bitwise equal, so the suite's CPU runs prove a GPU's numbers. And
    the error against float64 stays within the stated bound (the grids' rounding, then the dtype's own)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    x[:, 0] *= 1.0 + outlier  # activation outliers: the grid follows the row's largest magnitude
    x, w, b = x.to(dtype), w.to(dtype), torch.randn(n, generator=g).to(dtype)
    cpu = exact_linear(WeightGrid(), x, w, b)
    grid = WeightGrid(int8=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exact_linear_module, "_ROWS_PER_CHUNK", 3)  # a weight's rows prepared in chunks: same copy
        assert torch.equal(exact_linear(WeightGrid(), x, w, b), cpu)
        digits = exact_linear(grid, x, w, b)
    assert grid.get(w).digits is not None and grid.get(w).ints is None  # the int8 backend did run
    assert torch.equal(cpu, digits)
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.t() + b.double()
    # half a grid step per term: at most 2**-bits of the row's largest magnitude
    grids = 1.01 * (x64.abs().sum(1, keepdim=True) * w64.abs().amax(1)[None] * 2.0**-WEIGHT_BITS
                    + x64.abs().amax(1, keepdim=True) * w64.abs().sum(1)[None] * 2.0**-ACTIVATION_BITS)
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((digits.double() - ref).abs() <= grids + ulp).all()


@given(st.lists(st.integers(-(2**22), 2**22), min_size=1, max_size=30))
def test_balanced_digits_write_every_integer_back(values) -> None:
    ints = torch.tensor(values + [2**22, -(2**22), 2**14, -(2**14)], dtype=torch.int64)
    digits = balanced_digits(ints, 3)
    assert digits.dtype == torch.int8
    assert torch.equal(sum(digits[i].long() << (8 * i) for i in range(3)), ints)
    small = ints[ints.abs() <= 2**14]
    assert torch.equal(sum(d.long() << (8 * i) for i, d in enumerate(balanced_digits(small, 2))), small)


def test_products_at_the_bounds_stay_exact() -> None:
    """The longest reduction (``MAX_REDUCTION`` terms) at the grids' largest integers (each row's first entry sets
    its grid: activation ``X`` near ``2**22``, weight ``W`` near ``2**14``), the other entries chosen so that their
    low digits are all -128 (a digit product sum near ``2**30``, int32's limit is ``2**31``): both backends give the
    exact products, computed here in Python integers."""
    k = MAX_REDUCTION
    big_x, big_w, low_x, low_w = 4194300, 16382, -32896, -128  # low_x digits (-128, -128, 0), low_w (-128, 0)
    x = torch.full((2, k), low_x * 2.0**-22, dtype=torch.float64)
    x[:, 0] = torch.tensor([big_x, -big_x]) * 2.0**-22
    w = torch.full((3, k), low_w * 2.0**-14, dtype=torch.float64)
    w[:, 0] = torch.tensor([big_w, -big_w, big_w]) * 2.0**-14
    w[2, 1:] = -low_w * 2.0**-14
    cpu = exact_linear(WeightGrid(), x, w)
    digits = exact_linear(WeightGrid(int8=True), x, w)
    assert torch.equal(cpu, digits)
    ints_x = [[big_x] + [low_x] * (k - 1), [-big_x] + [low_x] * (k - 1)]
    ints_w = [[big_w] + [low_w] * (k - 1), [-big_w] + [low_w] * (k - 1), [big_w] + [-low_w] * (k - 1)]
    exact = [[sum(a * b for a, b in zip(r, c)) * 2.0**-36 for c in ints_w] for r in ints_x]
    assert torch.equal(cpu, torch.tensor(exact, dtype=torch.float64))


@pytest.mark.parametrize("write", ["mul_", "setitem", "iadd", "out"])
@pytest.mark.parametrize("inference", [False, True])
def test_an_input_read_twice_is_rounded_once_until_written(write, inference) -> None:
    """Projections of one input (q / k / v) share its rounding; a write into it in place (a method ending in ``_``,
    ``x[i] = v``, ``x += y``, ``out=``), also on an inference tensor (no version counter), rounds it again."""
    g = torch.Generator().manual_seed(0)
    w1, w2, y = (torch.randn(5, 8, generator=g).bfloat16() for _ in range(3))
    context = torch.inference_mode() if inference else torch.no_grad()
    with context, batch_invariant():
        x = torch.randn(3, 8, generator=g).bfloat16()
        first = F.linear(x, w1)
        cached = batch_invariance._ACTIVE[0].weights.last
        assert cached is not None and cached[0] is x
        second = F.linear(x, w2)
        assert batch_invariance._ACTIVE[0].weights.last is cached  # shared
        before = x.clone()
        if write == "mul_":
            x.mul_(3)
        elif write == "setitem":
            x[0] = 7
        elif write == "iadd":
            x += y[:3]
        else:
            torch.add(x, 1, out=x)
        again = F.linear(x, w1)
    # the references, outside the mode (whose in-place calls would drop the cached rounding)
    assert torch.equal(first, exact_linear(WeightGrid(), before, w1))
    assert torch.equal(second, exact_linear(WeightGrid(), before, w2))
    assert torch.equal(again, exact_linear(WeightGrid(), x, w1)) and not torch.equal(again, first)


def test_a_longer_reduction_than_exact_products_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match="at most 65536 features.*fix"):
        exact_linear(WeightGrid(), torch.zeros(1, MAX_REDUCTION + 1), torch.zeros(2, MAX_REDUCTION + 1))


def test_the_int8_backend_decodes_the_same_tokens(llada_bf16, monkeypatch) -> None:
    """End to end in the mode: a batched bfloat16 LLaDA decode with Spiffy's states, the linear layers on int8
    digits (the CUDA backend) against float64 (the CPU's): the same tokens, the same forwards."""
    ids = torch.tensor([[0, 0, 11, 25, 47], [5, 9, 13, 17, 21]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    runs = []
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(exact_linear_module, "INT8_DEVICES", devices)
        out = spiffy.generate(llada_bf16, ids, attention_mask=mask, batch_invariant=True, **DLLM_KW)
        runs.append((out.tokens, out.nfe))
    assert runs[0] == runs[1]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 5), st.integers(1, 4), st.sampled_from([torch.bfloat16, torch.float64]),
       st.integers(0, 2**31 - 1))
def test_attention_query_ignores_masked_keys_and_other_queries(keys, pad, queries, dtype, seed) -> None:
    """A query's output is the same when masked keys are inserted (left padding, other tree branches) and when
    other queries share the call; and it is attention (close to torch's own kernel). float64 outputs show the
    grids' last bits, which a bfloat16 output would round away."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, queries, 8, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, keys, 8, generator=g).to(dtype) for _ in range(2))
    junk = torch.randn(1, 2, pad, 8, generator=g).to(dtype) * 50
    pos = torch.randperm(keys + pad, generator=g)[:keys].sort().values  # where the real keys land among the junk
    k2, v2 = (torch.cat([t, junk], dim=2) for t in (k, v))
    order = torch.cat([pos, torch.tensor([i for i in range(keys + pad) if i not in set(pos.tolist())], dtype=torch.long)])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(keys + pad)
    k2, v2 = k2[:, :, inv], v2[:, :, inv]
    mask = torch.zeros(keys + pad, dtype=torch.bool)
    mask[pos] = True
    with batch_invariant():
        plain = F.scaled_dot_product_attention(q, k, v)
        padded = F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask[None, None, None, :])
        single = torch.cat([F.scaled_dot_product_attention(q[:, :, i : i + 1], k, v) for i in range(queries)], dim=2)
    assert torch.equal(plain, padded) and torch.equal(plain, single)
    assert torch.allclose(plain.float(), F.scaled_dot_product_attention(q, k, v).float(), atol=3e-2)


def test_mode_is_scoped_and_checks_attention(tiny_llada) -> None:
    assert not is_batch_invariant()
    with batch_invariant():
        assert is_batch_invariant()
    assert not is_batch_invariant()
    # flex runs its own kernel; eager's probability-value matmul would round on grids spanning masked keys
    for impl in ("flex_attention", "eager"):
        model = load_model(tiny_llada, dtype=torch.bfloat16, attn_implementation=impl)
        with pytest.raises(ConfigError, match=f"attends with '{impl}'; fix: .*sdpa"):
            spiffy.generate(model, torch.tensor([[5, 6, 7]]), gen_length=4, block_length=4, steps=2,
                            batch_invariant=True)


# ------------------------------------------------------------------------------------------------ end to end
def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (3,), generator=g).tolist()
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in lengths]


#: a bfloat16 batched LLaDA row that leaves its prompt alone by default (tests/test_batch_near_ties.py: DLLM_CASES)
DLLM_KW = dict(gen_length=8, block_length=4, temperature=0.0, steps=4, cache="prefix")


@pytest.fixture(scope="module")
def llada_bf16(tiny_llada):
    return load_model(tiny_llada, dtype=torch.bfloat16)


def test_dllm_batched_row_is_bitwise_in_the_mode(llada_bf16) -> None:
    assert explain_dllm_batch_row(llada_bf16, _prompts(1), 2, None, overrides=DLLM_KW) is not None  # diverges
    with batch_invariant():
        assert explain_dllm_batch_row(llada_bf16, _prompts(1), 2, None, overrides=DLLM_KW) is None
    ids = torch.tensor([[0, 0, 11, 25, 47], [5, 9, 13, 17, 21]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = dict(DLLM_KW, gen_length=8)
    batched = spiffy.generate(llada_bf16, ids, attention_mask=mask, batch_invariant=True, **kw).tokens
    assert batched[0] == spiffy.generate(llada_bf16, torch.tensor([[11, 25, 47]]), batch_invariant=True, **kw).tokens[0]


@pytest.mark.parametrize("broken", ["attention", "positions"])
def test_a_broken_mode_diverges_again(llada_bf16, monkeypatch, broken) -> None:
    """Break the mode on purpose: torch's own attention kernel back in, or the padded row's positions counting its
    padding (the official LLaDA batch); the row then leaves its prompt alone again."""
    if broken == "attention":
        monkeypatch.setattr(batch_invariance, "_sdpa", F.scaled_dot_product_attention)
    else:
        monkeypatch.setattr("spiffy.decoding.base.is_batch_invariant", lambda: False)
    # which rows a broken mode moves depends on the mode's numbers: a bounded search over ragged batches finds one
    candidates = [(_prompts(1), 2)] + [(_prompts(seed), row) for seed in range(2, 14) for row in range(3)]
    with batch_invariant():
        found = next(((prompts, row, div) for prompts, row in candidates
                      if (div := explain_dllm_batch_row(llada_bf16, prompts, row, None, overrides=DLLM_KW))), None)
    assert found is not None, "no batched row moves under the broken mode: the break is not exercised"
    assert found[2].near_tie  # still rounding, proven, but no longer bitwise
    monkeypatch.undo()
    with batch_invariant():  # the same row, the mode whole again: bitwise
        assert explain_dllm_batch_row(llada_bf16, found[0], found[1], None, overrides=DLLM_KW) is None


@pytest.mark.slow  # about 50 s: the proof re-runs the decodes, in the mode's float64 arithmetic
def test_ar_batched_row_is_bitwise_in_the_mode(tmp_path) -> None:
    t = make_tiny_target(tmp_path / "target", seed=3, num_layers=3, with_tokenizer=False)
    d = make_tiny_dflash(tmp_path / "drafter", t, seed=4, num_layers=2, block_size=8)
    target, drafter = load_target(t, torch.bfloat16, "cpu"), load_drafter(d, dtype=torch.bfloat16)
    cfg = ARSpecConfig(method="dflash", budget=8, max_new_tokens=24, sampling=SamplingConfig(temperature=0.0, seed=2))
    # row 2 of the pinned batch diverges by default on an AVX2 CPU; which rows diverge is the CPU's business, so
    # a bounded search over further ragged batches finds one where it does not
    pinned = [[211, 38, 28, 43, 146, 239], [21, 7, 33, 145, 32], [171, 90, 219, 173]]
    candidates = [(pinned, 2)] + [(_prompts(seed), row) for seed in range(20) for row in range(3)]
    found = next(((prompts, row) for prompts, row in candidates
                  if explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), prompts, row, cfg) is not None), None)
    assert found is not None, "no batched AR row diverges by default on this machine: the mode is not exercised"
    with batch_invariant():
        assert explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), *found, cfg) is None
