"""A CUDA graph's replay, emulated on a CPU: what a GPU would replay, checked without one.

A CUDA graph records a step's kernels once, with their arguments: the addresses of the tensors they read and write
and every Python number the step turned into a kernel argument. A replay launches those kernels again and nothing
else. So on a GPU, and in no eager run:

* no Python of the step runs again: a Python value it read (a length, a flag, an attribute of the session) is frozen
  at the recording;
* a tensor the host *rebinds* after the recording (``self.buf = new`` instead of ``self.buf.copy_(new)``) is never
  read: the graph keeps reading the memory it recorded;
* the step's outputs are the same tensors at every replay, overwritten by the next one;
* graphs share one memory pool: a graph recorded earlier may, when it replays, write its scratch where a later
  recording put its outputs (that memory was free then).

:class:`RecordedStep` does the same with the step's ATen operations: it runs the step once under a dispatch mode
that records each operation with the very tensors and numbers it was called with, and its outputs; a replay calls
the recorded operations again on the recorded tensors, copying each fresh result into the tensor the recording made
(the graph's memory), while views and in-place operations act on the recorded tensors themselves and memory taken
uninitialised (``empty``) keeps what the last replay left, as a graph's does; before a replay, the outputs of the
buckets recorded after it are overwritten with garbage (:meth:`RecordedStep.clobber`, the worst a shared pool may
do). A step whose replay is not what an eager call computes (frozen Python, a rebound tensor, an output read after
the next replay or after an earlier graph's) then gives other tokens than eager, which the suite's comparisons see
(:func:`spiffy.capture.emulate_replays`).

ATen-level recording sees what eager kernels do; a step compiled by TorchInductor calls its own kernels and is not
emulated (:class:`~spiffy.capture.StepGraphs` runs it as it is).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["RecordedStep"]


class _Recorder(TorchDispatchMode):
    """Runs every ATen operation and records ``(operation, args, kwargs, outputs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.made: set[int] = set()  # storages the step allocated (a graph's pool memory)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        read = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.made.update(_storage(t) for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and _storage(t) not in read)
        return out


#: operations whose result is uninitialised memory: a graph's replay leaves that memory as the last replay left it
_UNINITIALISED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                  torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                  torch.ops.aten.new_empty_strided.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class RecordedStep:
    """A step's ATen operations recorded once (running them: the caller puts back what the run changed, as a
    :class:`~spiffy.capture.StatefulStep`'s ``save`` does) and replayed on the recorded tensors (module docstring).

    Args:
        step: the zero-argument step; its outputs (tensors, or nested tuples / lists of them) become the replay's.
    """

    def __init__(self, step: Callable[[], Any]) -> None:
        recorder = _Recorder()
        with recorder:
            self.outputs = step()
        self.ops = recorder.ops
        # the outputs in memory the step allocated: in a graph's pool (not the caller's buffers)
        self.pooled = list({_storage(t): t for t in tree_leaves(self.outputs)
                            if isinstance(t, torch.Tensor) and _storage(t) in recorder.made}.values())

    def clobber(self) -> None:
        """Overwrite the outputs in pool memory with garbage (NaN, a huge negative integer, flipped booleans): what a
        graph recorded *earlier* in the same pool may do to them when it replays, as its scratch memory was free
        when this one was recorded (PyTorch's rule for a shared pool). A caller that reads outputs after another
        graph's replay then reads garbage, as it might on a GPU."""
        for t in self.pooled:
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.fill_(-(2 ** 30) if t.dtype not in (torch.uint8, torch.int8, torch.int16) else -1)

    def replay(self) -> Any:
        """Run the recorded operations again; returns the recorded outputs, now holding this replay's values."""
        with torch.inference_mode():  # kernels, no autograd (whatever mode the tensors were made in)
            self._run()
        return self.outputs

    def _run(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            if func in _UNINITIALISED:
                continue
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(recorded), tree_leaves(fresh)):
                # a view or an in-place result is the recorded memory already; a fresh result goes where the
                # recording's went (the graph's pool), where later operations and the caller read it
                if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and _storage(new) != _storage(old):
                    if old.shape != new.shape:
                        raise RuntimeError(f"replay of {func}: recorded {tuple(old.shape)}, now {tuple(new.shape)} "
                                           "(a shape that depends on the data: no graph can hold it)")
                    old.copy_(new)
