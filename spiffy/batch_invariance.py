"""Batch-invariant mode: a row's numbers do not depend on the other rows of the call, on padding, or on threads.

Why. A speculative forward computes a row beside other rows: Spiffy's candidate states, a batch of left-padded
prompts, DDTree's tree nodes beside their siblings. In float32 the kernels happen to round such a row as the
baseline's one-row forward does; in bfloat16/float16 (and on a GPU in any dtype whose kernels are chosen by shape)
they do not, so the logits move by a few ulps and a near tie can flip (:mod:`spiffy.bench.batch_fidelity` proves each
such flip). Under this mode they cannot: every row is bitwise the same whatever else is in the call.

How (what was chosen, and why). The well-kept batch-invariant kernels (Thinking Machines' ``batch_invariant_ops``,
the Triton kernels vLLM's ``VLLM_BATCH_INVARIANT=1`` uses) are CUDA-only, are not published on PyPI, and fix the
reduction order of ``mm`` / ``addmm`` / ``log_softmax`` / ``mean`` for a *batch size*; spiffy also needs attention
whose result for a query does not depend on masked keys (left padding, other branches of a tree). So this module
takes another road that holds on every device and dtype by construction: **every sum is exact**.

* A sum over ``n <= 2**SUM_BITS_HEADROOM`` terms (:func:`exact_sum`): each slice's terms are rounded to integers on a
  grid fixed by the slice's largest magnitude (``2**-SUM_BITS`` of it) and added in float64, where every partial
  sum is an integer below ``2**53`` and therefore exact. The result is a function of the multiset of terms: no
  order, blocking, thread count or inserted zero (a masked key, a padded position) can change it.
* A linear layer (``F.linear``, :func:`spiffy.exact_linear.exact_linear`): each row of ``x`` and of the weight is
  rounded to integers on its own grid (22 and 14 bits below its largest magnitude), so every dot product is an
  exact integer, computed by one float64 product on a CPU and by int8 digit products (``torch._int_mm``, int32
  accumulation) on CUDA: the same integer either way, so the CPU suite proves the GPU's numbers; weights' integer
  copies are cached for the mode's lifetime (on CUDA, as many bytes as bfloat16 weights, for the weight's lifetime:
  a captured step replays reading them). Other matrix products
  (:func:`exact_matmul`: attention scores, ``matmul`` / ``bmm``) round both operands to ``(53 - ceil(log2 K)) // 2``
  bits and multiply in float64: exact partial sums again, so the kernel's blocking does not matter.
* Attention (``F.scaled_dot_product_attention``): exact query-key products, a max (exact), ``exp``, the exact sum of
  the exponentials, and the values weighted by one exact integer product on grids that a masked key cannot move
  (``ATTENTION_BITS`` bits, whatever the key count), over the keys a query sees.
* ``softmax`` / ``log_softmax`` / ``logsumexp`` / ``sum`` / ``mean`` / ``rms_norm`` / ``layer_norm``: exact sums.
* Transcendental element-wise functions (``exp``, ``log``, ``silu``, ``cos``, ...): on a CPU torch computes a
  tensor's elements with SIMD code and its tail with scalar code, whose last bits can differ, so an element's value
  depends on where it sits; the mode computes them on flat chunks padded to whole SIMD blocks (one code path for
  every element). Additions, products, quotients and square roots are correctly rounded and need nothing.

Cost: rounding to the grids, float64 element-wise work and exact sums (measured in the README and by
``scripts/batch_near_ties.py --batch-invariant``; on a GPU by ``scripts/gpu_run.py``, section ``exactness``).
Under the mode, speculative rows equal the baseline's rows *under the mode*; its numbers are not those of the
default kernels (their error is below the output's own bfloat16/float16 rounding, see :mod:`spiffy.exact_linear`).
Attention must be ``sdpa`` (:data:`ATTENTION`); in-place transcendental ops and reductions other than the ones above
are left as they are.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spiffy.errors import ConfigError
from spiffy.exact_linear import WeightGrid, exact_linear, grid_ints_stage
from spiffy.fused_stages import fuses, run_stage

#: integer bits each term of an exact sum keeps below its slice's largest magnitude
SUM_BITS = 34
#: at most ``2**SUM_BITS_HEADROOM`` terms per sum (so that ``n * 2**SUM_BITS <= 2**53``)
SUM_BITS_HEADROOM = 53 - SUM_BITS
#: elements per chunk of a CPU element-wise call (a multiple of every SIMD block, below torch's parallel grain)
CHUNK = 8192
_SIMD_BLOCK = 64
#: integer bits of attention weights and values below their grids' largest magnitude (fixed, whatever the key count)
ATTENTION_BITS = 18
#: the most keys whose weighted values stay exact integers (``2 * ATTENTION_BITS + log2(MAX_KEYS) <= 53``)
MAX_KEYS = 2**17


def exact_sum(terms: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sum of ``terms`` over ``dim`` in float64, independent of order and of zero terms.

    Each slice is rounded to the integer grid ``2**(e - SUM_BITS)`` (``2**e`` just above the slice's largest
    magnitude), summed exactly (every partial sum an integer below ``2**53``) and scaled back. Absolute error at most
    ``n * 2**-(SUM_BITS + 1)`` times the largest term; the value depends only on the multiset of terms.
    """
    x = terms
    if dim is None:
        x, dim = x.reshape(-1), 0
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
    if n > 2**SUM_BITS_HEADROOM:
        raise ConfigError(f"batch-invariant mode sums at most 2**{SUM_BITS_HEADROOM} terms exactly, got {n}; fix: "
                          "run this reduction outside the mode")
    if n == 0:
        return x.to(torch.float64).sum(dim=dims, keepdim=keepdim)
    return run_stage(_grid_sum_stage, _fused(x), x, dims, keepdim)


def _grid_sum_stage(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    """:func:`exact_sum`'s arithmetic (a stage, :func:`~spiffy.fused_stages.run_stage`: every operation exact)."""
    ints, unscale = grid_ints_stage(x, dims, SUM_BITS)
    total = ints.sum(dim=dims, keepdim=True) * unscale
    return total if keepdim else total.squeeze(dims) if dims else total


def _fused(x: torch.Tensor) -> bool:
    """Whether the exact stages of ``x`` run fused: the active mode's ``fused``, else by device."""
    return fuses(x.device, _ACTIVE[-1].fused if _ACTIVE else None)


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``[..., M, K] @ [..., K, N]``, broadcast) in float64, each entry independent of every other row,
    column and of the kernel's summation order: rows of ``a`` and columns of ``b`` rounded to integers of
    ``(53 - ceil(log2 K)) // 2`` bits below their largest magnitude, so that every partial sum is an exact integer."""
    if b.dim() == 1:
        return exact_matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 1:
        return exact_matmul(a.unsqueeze(0), b).squeeze(-2)
    bits = (53 - max(1, math.ceil(math.log2(max(a.shape[-1], 2))))) // 2
    ints_a, ua = run_stage(grid_ints_stage, _fused(a), a, (-1,), bits)
    ints_b, ub = run_stage(grid_ints_stage, _fused(b), b, (-2,), bits)
    return torch.matmul(ints_a, ints_b) * ua * ub


def _elementwise(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``func`` (element-wise) computed on flat chunks of whole SIMD blocks on a CPU, so every element takes the
    same code path whatever its position (elsewhere: as is)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or tensors[0].device.type != "cpu" or kwargs.get("out") is not None:
        return func(*args, **kwargs)
    one = len(tensors) == 1
    if one and tensors[0].numel() % _SIMD_BLOCK == 0 and tensors[0].numel() <= CHUNK and tensors[0].is_contiguous():
        return func(*args, **kwargs)  # already whole SIMD blocks in one single-threaded call
    shape = tensors[0].shape if one else torch.broadcast_shapes(*(t.shape for t in tensors))
    numel = math.prod(shape)
    if numel == 0:
        return func(*args, **kwargs)
    padded = -(-numel // _SIMD_BLOCK) * _SIMD_BLOCK
    flat = []
    for a in args:
        if isinstance(a, torch.Tensor):
            f = a.expand(shape).reshape(-1)
            flat.append(torch.cat([f, f.new_zeros(padded - numel)]) if padded > numel else f.contiguous())
        else:
            flat.append(a)
    pieces = []
    for start in range(0, padded, CHUNK):
        chunk = [a[start : start + CHUNK] if isinstance(a, torch.Tensor) else a for a in flat]
        pieces.append(func(*chunk, **kwargs))
    return torch.cat(pieces)[:numel].reshape(shape)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.exp, (x,), {})


def _softmax_parts(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(shifted, exps, total)`` in float64 over ``dim``: ``x - max``, its exponentials, their exact sum."""
    x64 = x.to(torch.float64)
    top = x64.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    shifted = x64 - top
    exps = _exp(shifted)
    return shifted, exps, exact_sum(exps, dim, keepdim=True)


def _softmax(x: torch.Tensor, dim: int | None = None, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
    dim = -1 if dim is None else dim
    _, exps, total = _softmax_parts(x, dim)
    return (exps / total).to(dtype or x.dtype)


def _log_softmax(x: torch.Tensor, dim: int | None = None, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
    dim = -1 if dim is None else dim
    shifted, _, total = _softmax_parts(x, dim)
    return (shifted - _elementwise(torch.log, (total,), {})).to(dtype or x.dtype)


def _logsumexp(x: torch.Tensor, dim: Any, keepdim: bool = False) -> torch.Tensor:
    x64 = x.to(torch.float64)
    top = x64.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    out = _elementwise(torch.log, (exact_sum(_exp(x64 - top), dim, keepdim=True),), {}) + top
    return (out if keepdim else out.squeeze(dim)).to(x.dtype)


def _reduce(mean: bool, x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    if not torch.is_floating_point(x) or (isinstance(dim, (list, tuple)) and not dim):
        fn = torch.mean if mean else torch.sum
        return fn(x, dim, keepdim=keepdim, dtype=dtype) if dim is not None else fn(x, dtype=dtype)
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else dim
    out = exact_sum(x, dims, keepdim)
    if mean:
        count = x.numel() if dims is None else math.prod(x.shape[d] for d in ((dims,) if isinstance(dims, int) else dims))
        out = out / count
    return out.to(dtype or x.dtype)


def _rms_norm(x: torch.Tensor, shape: Any, weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    dims = tuple(range(-len(shape), 0))
    x64 = x.to(torch.float64)
    ms = exact_sum(x64 * x64, dims, keepdim=True) / math.prod(shape)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    out = x64 / torch.sqrt(ms + eps)
    return (out if weight is None else out * weight.to(torch.float64)).to(x.dtype)


def _layer_norm(x: torch.Tensor, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> torch.Tensor:
    dims = tuple(range(-len(shape), 0))
    n = math.prod(shape)
    x64 = x.to(torch.float64)
    centred = x64 - exact_sum(x64, dims, keepdim=True) / n
    out = centred / torch.sqrt(exact_sum(centred * centred, dims, keepdim=True) / n + eps)
    out = out if weight is None else out * weight.to(torch.float64)
    return (out if bias is None else out + bias.to(torch.float64)).to(x.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with exact sums: ``q [..., H, Lq, D]``, ``k, v [..., Hkv, Lk, D]``.

    A query's output depends only on its own scores and the keys it sees: masked keys contribute exact zeros to
    exact sums, so neither padding nor other tree branches nor other rows can change it."""
    if dropout_p:
        raise ConfigError("batch-invariant mode runs attention without dropout; fix: dropout_p=0 (inference)")
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = exact_matmul(q, k.transpose(-1, -2)) * scale  # [..., Lq, Lk] float64
    lq, lk = scores.shape[-2:]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(torch.float64)
    _, exps, total = _softmax_parts(scores, -1)  # masked keys: exactly 0
    num = _weighted_values(exps, v)
    out = torch.where(total > 0, num / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(num))
    return out.to(q.dtype)


def _weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weights @ v`` as exact integer dot products: ``weights [..., Lq, Lk]`` (float64, >= 0; a masked key's weight
    exactly 0), ``v [..., Lk, D]`` -> ``[..., Lq, D]`` float64.

    Each value row is rounded on its own grid (a key's grid depends on that key alone); its unscale, a power of two,
    moves exactly into the key's weight; each query's weights are then rounded on a grid fixed by its largest weight
    over the keys it sees (a masked key's 0 moves nothing). Every dot product is then an integer of at most
    ``2**53`` (``ATTENTION_BITS`` bits a factor, at most ``MAX_KEYS`` terms): one float64 matrix product, exact
    whatever the kernel, instead of materialising ``[..., Lq, Lk, D]`` terms."""
    if v.shape[-2] > MAX_KEYS:
        raise ConfigError(f"batch-invariant attention sums over at most {MAX_KEYS} keys exactly, got {v.shape[-2]}; "
                          "fix: run this context outside the mode")
    bits = ATTENTION_BITS  # not a function of the key count: padding keys must not move a query's grid
    fused = _fused(v)
    ints_v, uv = run_stage(grid_ints_stage, fused, v, (-1,), bits)
    ints_w, uw = run_stage(grid_ints_stage, fused, weights * uv.transpose(-1, -2), (-1,), bits)
    return torch.matmul(ints_w, ints_v) * uw


_ELEMENTWISE = (
    torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sigmoid, torch.Tensor.sigmoid, torch.tanh,
    torch.Tensor.tanh, torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin, torch.rsqrt, torch.Tensor.rsqrt,
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.exp2, torch.log1p, torch.expm1,
    torch.erf, F.silu, F.gelu, F.softplus,
)


class BatchInvariantMode(TorchFunctionMode):
    """The torch function mode behind :func:`batch_invariant` (see the module docstring)."""

    def __init__(self, fused: bool | None = None) -> None:
        super().__init__()
        self.fused = fused
        self.weights = WeightGrid(fused=fused)
        self.table: dict[Any, Callable[..., Any]] = {
            F.linear: lambda x, w, b=None: exact_linear(self.weights, x, w, b),
            torch.matmul: _matmul, torch.Tensor.__matmul__: _matmul, torch.mm: _matmul, torch.Tensor.mm: _matmul,
            torch.bmm: _matmul, torch.Tensor.bmm: _matmul,
            F.scaled_dot_product_attention: _sdpa,
            F.softmax: _softmax, torch.softmax: _softmax, torch.Tensor.softmax: _softmax,
            F.log_softmax: _log_softmax, torch.log_softmax: _log_softmax, torch.Tensor.log_softmax: _log_softmax,
            torch.logsumexp: _logsumexp, torch.Tensor.logsumexp: _logsumexp,
            torch.sum: lambda *a, **k: _reduce(False, *a, **k), torch.Tensor.sum: lambda *a, **k: _reduce(False, *a, **k),
            torch.mean: lambda *a, **k: _reduce(True, *a, **k), torch.Tensor.mean: lambda *a, **k: _reduce(True, *a, **k),
            F.rms_norm: _rms_norm, F.layer_norm: _layer_norm,
        }
        for fn in _ELEMENTWISE:
            self.table[fn] = lambda *a, _fn=fn, **k: _elementwise(_fn, a, k)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if "out" in kwargs or _writes_in_place(getattr(func, "__name__", "")):
            self.weights.forget_activation()
        impl = self.table.get(func)
        if impl is None or torch.is_grad_enabled() and _needs_grad(args):
            return func(*args, **kwargs)
        return impl(*args, **kwargs)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not (torch.is_floating_point(a) and torch.is_floating_point(b)):
        return torch.matmul(a, b)
    return exact_matmul(a, b).to(torch.promote_types(a.dtype, b.dtype))


#: the dunder methods that write into their tensor
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__delitem__", "__set__", "__iadd__", "__isub__", "__imul__",
                               "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                               "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def _writes_in_place(name: str) -> bool:
    """Whether a torch function of this name writes into a tensor (``add_``, ``copy_``, ``x[i] = v``, ``x += y``)."""
    return name in _IN_PLACE_DUNDERS if name.startswith("__") else name.endswith("_")


def _needs_grad(args: tuple) -> bool:
    """Training passes through untouched (the mode is for decoding)."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_ACTIVE: list[BatchInvariantMode] = []


#: attention implementations the mode reaches: sdpa alone. Flex attention and flash-attn run kernels of their own;
#: "eager" attention multiplies its probabilities by the values in ``torch.matmul``, whose grids span every key of the
#: call, masked ones included, so a masked key's values would move a query's last bits (seen in float32)
ATTENTION = ("sdpa",)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True, model: Any = None, fused: bool | None = None) -> Iterator[None]:
    """Run the body in batch-invariant mode (a no-op when ``enabled`` is false or the mode is already on).

    ``model`` (optional): checked to attend with ``sdpa`` (see :data:`ATTENTION`). ``fused``: whether the mode's
    exact stages run compiled (:mod:`spiffy.fused_stages`: the same numbers in fewer kernels); ``None``: on
    :data:`~spiffy.fused_stages.FUSED_DEVICES` (CUDA). Example::

        with spiffy.batch_invariant():
            base = spiffy.generate(model, ids, cfg)
            spec = spiffy.generate(model, ids, cfg, graph=graph)   # bitwise equal, in bfloat16 too

    Raises:
        ConfigError: ``model`` attends with another implementation.
    """
    if not enabled or _ACTIVE:
        yield
        return
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION:
        raise ConfigError(f"batch-invariant mode computes attention in F.scaled_dot_product_attention, the model "
                          f"attends with {impl!r}; fix: load it with attn_implementation='sdpa'")
    mode = BatchInvariantMode(fused)
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.pop()


def is_batch_invariant() -> bool:
    """Whether the calling code runs inside :func:`batch_invariant`."""
    return bool(_ACTIVE)


def numerics() -> tuple[str, bool | None] | None:
    """What decides the kernels a step runs besides its shapes: ``None`` (torch's own), or in the mode
    ``("batch-invariant", fused)``. A captured step (:class:`~spiffy.capture.StepGraphs`) is kept per value."""
    return ("batch-invariant", _ACTIVE[-1].fused) if _ACTIVE else None


__all__ = ["ATTENTION", "ATTENTION_BITS", "BatchInvariantMode", "CHUNK", "MAX_KEYS", "SUM_BITS", "batch_invariant",
           "exact_matmul", "exact_sum", "is_batch_invariant", "numerics"]
