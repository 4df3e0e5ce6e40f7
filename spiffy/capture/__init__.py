"""The one capture home: static-shape steps per bucket, captured in CUDA graphs on a GPU (run eagerly elsewhere),
the ``compile=`` switch, and the preallocated K/V cache of captured target steps. AR verification
(:mod:`spiffy.arspec.captured`) uses it; a dLLM session's ``forward_states`` plugs in the same way (a
:class:`StepGraphs` keyed by ``(states, window)`` over the session's static buffers)."""

from spiffy.capture.graphs import (AUTO_ON_CUDA, CaptureStats, CompileSetting, StatefulStep, StepGraphs,
                                   StepNotCapturable, bucket_size, compile_fuses, emulate_replays, resolve_compile,
                                   trace_steps)
from spiffy.capture.static_cache import SlotCache, slot_cache_supported

__all__ = ["AUTO_ON_CUDA", "CaptureStats", "CompileSetting", "SlotCache", "StatefulStep", "StepGraphs",
           "StepNotCapturable",
           "bucket_size", "compile_fuses", "emulate_replays", "resolve_compile", "slot_cache_supported", "trace_steps"]
