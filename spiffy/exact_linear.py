"""Exact integer products for the batch-invariant mode's linear layers, the same numbers on a CPU and a GPU.

A row of a linear layer's output must not depend on the other rows of the call. The mode gets that by making every
dot product an exact integer: each row of ``x`` and each row of the weight is rounded to integers on a grid fixed
by the row's largest magnitude (:func:`power_grid`: ``ACTIVATION_BITS`` and ``WEIGHT_BITS`` bits below it), so the
dot product over ``K <= MAX_REDUCTION`` terms is an integer below ``2**52``, and any kernel, blocking or summation
order computes it exactly. Two backends compute that same integer:

* **float64** (a CPU, or any device without int8 matrix products): one float64 matrix product of the integer
  copies; every product is below ``2**36`` and every partial sum an integer below ``2**53``, so no rounding occurs.
* **int8 digits** (CUDA, :data:`INT8_DEVICES`): each integer written as balanced base-256 digits (``int8``, three
  for an activation, two for a weight), one ``torch._int_mm`` (int8 tensor cores, int32 accumulation: exact below
  ``2**31``) of the stacked activation digits by the stacked weight digits, and the digit products scaled by their
  places and added in float64 (integers below ``2**53``: exact in any order).
  The weights' digits take as many bytes as bfloat16 weights, so a batch-1 decode reads what the default mode
  reads (a float64 copy would read four times as much, at a GPU's float64 rate).

Both give the exact integer, so they agree bit for bit (``tests/test_batch_invariance.py`` runs the int8 backend on
a CPU and compares); the suite's CPU runs therefore prove the arithmetic a GPU runs. The result is then scaled back
by powers of two (exact) in float64, the bias added, and cast to ``x``'s dtype. The element-wise work around the
product is written as stages (:func:`activation_stage`, :func:`digit_sums_stage`, :func:`finish_stage`), which run
compiled into a few kernels on CUDA (:mod:`spiffy.fused_stages`: the same numbers).

Accuracy: a weight keeps ``WEIGHT_BITS`` = 14 bits below its row's largest magnitude (every bfloat16 weight within
``2**6`` of it exactly), an activation 22 bits below its row's (outliers 1000x the typical value still leave ~12
bits); the default bfloat16 product rounds its output to 8 bits.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from spiffy.errors import ConfigError
from spiffy.fused_stages import fuses, run_stage

#: integer bits of a weight row below its largest magnitude (two balanced base-256 digits)
WEIGHT_BITS = 14
#: integer bits of an activation row below its largest magnitude (three balanced base-256 digits)
ACTIVATION_BITS = 22
#: the longest reduction whose integer dot products stay exact in float64 (< 2**53) and in int32 digit sums (< 2**31)
MAX_REDUCTION = 2**16
#: device types whose products run on int8 digits (``torch._int_mm``); the others in float64
INT8_DEVICES = {"cuda"}

_WEIGHT_DIGITS, _ACTIVATION_DIGITS = 2, 3
_ROWS_PER_CHUNK = 4096


def power_grid(x: torch.Tensor, dim: int | tuple[int, ...], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, unscale)``: powers of two (float64, ``keepdim`` over ``dim``) such that ``x * scale`` (``x``
    float64) has magnitude at most ``2**bits`` over ``dim`` (``2**(bits - 1)`` or more for its largest element,
    unless all are zero).

    Read from the exponent field of the largest magnitude (``max |x|`` lies in ``[2**(f - 1023), 2**(f - 1022))``
    for field ``f``) and written as an exponent field: six elementwise kernels where ``frexp`` and ``2.0 ** k``
    take eleven, which a captured step on a GPU pays per call."""
    top = torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True)  # max |x|: exact
    field = top.view(torch.int64) >> 52  # the sign bit is 0
    scale = ((bits + 2045 - field).clamp_(1, 2046) << 52).view(torch.float64)
    return scale, torch.reciprocal(scale)  # a power of two's reciprocal: exact


def grid_ints_stage(x: torch.Tensor, dims: int | tuple[int, ...], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(round(x * scale), unscale)`` in float64 on :func:`power_grid`'s grids of ``bits`` over ``dims``: ``x`` as
    integers, one grid per slice (a stage, :func:`~spiffy.fused_stages.run_stage`: every operation exact)."""
    x64 = x.to(torch.float64)
    scale, unscale = power_grid(x64, dims, bits)
    return torch.round(x64 * scale), unscale


def balanced_digits(ints: torch.Tensor, count: int) -> torch.Tensor:
    """``[count, *ints.shape]`` int8: base-256 digits in ``[-128, 127]``, least significant first, of the int64
    ``ints`` (``sum(d[i] * 256**i) == ints`` when ``|ints| <= 2**(8 * count - 2)``).

    Adding ``128 * (1 + 256 + ...)`` makes every value non-negative and every digit its byte minus 128 (the top
    one unmasked): one broadcast over the shifts instead of a carry loop (fewer kernels on a GPU)."""
    # eager, the constants are built once per device (a captured step must not copy host lists at each call);
    # compiled, they fold into the kernel (TorchDynamo would warn of the cache)
    constants = _digit_constants.__wrapped__ if torch.compiler.is_compiling() else _digit_constants
    bias, shifts, masks = constants(count, ints.dim(), ints.device)
    return ((((ints + bias).unsqueeze(0) >> shifts) & masks) - 128).to(torch.int8)


@functools.lru_cache(maxsize=64)
def _digit_constants(count: int, dims: int, device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(bias, shifts, masks)`` of :func:`balanced_digits` (built once per device: a captured step reads them)."""
    shape = (count,) + (1,) * dims
    shifts = torch.arange(0, 8 * count, 8, device=device).reshape(shape)
    masks = torch.tensor([255] * (count - 1) + [-1], device=device).reshape(shape)  # the top digit keeps its bits
    return sum(128 << (8 * i) for i in range(count)), shifts, masks


def activation_stage(x: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` on its rows' grids (a stage: :func:`~spiffy.fused_stages.run_stage`): ``(form, unscale [M, 1])``
    with ``form`` the float64 integers ``[M, K]``, or (``int8``) their balanced digits stacked ``[Dx * M, K]``
    (digit ``i`` of row ``m`` at row ``i * M + m``) and zero-padded (exact) to what ``torch._int_mm`` takes on CUDA:
    more than 16 rows, ``K'`` and the row count multiples of 8."""
    m, k = x.shape
    ints, unscale = grid_ints_stage(x, -1, ACTIVATION_BITS)
    if not int8:
        return ints, unscale
    rows = _ACTIVATION_DIGITS * m
    stacked = balanced_digits(ints.to(torch.int64), _ACTIVATION_DIGITS).reshape(rows, k)
    return torch.nn.functional.pad(stacked, (0, (-k) % 8, 0, max(17 - rows, (-rows) % 8))), unscale


def digit_sums_stage(products: torch.Tensor, m: int, n: int, unscale: torch.Tensor, w_unscale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The int8 backend's output from the digit products (a stage): ``products [rows', Dw * N']`` int32 (activation
    digit ``i`` of row ``m`` times weight digit ``j`` of column ``n`` at ``[i * M + m, j * N' + n]``) -> ``[M, n]``.

    Each product scaled by its place ``256 ** (i + j)`` and summed in float64: integers below ``2**53``, exact in
    any order; then :func:`finish_stage`."""
    dx, dw = _ACTIVATION_DIGITS, _WEIGHT_DIGITS
    padded_n = products.shape[1] // dw
    places = (_places.__wrapped__ if torch.compiler.is_compiling() else _places)(dx, dw, products.device)
    sums = (products[: dx * m].reshape(dx, m, dw, padded_n).to(torch.float64) * places).sum(dim=(0, 2))
    return finish_stage(sums[:, :n], unscale, w_unscale, bias, dtype)


@functools.lru_cache(maxsize=64)
def _places(dx: int, dw: int, device: torch.device) -> torch.Tensor:
    """``[Dx, 1, Dw, 1]`` float64: ``256 ** (i + j)``, the place of activation digit ``i`` times weight digit ``j``
    (eager, built once per device like :func:`_digit_constants`)."""
    places = [[float(256 ** (i + j)) for j in range(dw)] for i in range(dx)]  # powers of two: exact floats
    return torch.tensor(places, dtype=torch.float64).reshape(dx, 1, dw, 1).to(device)


def finish_stage(sums: torch.Tensor, unscale: torch.Tensor, w_unscale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """``sums [M, N]`` (float64 exact integer dot products) scaled back by the rows' and the weight's powers of two
    (exact), the bias added in float64 and cast to ``dtype`` as eager torch casts a float64 (through float32 for a
    half type): each element rounded by itself, so a fused kernel rounds it as eager code does."""
    out = sums * unscale * w_unscale
    if bias is not None:
        out = out + bias.to(torch.float64)
    if dtype in (torch.bfloat16, torch.float16):
        out = out.to(torch.float32)
    return out.to(dtype)


class GridWeight:
    """One weight's integer copy: ``unscale [1, N]`` (float64 powers of two) and, by backend, ``ints [K, N]``
    (float64 integers) or ``digits [2 * N', K']`` (int8: digit ``j`` of row ``n`` at row ``j * N' + n``; ``N'``
    and ``K'`` padded with zeros to multiples of 8)."""

    def __init__(self, weight: torch.Tensor, int8: bool | None = None) -> None:
        n, k = weight.shape
        self.out_features = int(n)
        self.ints: torch.Tensor | None = None
        self.digits: torch.Tensor | None = None
        int8 = weight.device.type in INT8_DEVICES if int8 is None else int8
        unscales, parts = [], []
        for start in range(0, n, _ROWS_PER_CHUNK):  # row chunks: float64/int64 temporaries of a vocabulary stay small
            ints, unscale = grid_ints_stage(weight[start : start + _ROWS_PER_CHUNK].detach(), -1, WEIGHT_BITS)
            unscales.append(unscale)
            parts.append(balanced_digits(ints.to(torch.int64), _WEIGHT_DIGITS) if int8 else ints)
        self.unscale = torch.cat(unscales).reshape(1, -1)
        if int8:  # [Dw, N, K] -> zero-padded [Dw, N', K'] -> [Dw * N', K']
            digits = torch.nn.functional.pad(torch.cat(parts, dim=1), (0, (-k) % 8, 0, (-n) % 8))
            self.digits = digits.reshape(-1, digits.shape[-1])
        else:
            self.ints = torch.cat(parts).t().contiguous()


#: device types whose weights' integer copies live as long as the weight, shared by every mode (a step captured in
#: one ``batch_invariant`` block replays reading them in the next); elsewhere a mode's copies die with it
KEEP_DEVICES = {"cuda"}
#: the kept copies: weight -> ``{int8: (weight version, GridWeight)}``
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


class WeightGrid:
    """The integer copies of the weights a mode has seen, per tensor version (weights do not change inside a decode):
    for the mode's lifetime, or on :data:`KEEP_DEVICES` for the weight's. ``int8``: the backend (``None``: int8
    digits on :data:`INT8_DEVICES`, else float64); ``fused``: whether the stages around the product run compiled
    (``None``: on :data:`~spiffy.fused_stages.FUSED_DEVICES`; the same numbers either way)."""

    def __init__(self, int8: bool | None = None, fused: bool | None = None) -> None:
        self.cache: WeakIdKeyDictionary = WeakIdKeyDictionary()  # as _KEPT
        self.int8 = int8
        self.fused = fused
        #: the last activation's integer form: ``(x, version, int8, ints or digits, unscale)``. The projections
        #: that read one input (q / k / v, gate / up) round it once. ``x`` is held (it cannot be freed and its id
        #: reused while cached); the mode drops the entry at every in-place call (:meth:`forget_activation`), and
        #: the version counter, where the tensor has one (inference tensors do not), must match too
        self.last: tuple[torch.Tensor, int | None, bool, torch.Tensor, torch.Tensor] | None = None

    def activation(self, x: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., K]`` on its grid: :func:`activation_stage` of its rows ``[M, K]``."""
        version = None if x.is_inference() else x._version
        last = self.last
        if last is not None and last[0] is x and last[1] == version and last[2] == int8:
            return last[3], last[4]
        rows = x.reshape(-1, x.shape[-1])
        form, unscale = run_stage(activation_stage, fuses(x.device, self.fused), rows, int8)
        self.last = (x, version, int8, form, unscale)
        return form, unscale

    def forget_activation(self) -> None:
        """Drop the cached activation (a tensor may have been written in place)."""
        self.last = None

    def get(self, weight: torch.Tensor) -> GridWeight:
        """``weight``'s integer copy for this grid's backend (made on first use, again once the weight changed)."""
        int8 = weight.device.type in INT8_DEVICES if self.int8 is None else self.int8
        store = _KEPT if weight.device.type in KEEP_DEVICES else self.cache
        copies = store.setdefault(weight, {})
        hit = copies.get(int8)
        if hit is None or hit[0] != weight._version:
            hit = copies[int8] = (weight._version, GridWeight(weight, int8))
        return hit[1]


def exact_linear(grid: WeightGrid, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with exact integer dot products: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` ->
    ``[..., N]`` in ``x``'s dtype; a row's result depends only on that row, the weight and the bias.

    Raises:
        ConfigError: ``K > MAX_REDUCTION``.
    """
    k = x.shape[-1]
    if k > MAX_REDUCTION:
        raise ConfigError(f"batch-invariant mode's exact products reduce over at most {MAX_REDUCTION} features, this "
                          f"layer has {k}; fix: run this model without batch_invariant")
    w = grid.get(weight)
    form, unscale = grid.activation(x, w.digits is not None)
    fused, m = fuses(x.device, grid.fused), unscale.shape[0]
    if w.digits is not None:
        # int8 tensor cores, int32 accumulation: every digit product sum below 2**31, exact (module docstring)
        products = torch._int_mm(form, w.digits.t())
        out = run_stage(digit_sums_stage, fused, products, m, w.out_features, unscale, w.unscale, bias, x.dtype)
    else:
        assert w.ints is not None
        out = run_stage(finish_stage, fused, torch.mm(form, w.ints), unscale, w.unscale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["ACTIVATION_BITS", "INT8_DEVICES", "KEEP_DEVICES", "MAX_REDUCTION", "WEIGHT_BITS", "GridWeight", "WeightGrid",
           "activation_stage", "balanced_digits", "digit_sums_stage", "exact_linear", "finish_stage", "grid_ints_stage",
           "power_grid"]
