"""Static-shape steps captured once per bucket and replayed: the one home of CUDA-graph capture in spiffy.

A *step* is a zero-argument callable over tensors the caller owns and fills in place (static buffers: same shape,
same address every call); it returns output tensors. :class:`StepGraphs` keeps one step per *bucket* (any hashable
key: ``(rows, nodes)`` for AR verification, ``(states, window)`` for a dLLM forward), built lazily by a factory the
first time the bucket is asked for, and reused for every later call (across rounds, prompts and generations, as
long as the owner of the buffers lives).

* On CUDA with ``capture=True`` the first call of a bucket warms the step up on a side stream (allocator and
  kernel autotuning settle), captures it in a :class:`torch.cuda.CUDAGraph` (all buckets share one memory pool)
  and replays it; later calls only replay. Output tensors live in the graph's pool and are overwritten by the
  next replay of the same bucket: read or copy them before that.
* Anywhere else (the CPU, or ``capture=False``) the step runs eagerly with the same static shapes, which is what the
  CPU suite runs: the code a GPU captures is the code the tests check against the eager reference.

Capture is transparent only for steps that are pure tensor programs: no host synchronisation, no Python branch on
tensor values, no allocation whose size depends on data. Hooks registered on modules fire during the warm-up and the
capture but not on replay; a step that needs what a hook saw returns it as an output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from spiffy.errors import ConfigError

__all__ = ["AUTO_ON_CUDA", "CaptureStats", "CompileSetting", "StepGraphs", "bucket_size", "resolve_compile"]

#: what ``compile=`` accepts: ``"auto"`` / ``None`` (the default), ``True`` / ``"on"``, ``False`` / ``"off"``
CompileSetting = bool | str | None

#: whether ``compile="auto"`` turns the captured path on on CUDA. Off until a GPU run shows the captured path never
#: slower than eager after warm-up (``scripts/gpu_run.py``, section ``captured``); CPUs always run eager under auto
AUTO_ON_CUDA = False

#: warm-up runs before a capture (the first run allocates, the second sees a settled allocator)
WARMUP_RUNS = 2


def resolve_compile(setting: CompileSetting, device: torch.device) -> bool:
    """Whether the static (captured on CUDA) path runs for ``setting`` on ``device``.

    ``True`` / ``"on"``: always (the static code runs eagerly where nothing can be captured); ``False`` /
    ``"off"``: never (eager, the reference); ``None`` / ``"auto"``: on CUDA when :data:`AUTO_ON_CUDA`, never on a CPU.
    """
    if isinstance(setting, bool):
        return setting
    name = "auto" if setting is None else str(setting).lower()
    if name in ("on", "true", "1"):
        return True
    if name in ("off", "false", "0"):
        return False
    if name == "auto":
        return AUTO_ON_CUDA and device.type == "cuda"
    raise ConfigError(f"compile={setting!r} is not a setting; fix: pass compile=True, False or 'auto' "
                      "(--compile on|off|auto)")


def bucket_size(needed: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``needed``; ConfigError when none does."""
    for s in sizes:
        if s >= needed:
            return int(s)
    raise ConfigError(f"no bucket holds {needed} (buckets {list(sizes)}); fix: allocate a larger bucket")


@dataclass
class CaptureStats:
    """What a :class:`StepGraphs` did: ``capture_seconds`` per bucket (warm-up + capture, or the first eager run),
    ``runs`` per bucket, and whether its buckets are CUDA graphs."""

    captured: bool
    capture_seconds: dict[Hashable, float] = field(default_factory=dict)
    runs: dict[Hashable, int] = field(default_factory=dict)

    @property
    def total_capture_seconds(self) -> float:
        return float(sum(self.capture_seconds.values()))

    def as_dict(self) -> dict[str, Any]:
        return {"captured": self.captured, "buckets": len(self.capture_seconds),
                "capture_seconds": round(self.total_capture_seconds, 4),
                "runs": int(sum(self.runs.values()))}


class StepGraphs:
    """One static step per bucket, captured lazily on CUDA (see the module docstring).

    Args:
        factory: ``factory(key)`` returns the bucket's step: a zero-argument callable over the caller's static
            buffers for that bucket, returning its output tensor(s).
        device: where the steps run.
        capture: capture CUDA graphs when ``device`` is CUDA (``False``: run every step eagerly, static shapes kept).
    """

    def __init__(self, factory: Callable[[Hashable], Callable[[], Any]], device: torch.device,
                 capture: bool = True) -> None:
        self.factory = factory
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        self.stats = CaptureStats(self.capture)
        self._steps: dict[Hashable, Callable[[], Any]] = {}
        self._graphs: dict[Hashable, tuple[Any, Any]] = {}  # key -> (CUDAGraph, its outputs)
        self._pool: Any = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._steps

    def run(self, key: Hashable) -> Any:
        """Run bucket ``key``'s step (building, and on CUDA capturing, it on first use); returns its outputs."""
        step = self._steps.get(key)
        if step is None:
            t0 = time.perf_counter()
            step = self._steps[key] = self.factory(key)
            if self.capture:
                self._graphs[key] = self._capture(step)
            else:
                out = step()
                self.stats.capture_seconds[key] = time.perf_counter() - t0
                self.stats.runs[key] = 1
                return out
            self.stats.capture_seconds[key] = time.perf_counter() - t0
        self.stats.runs[key] = self.stats.runs.get(key, 0) + 1
        if self.capture:
            graph, outputs = self._graphs[key]
            graph.replay()
            return outputs
        return step()

    def _capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        """Warm ``step`` up on a side stream, then capture it (the shared pool keeps buckets' memory together)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = step()
        return graph, outputs

    def clear(self) -> None:
        """Forget every bucket (their graphs and memory)."""
        self._steps.clear()
        self._graphs.clear()
        self._pool = None
