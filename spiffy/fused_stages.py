"""Fused exact stages of the batch-invariant mode: the same numbers in one or two kernels instead of up to sixteen.

The mode (:mod:`spiffy.batch_invariance`, :mod:`spiffy.exact_linear`) rounds tensors to integer grids, writes them
as int8 digits and adds exact integer sums: a dozen small element-wise kernels around every matrix product. Eager,
or replayed from a CUDA graph, each is a launch of its own (a Qwen3-8B decode step in the mode would launch about
ten times the default's kernels). A *stage* is one such run of element-wise work written as a pure tensor function
(:func:`run_stage`), which TorchInductor compiles into a reduction kernel and a point-wise one.

**Why fusing cannot move a bit.** A stage contains only operations that are exact in any order and at any
blocking (a maximum; reading and writing an exponent field; a product by a power of two; rounding to an integer;
integer shifts and masks; sums of integers below ``2**53`` in float64), followed by at most one rounding of each
element (a cast to the output's dtype, written as the casts eager torch makes: through float32 for a half type,
or a float64 add of the bias), which a fused kernel computes per element as eager code does. The suite checks that
(compiled on a CPU, bitwise equal to eager over random inputs); ``scripts/gpu_run.py``'s exactness section checks it
on the GPU before timing anything.

A stage that TorchInductor cannot compile on this machine falls back to its eager form, with a warning and a
record in :data:`FELL_BACK` (the numbers do not change, only the kernel count). Where stages run fused:
:data:`FUSED_DEVICES` (CUDA), unless the mode is told otherwise (``batch_invariant(fused=...)``); CPUs run them
eagerly by default (compiling costs seconds per stage, and a CPU pays little per kernel).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from spiffy.torch_utils import code_copy

#: device types whose exact stages run compiled by TorchInductor when the mode does not say otherwise
FUSED_DEVICES = {"cuda"}

#: stage variants that failed to compile here and run eagerly: ``{(stage name, variant): the error}``
FELL_BACK: dict[tuple[str, tuple], str] = {}

_COMPILED: dict[tuple[Callable[..., Any], tuple], Callable[..., Any]] = {}


def fuses(device: torch.device, setting: bool | None) -> bool:
    """Whether the stages of a tensor on ``device`` run fused: ``setting`` when given, else :data:`FUSED_DEVICES`."""
    return device.type in FUSED_DEVICES if setting is None else setting


def run_stage(stage: Callable[..., Any], fused: bool, *args: Any) -> Any:
    """``stage(*args)``, compiled by TorchInductor when ``fused`` (else, or where that compilation failed, eagerly).

    One compilation per *variant* (:func:`_variant`: the arguments' devices, dtypes, layouts and sizes of 0 / 1 /
    more, flags and dims), with dynamic sizes: one serves every bucket and layer. Each variant compiles a copy of the
    stage with a code object of its own, because TorchDynamo keeps compiled graphs, and its limit of eight
    recompilations, per code object: dtypes, biases and ranks must not use up one another's."""
    # a stage is plain tensor arithmetic: no torch function mode (the batch-invariant mode itself, when code running
    # in it calls a stage) may intercept its operations, and TorchDynamo then traces it as it is
    with torch._C.DisableTorchFunction():
        if not fused:
            return stage(*args)
        key = (stage, _variant(args))
        if (stage.__name__, key[1]) in FELL_BACK:
            return stage(*args)
        return _compiled(stage, key, args)


def _compiled(stage: Callable[..., Any], key: tuple, args: tuple) -> Any:
    """The compiled variant's result, or the eager stage's once compiling it failed."""
    compiled = _COMPILED.get(key)
    if compiled is None:
        copy = code_copy(stage, f"{stage.__name__}_fused_{len(_COMPILED)}")  # named for profiles and logs
        compiled = _COMPILED[key] = torch.compile(copy, fullgraph=True, dynamic=True)
    try:
        return compiled(*args)
    except Exception as error:  # noqa: BLE001: any compiler failure; the eager stage computes the same numbers
        FELL_BACK[(stage.__name__, key[1])] = f"{type(error).__name__}: {error}"
        first_line = (str(error).splitlines() or [""])[0][:200]
        warnings.warn(f"batch-invariant mode: the fused stage {stage.__name__} did not compile here "
                      f"({type(error).__name__}: {first_line}); this variant runs eagerly from now on (the same "
                      "numbers, more kernels)", RuntimeWarning, stacklevel=3)
        return stage(*args)


def compiled_stages() -> dict[str, int]:
    """``{stage name: variants compiled and running fused}`` in this process (a run reports it beside
    :data:`FELL_BACK`)."""
    counts: dict[str, int] = {}
    for stage, variant in _COMPILED:
        if (stage.__name__, variant) not in FELL_BACK:
            counts[stage.__name__] = counts.get(stage.__name__, 0) + 1
    return counts


def _variant(args: tuple) -> tuple:
    """What of a stage's arguments its compilation is specialised on: a tensor's device, dtype, contiguity and which
    of its sizes are 0, 1 or more (TorchDynamo specialises sizes 0 and 1 even with dynamic shapes: a variant of its
    own each, so no recompilation counts against the limit); ``None``, booleans, dtypes and tuples (reduction dims)
    by value; plain integers (sizes) stay dynamic."""
    return tuple((a.device.type, a.dtype, a.is_contiguous(), tuple(n if n < 2 else 2 for n in a.shape))
                 if isinstance(a, torch.Tensor) else int if isinstance(a, int) and not isinstance(a, bool) else a
                 for a in args)


__all__ = ["FELL_BACK", "FUSED_DEVICES", "compiled_stages", "fuses", "run_stage"]
