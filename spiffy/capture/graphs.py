"""Static-shape steps captured once per bucket and replayed: the one home of CUDA-graph capture in spiffy.

A *step* is a zero-argument callable over tensors the caller owns and fills in place (static buffers: same shape,
same address every call); it returns output tensors. :class:`StepGraphs` keeps one step per *bucket* (any hashable
key: ``(rows, nodes)`` for AR verification, ``(states, window)`` for a dLLM forward), built lazily by a factory the
first time the bucket is asked for, and reused for every later call (across rounds, prompts and generations, as
long as the owner of the buffers lives).

* On CUDA with ``capture=True`` a bucket's first call runs the step eagerly: its result is the call's, and it is the
  capture's warm-up (lazy initialisation, kernel choice, a fused step's compilation settle in it). The second call
  (:data:`RECORD_AT_CALL`) captures the step in a :class:`torch.cuda.CUDAGraph` (all buckets share one memory pool;
  recording runs no kernel) and replays it; later calls only replay. So a bucket called once costs its eager run and
  nothing more, and one called ``k`` times one eager run, one recording and ``k - 1`` replays (a dLLM prefix cache's
  buckets live for one block: a few calls each). Output tensors live in the graph's pool and are overwritten by the
  next replay of the same bucket: read or copy them before that.
* Anywhere else (the CPU, or ``capture=False``) the step runs eagerly with the same static shapes, which is what the
  CPU suite runs: the code a GPU captures is the code the tests check against the eager reference.
* At most :data:`MAX_BUCKETS` buckets are kept, the least recently run dropped first (a captured graph holds its
  outputs: prompts of ever new lengths would otherwise fill the device); a dropped bucket is built again if asked.

Capture is transparent only for steps that are pure tensor programs: no host synchronisation, no Python branch on
tensor values, no allocation whose size depends on data. A step that changes state it also reads (a round that
commits what it verified) is a :class:`StatefulStep`. Recording runs its Python once more without its tensor writes;
the CPU suite rehearses that with :data:`REHEARSE` (at a bucket's second call the step runs once and its state is put
back, then it runs for real), so a step whose Python does more than issue tensor work would show. Hooks registered
on modules fire during the eager run and the recording but not on replay; a step that needs what a hook saw returns
it as an output.

**Proving that on a CPU.** With :data:`TRACE_STEPS` set (``SPIFFY_TRACE_STEPS=1``, or :func:`trace_steps` in a
test), an uncaptured bucket's step runs through ``torch.compile(step, fullgraph=True, dynamic=False)`` with a
backend that runs the traced graph as it is: TorchDynamo must trace the whole step into one graph with no symbol
left in it, so a host read (``.item()``, ``.tolist()``, ``bool(t)``), a Python branch on a tensor value or a shape
that depends on the data (``nonzero``, a boolean mask) raises :class:`StepNotCapturable` instead of running. That is
the property a CUDA graph needs, checked by the suite without a GPU (the step computes with the same kernels as
without the check).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from spiffy.batch_invariance import is_batch_invariant, numerics
from spiffy.capture.replay import RecordedStep
from spiffy.errors import ConfigError
from spiffy.torch_utils import code_copy

__all__ = ["AUTO_ON_CUDA", "CaptureStats", "CompileSetting", "StatefulStep", "StepGraphs", "StepNotCapturable",
           "bucket_size", "compile_fuses", "emulate_replays", "resolve_compile", "trace_steps"]

#: what ``compile=`` accepts: ``"auto"`` / ``None`` (the default), ``True`` / ``"on"``, ``"inductor"``, ``False`` /
#: ``"off"``
CompileSetting = bool | str | None

#: whether ``compile="auto"`` turns the captured path on on CUDA. Off until a GPU run shows the captured path never
#: slower than eager after warm-up (``scripts/gpu_run.py``, section ``captured``); CPUs always run eager under auto
AUTO_ON_CUDA = False

#: trace every uncaptured step as one TorchDynamo graph (module docstring); read when a bucket is built
TRACE_STEPS = os.environ.get("SPIFFY_TRACE_STEPS", "") not in ("", "0")

#: buckets a :class:`StepGraphs` keeps (the least recently run dropped beyond it)
MAX_BUCKETS = 64

#: the call of a bucket at which a GPU records its graph (the calls before run the step eagerly; the first of them is
#: the warm-up). 2 wastes no run; a larger value spares the recording of buckets called only that often
RECORD_AT_CALL = 2

#: rehearse a capture's recording at an uncaptured bucket's :data:`RECORD_AT_CALL` (tests: recording must change
#: nothing)
REHEARSE = False

#: emulate a CUDA graph's replay on a CPU (:mod:`spiffy.capture.replay`): an uncaptured bucket's step is recorded at
#: its :data:`RECORD_AT_CALL` and replayed from then on (``SPIFFY_EMULATE_REPLAYS=1``, or :func:`emulate_replays`)
EMULATE_REPLAYS = os.environ.get("SPIFFY_EMULATE_REPLAYS", "") not in ("", "0")


def resolve_compile(setting: CompileSetting, device: torch.device) -> bool:
    """Whether the static (captured on CUDA) path runs for ``setting`` on ``device``.

    ``True`` / ``"on"``: always (the static code runs eagerly where nothing can be captured); ``"inductor"``: always,
    with fused steps (:func:`compile_fuses`); ``False`` / ``"off"``: never (eager, the reference); ``None`` /
    ``"auto"``: on CUDA when :data:`AUTO_ON_CUDA`, never on a CPU.
    """
    if isinstance(setting, bool):
        return setting
    name = "auto" if setting is None else str(setting).lower()
    if name in ("on", "true", "1", "inductor"):
        return True
    if name in ("off", "false", "0"):
        return False
    if name == "auto":
        return AUTO_ON_CUDA and device.type == "cuda"
    raise ConfigError(f"compile={setting!r} is not a setting; fix: pass compile=True, False, 'inductor' or 'auto' "
                      "(--compile on|off|inductor|auto)")


def compile_fuses(setting: CompileSetting) -> bool:
    """Whether ``setting`` asks for fused steps (``"inductor"``): each bucket's step compiled by TorchInductor
    (``torch.compile(fullgraph=True, dynamic=False)``: fused kernels) before it is captured. Fused kernels round
    differently from the eager ones (a reduction's order, fused multiply-adds), so tokens equal eager's only up to
    near ties, in every dtype; ``compile=True`` keeps the eager kernels (bitwise in float32 and float64).
    Refused inside :func:`spiffy.batch_invariant` mode, whose exact sums fused kernels would replace."""
    fuse = isinstance(setting, str) and setting.lower() == "inductor"
    if fuse and is_batch_invariant():
        raise ConfigError("compile='inductor' fuses its own kernels, which the batch-invariant mode's exact sums "
                          "must replace; fix: pass compile=True (captured, eager kernels) or batch_invariant=False")
    return fuse


def bucket_size(needed: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``needed``; ConfigError when none does."""
    for s in sizes:
        if s >= needed:
            return int(s)
    raise ConfigError(f"no bucket holds {needed} (buckets {list(sizes)}); fix: allocate a larger bucket")


class StepNotCapturable(RuntimeError):
    """A step is not one static tensor program (a host read, a branch on a tensor value, a data-dependent shape):
    it could not be captured in a CUDA graph. Raised only while :data:`TRACE_STEPS` is on."""


@contextmanager
def emulate_replays(on: bool = True) -> Iterator[None]:
    """Within the block, uncaptured buckets replay as a CUDA graph would (:data:`EMULATE_REPLAYS`): their steps'
    Python runs at the first two calls only, later calls replay the recorded operations on the recorded tensors."""
    global EMULATE_REPLAYS
    before, EMULATE_REPLAYS = EMULATE_REPLAYS, bool(on)
    try:
        yield
    finally:
        EMULATE_REPLAYS = before


@contextmanager
def trace_steps(on: bool = True) -> Iterator[None]:
    """Within the block, buckets built from now on trace their steps (:data:`TRACE_STEPS`)."""
    global TRACE_STEPS
    before, TRACE_STEPS = TRACE_STEPS, bool(on)
    try:
        yield
    finally:
        TRACE_STEPS = before


@contextmanager
def _cache_kept() -> Iterator[None]:
    """Within the block, ``torch.cuda.empty_cache`` does nothing (:meth:`StepGraphs._capture`)."""
    real = torch.cuda.empty_cache
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.empty_cache = real


_STEP_NAMES = itertools.count()  # names the compiled steps' code objects


def _static_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A TorchDynamo backend that runs the traced graph as it is (eager kernels) after refusing one with a
    data-dependent value: with ``dynamic=False`` every symbol left in it (``.item()``, ``nonzero``, a boolean mask)
    is a value the host would have to read back."""
    bad = [str(node.target) for node in gm.graph.nodes
           if (val := node.meta.get("example_value")) is not None and free_unbacked_symbols(val)]
    if bad:
        raise StepNotCapturable(f"data-dependent values in the step: {', '.join(dict.fromkeys(bad))}")
    return gm.forward


def _own_code(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` called through a function with a code object of its own: TorchDynamo keeps its compiled graphs and
    guards per code object, and the buckets of one step kind are closures of one function (a guard of one must never
    be evaluated on another, nor count as its recompile)."""
    def call() -> Any:
        return step()

    return code_copy(call, f"step_{next(_STEP_NAMES)}")


def _unlimited(compiled: Callable[[], Any]) -> Any:
    """Call ``compiled`` with no recompile limit: a step recompiles when a Python value it read changed (a dLLM
    step's session: a new generation), which is no failure (on a GPU only the first call and the recording call it)."""
    with torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20):
        return compiled()


def _fused(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` compiled by TorchInductor as one graph (:func:`compile_fuses`); a :class:`StatefulStep` stays one."""
    if isinstance(step, StatefulStep):
        return StatefulStep(_fused(step.run), step.save)
    compiled = torch.compile(_own_code(step), fullgraph=True, dynamic=False)
    return lambda: _unlimited(compiled)


def _traced(step: Callable[[], Any], key: Hashable) -> Callable[[], Any]:
    """``step`` compiled as one TorchDynamo graph (eager kernels); a graph break, or a value or shape that depends on
    the data, raises :class:`StepNotCapturable`."""
    compiled = torch.compile(_own_code(step), backend=_static_graph, fullgraph=True, dynamic=False)

    def run() -> Any:
        try:
            return _unlimited(compiled)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                torch._dynamo.exc.BackendCompilerFailed) as err:  # graph breaks, host reads, data-dependent shapes
            raise StepNotCapturable(f"bucket {key!r}'s step is not one tensor program: {err}") from err
    return run


@dataclass
class StatefulStep:
    """A step that changes state it also reads (e.g. commits a round into the cache it verifies against).

    Attributes:
        run: the step (zero arguments, static buffers, returns its outputs).
        save: snapshots everything ``run`` writes and returns the call that writes the snapshot back: a rehearsed
            recording (:data:`REHEARSE`) runs between the two, so only the real run's change remains.
    """

    run: Callable[[], Any]
    save: Callable[[], Callable[[], None]]

    def __call__(self) -> Any:
        return self.run()


@dataclass
class CaptureStats:
    """What a :class:`StepGraphs` did: ``capture_seconds`` per bucket (its build and first run, plus its recording on
    CUDA; with ``fused`` steps, their compilation too), ``runs`` per bucket, ``captures`` (graphs recorded, on CUDA or
    emulated on a CPU: a bucket run once is never recorded), ``dropped`` (buckets dropped beyond
    :data:`MAX_BUCKETS`), and whether the buckets are CUDA graphs."""

    captured: bool
    fused: bool = False
    capture_seconds: dict[Hashable, float] = field(default_factory=dict)
    runs: dict[Hashable, int] = field(default_factory=dict)
    captures: int = 0
    dropped: int = 0

    @property
    def total_capture_seconds(self) -> float:
        return float(sum(self.capture_seconds.values()))

    def as_dict(self) -> dict[str, Any]:
        return {"captured": self.captured, "fused": self.fused, "buckets": len(self.capture_seconds),
                "capture_seconds": round(self.total_capture_seconds, 4),
                "runs": int(sum(self.runs.values())), "graphs": self.captures, "dropped": self.dropped}


class StepGraphs:
    """One static step per bucket, captured on CUDA at its second call (see the module docstring).

    Args:
        factory: ``factory(key)`` returns the bucket's step: a zero-argument callable over the caller's static
            buffers for that bucket, returning its output tensor(s).
        device: where the steps run.
        capture: capture CUDA graphs when ``device`` is CUDA (``False``: run every step eagerly, static shapes kept).
        fuse: compile every step with TorchInductor first (:func:`compile_fuses`; on a CPU the compiled step runs).
        max_buckets: buckets kept (default :data:`MAX_BUCKETS`), the least recently run dropped first.
        unrecordable: why a GPU would not capture these steps (e.g. experts dispatched per expert on the host), or
            ``None``; such steps are not emulated on a CPU either (:data:`EMULATE_REPLAYS`): they run as they are.
    """

    def __init__(self, factory: Callable[[Hashable], Callable[[], Any]], device: torch.device,
                 capture: bool = True, fuse: bool = False, max_buckets: int | None = None,
                 unrecordable: str | None = None) -> None:
        self.factory = factory
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        self.fuse = bool(fuse)
        self.max_buckets = MAX_BUCKETS if max_buckets is None else int(max_buckets)
        self.unrecordable = unrecordable
        self.stats = CaptureStats(self.capture, self.fuse)
        self._steps: OrderedDict[Hashable, Callable[[], Any]] = OrderedDict()  # least recently run first
        self._graphs: dict[Hashable, tuple[Any, Any]] = {}  # key -> (CUDAGraph, its outputs)
        self._calls: dict[Hashable, int] = {}  # calls since each key's step was built
        self._emulated: dict[Hashable, RecordedStep] = {}  # keys recorded for an emulated replay (EMULATE_REPLAYS)
        self._compiled: set[Hashable] = set()  # keys whose step runs compiled (traced or fused): not recordable
        self._pool: Any = None

    @property
    def replays(self) -> bool:
        """Whether a call's outputs are a replay's (the same tensors every call, overwritten by the next): captured
        on CUDA, or emulated on a CPU (:data:`EMULATE_REPLAYS`). A caller that keeps outputs copies them then."""
        return self.capture or (EMULATE_REPLAYS and not self.fuse and self.unrecordable is None)

    def __contains__(self, key: Hashable) -> bool:
        return (key, numerics()) in self._steps

    def step(self, key: Hashable) -> Callable[[], Any] | None:
        """Bucket ``key``'s step under the current numerics, ``None`` before its first run."""
        return self._steps.get((key, numerics()))

    def run(self, key: Hashable) -> Any:
        """Run bucket ``key``'s step (built, and run eagerly, on its first call; on CUDA recorded as a graph at its
        :data:`RECORD_AT_CALL` (the second) and replayed from then on); returns its outputs.

        A bucket is kept per :func:`~spiffy.batch_invariance.numerics` too: a CUDA graph replays the kernels it was
        captured with, so a step captured outside the batch-invariant mode must not replay inside it (nor the
        reverse). Its :class:`CaptureStats` stay per bucket (a bucket captured under two numerics counts both)."""
        bucket, key = key, (key, numerics())
        step = self._steps.get(key)
        if step is None:  # the first call: build the step and run it eagerly (on CUDA: the capture's warm-up)
            t0 = time.perf_counter()
            step = self.factory(bucket)
            if self.fuse:  # compiled on this first call
                step = _fused(step)
            elif TRACE_STEPS and not self.capture:
                step = (StatefulStep(_traced(step.run, bucket), step.save) if isinstance(step, StatefulStep)
                        else _traced(step, bucket))
                self._compiled.add(key)
            self._steps[key] = step
            self._calls[key] = 1
            self._drop_oldest()
            out = step()
            self._count(bucket, time.perf_counter() - t0)
            return out
        self._steps.move_to_end(key)
        self.stats.runs[bucket] = self.stats.runs.get(bucket, 0) + 1
        calls = self._calls[key] = self._calls[key] + 1
        if calls < RECORD_AT_CALL:  # still warming up, eagerly
            return step()
        if not self.capture:
            if self.replays and key not in self._compiled:  # compiled code calls no ATen operation: nothing to record
                return self._emulated_replay(key, step)
            if REHEARSE and calls == RECORD_AT_CALL:  # where a GPU records the step
                self._rehearse(step)
            return step()
        recorded = self._graphs.get(key)
        if recorded is None:
            t0 = time.perf_counter()
            recorded = self._graphs[key] = self._capture(step)
            self._count(bucket, time.perf_counter() - t0, runs=0)
            self.stats.captures += 1
        graph, outputs = recorded
        graph.replay()
        return outputs

    def _count(self, bucket: Hashable, seconds: float, runs: int = 1) -> None:
        """A bucket built and run once (or recorded): its seconds, and the run."""
        self.stats.capture_seconds[bucket] = self.stats.capture_seconds.get(bucket, 0.0) + seconds
        self.stats.runs[bucket] = self.stats.runs.get(bucket, 0) + runs

    def _drop_oldest(self) -> None:
        """Drop the least recently run buckets beyond :attr:`max_buckets` (their graphs and outputs go with them)."""
        while len(self._steps) > self.max_buckets:
            old, _ = self._steps.popitem(last=False)
            self._graphs.pop(old, None)
            self._calls.pop(old, None)
            self._emulated.pop(old, None)
            self._compiled.discard(old)
            self.stats.dropped += 1

    def _capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        """Record ``step`` as a CUDA graph (no kernel runs; the bucket's eager first call was its warm-up; the shared
        pool keeps buckets' memory together). ``torch.cuda.graph`` empties the allocator's cache before it records;
        only the first recording of a pool lets it (as vLLM's graph wrapper does for all its captures but the first):
        buckets recorded mid-generation (a dLLM prefix cache's, per block) would otherwise hand the eager calls'
        cached memory back to the driver each time, and the next eager call would allocate it again."""
        first = self._pool is None
        if first:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with nullcontext() if first else _cache_kept(), torch.cuda.graph(graph, pool=self._pool):
            outputs = step()
        return graph, outputs

    def _emulated_replay(self, key: Hashable, step: Callable[[], Any]) -> Any:
        """A CPU's stand-in for a recorded graph's replay (:mod:`spiffy.capture.replay`): recorded at the bucket's
        :data:`RECORD_AT_CALL` (its run's writes put back, as recording writes nothing), replayed then and at every
        later call."""
        recorded = self._emulated.get(key)
        if recorded is None:
            restore = step.save() if isinstance(step, StatefulStep) else None
            recorded = self._emulated[key] = RecordedStep(step)
            if restore is not None:
                restore()
            self.stats.captures += 1
        # the buckets recorded after this one may hold outputs in memory that was this one's scratch (one pool)
        order = list(self._emulated)  # recording order
        for other in order[order.index(key) + 1:]:
            self._emulated[other].clobber()
        return recorded.replay()

    @staticmethod
    def _rehearse(step: Callable[[], Any]) -> None:
        """A recording on a CPU: the step's Python runs once more, its tensor writes put back
        (:class:`StatefulStep`; a plain step writes nothing it reads)."""
        restore = step.save() if isinstance(step, StatefulStep) else None
        step()
        if restore is not None:
            restore()

    def clear(self) -> None:
        """Forget every bucket (their graphs and memory)."""
        self._steps.clear()
        self._graphs.clear()
        self._calls.clear()
        self._emulated.clear()
        self._compiled.clear()
        self._pool = None
