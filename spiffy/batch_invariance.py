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
* A matrix product (:func:`exact_matmul`, ``F.linear``): each row of ``a`` and each column of ``b`` is rounded to
  integers of ``(53 - ceil(log2 K)) // 2`` bits relative to its largest magnitude, and the product runs in float64
  (BLAS / cuBLAS): every partial sum is again an exact integer, so the kernel's blocking does not matter. Weights'
  integer copies are cached for the mode's lifetime.
* Attention (``F.scaled_dot_product_attention``): exact query-key products, a max (exact), ``exp``, and exact sums of
  the exponentials and of their products with the values, over the keys a query sees.
* ``softmax`` / ``log_softmax`` / ``logsumexp`` / ``sum`` / ``mean`` / ``rms_norm`` / ``layer_norm``: exact sums.
* Transcendental element-wise functions (``exp``, ``log``, ``silu``, ``cos``, ...): on a CPU torch computes a
  tensor's elements with SIMD code and its tail with scalar code, whose last bits can differ, so an element's value
  depends on where it sits; the mode computes them on flat chunks padded to whole SIMD blocks (one code path for
  every element). Additions, products, quotients and square roots are correctly rounded and need nothing.

Cost: float64 products and copies (measured in the README and by ``scripts/batch_near_ties.py --batch-invariant``).
Under the mode, speculative rows equal the baseline's rows *under the mode*; its numbers are not those of the
default kernels (they are at least as accurate). Attention must be ``sdpa`` or ``eager`` (flex and flash-attn run
their own kernels); in-place transcendental ops and reductions other than the ones above are left as they are.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spiffy.errors import ConfigError

#: integer bits each term of an exact sum keeps below its slice's largest magnitude
SUM_BITS = 34
#: at most ``2**SUM_BITS_HEADROOM`` terms per sum (so that ``n * 2**SUM_BITS <= 2**53``)
SUM_BITS_HEADROOM = 53 - SUM_BITS
#: elements per chunk of a CPU element-wise call (a multiple of every SIMD block, below torch's parallel grain)
CHUNK = 8192
_SIMD_BLOCK = 64


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` in float64, exactly, from the exponent bits (``k`` integer-valued, clamped to normal range)."""
    return ((k.to(torch.int64).clamp_(-1022, 1023) + 1023) << 52).view(torch.float64)


def _grid(x: torch.Tensor, dim: int | tuple[int, ...], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, unscale)``: powers of two such that ``x * scale`` has magnitude below ``2**bits`` over ``dim``."""
    _, e = torch.frexp(x.abs().amax(dim=dim, keepdim=True))  # max = m * 2**e, m in [0.5, 1); e = 0 for zeros
    k = e.to(torch.int64) - bits
    return _pow2(-k), _pow2(k)


def exact_sum(terms: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sum of ``terms`` over ``dim`` in float64, independent of order and of zero terms.

    Each slice is rounded to the integer grid ``2**(e - SUM_BITS)`` (``2**e`` just above the slice's largest
    magnitude), summed exactly (every partial sum an integer below ``2**53``) and scaled back. Absolute error at most
    ``n * 2**-(SUM_BITS + 1)`` times the largest term; the value depends only on the multiset of terms.
    """
    x = terms.to(torch.float64)
    if dim is None:
        x, dim = x.reshape(-1), 0
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
    if n > 2**SUM_BITS_HEADROOM:
        raise ConfigError(f"batch-invariant mode sums at most 2**{SUM_BITS_HEADROOM} terms exactly, got {n}; fix: "
                          "run this reduction outside the mode")
    if n == 0:
        return x.sum(dim=dims, keepdim=keepdim)
    scale, unscale = _grid(x, dims, SUM_BITS)
    total = torch.round(x * scale).sum(dim=dims, keepdim=True) * unscale
    return total if keepdim else total.squeeze(dims) if dims else total


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``[..., M, K] @ [..., K, N]``, broadcast) in float64, each entry independent of every other row,
    column and of the kernel's summation order: rows of ``a`` and columns of ``b`` rounded to integers of
    ``(53 - ceil(log2 K)) // 2`` bits below their largest magnitude, so that every partial sum is an exact integer."""
    if b.dim() == 1:
        return exact_matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 1:
        return exact_matmul(a.unsqueeze(0), b).squeeze(-2)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    bits = (53 - max(1, math.ceil(math.log2(max(a.shape[-1], 2))))) // 2
    sa, ua = _grid(a64, -1, bits)
    sb, ub = _grid(b64, -2, bits)
    return torch.matmul(torch.round(a64 * sa), torch.round(b64 * sb)) * ua * ub


class _WeightGrid:
    """Integer copies of weights (``[N, K]`` -> ``[K, N]`` float64 integers and ``[1, N]`` unscale), cached per
    tensor version for one mode's lifetime (weights do not change inside a decode)."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[Any, int, torch.Tensor, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(weight)
        hit = self.cache.get(key)
        if hit is not None and hit[0] is weight and hit[1] == weight._version:
            return hit[2], hit[3]
        w64 = weight.detach().to(torch.float64)
        scale, unscale = _grid(w64, -1, bits)
        ints, un = torch.round(w64 * scale).t().contiguous(), unscale.reshape(1, -1)
        self.cache[key] = (weight, weight._version, ints, un)
        return ints, un


def _linear(grid: _WeightGrid, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with exact sums: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]`` in ``x``'s dtype."""
    k = x.shape[-1]
    bits = (53 - max(1, math.ceil(math.log2(max(k, 2))))) // 2
    w_int, w_un = grid.get(weight, bits)
    x64 = x.reshape(-1, k).to(torch.float64)
    sx, ux = _grid(x64, -1, bits)
    out = torch.mm(torch.round(x64 * sx), w_int) * ux * w_un
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


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
    v64 = v.to(torch.float64)
    outs = []
    step = max(1, (1 << 22) // max(1, lk * v.shape[-1] * math.prod(scores.shape[:-2])))  # bound the [.., Lq, Lk, D]
    for start in range(0, lq, step):
        e = exps[..., start : start + step, :]
        outs.append(exact_sum(e.unsqueeze(-1) * v64.unsqueeze(-3), -2))
    num = torch.cat(outs, dim=-2)
    out = torch.where(total > 0, num / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(num))
    return out.to(q.dtype)


_ELEMENTWISE = (
    torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sigmoid, torch.Tensor.sigmoid, torch.tanh,
    torch.Tensor.tanh, torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin, torch.rsqrt, torch.Tensor.rsqrt,
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.exp2, torch.log1p, torch.expm1,
    torch.erf, F.silu, F.gelu, F.softplus,
)


class BatchInvariantMode(TorchFunctionMode):
    """The torch function mode behind :func:`batch_invariant` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = _WeightGrid()
        self.table: dict[Any, Callable[..., Any]] = {
            F.linear: lambda x, w, b=None: _linear(self.weights, x, w, b),
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
        impl = self.table.get(func)
        if impl is None or torch.is_grad_enabled() and _needs_grad(args):
            return func(*args, **kwargs)
        return impl(*args, **kwargs)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not (torch.is_floating_point(a) and torch.is_floating_point(b)):
        return torch.matmul(a, b)
    return exact_matmul(a, b).to(torch.promote_types(a.dtype, b.dtype))


def _needs_grad(args: tuple) -> bool:
    """Training passes through untouched (the mode is for decoding)."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_ACTIVE: list[BatchInvariantMode] = []


#: attention implementations the mode reaches (the others run kernels of their own)
ATTENTION = ("sdpa", "eager")


@contextlib.contextmanager
def batch_invariant(enabled: bool = True, model: Any = None) -> Iterator[None]:
    """Run the body in batch-invariant mode (a no-op when ``enabled`` is false or the mode is already on).

    ``model`` (optional): checked to attend with ``sdpa`` or ``eager`` (flex attention and flash-attn run their own
    kernels, which the mode does not reach). Example::

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
        raise ConfigError(f"batch-invariant mode needs attention through sdpa or eager, the model uses {impl!r}; fix: "
                          "load it with attn_implementation='sdpa'")
    mode = BatchInvariantMode()
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.pop()


def is_batch_invariant() -> bool:
    """Whether the calling code runs inside :func:`batch_invariant`."""
    return bool(_ACTIVE)


__all__ = ["ATTENTION", "BatchInvariantMode", "CHUNK", "SUM_BITS", "batch_invariant", "exact_matmul", "exact_sum",
           "is_batch_invariant"]
