"""Peak memory of one call (a verification forward), measured for real on either device.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before the
  call (the call's own peak on top of the weights and caches that already exist).
* CPU: the PyTorch profiler with ``profile_memory=True``; its memory timeline (``export_memory_timeline``) replays
  every allocation and free of the tensors the call touches, and the peak of the summed timeline is taken. It
  includes the tensors the call reads (weights, inputs, cache) from their first use, so compare peaks of calls on the
  same model rather than reading one as "activations only".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from spiffy.arspec.stages import RoundBuffers, TargetRunner, compile_round, prefill, prefill_inputs, verify
from spiffy.arspec.tree import build_ddtree
from spiffy.decoding import DecodeConfig, make_session
from spiffy.embedded import embedded_model_path, is_embedded_available
from spiffy.models import load_model

__all__ = ["peak_bytes", "measure_memory", "MEMORY_METHODS"]

MEMORY_METHODS: dict[str, str] = {
    "cuda": "torch.cuda.max_memory_allocated (after reset_peak_memory_stats), minus the bytes allocated before the call",
    "cpu": "torch.profiler(profile_memory=True) memory timeline: peak of the summed live bytes of the call's tensors",
}


@contextlib.contextmanager
def _kineto_silenced() -> Iterator[None]:
    """The profiler's C++ side (kineto) prints ``profiler_start`` / ``profiler_stop`` and allocator notes on file
    descriptor 2 at every use, with no setting to turn them off: point fd 2 at /dev/null while it runs (Python
    errors still propagate as exceptions)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak bytes of ``fn()`` on ``device`` (see the module docstring for what each device's figure means)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - before)
    with _kineto_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                     with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.export_memory_timeline(path, device="cpu")
        with open(path, encoding="utf-8") as fh:
            _times, sizes = json.load(fh)
    return int(max((sum(s) for s in sizes), default=0))


def _spiffy_rows(budget: int, device: torch.device, prompt_len: int, gen_length: int, block: int) -> list[dict[str, Any]]:
    """The embedded tiny LLaDA, per cache mode: ``forward_states`` of the real state vs the real state + ``budget``
    drafts (each draft = the state with one more block position decoded) at the first block's second step."""
    model = load_model(embedded_model_path("dllm-llada"), device=device)
    vocab = int(model.config.vocab_size)
    prompt = (torch.arange(prompt_len) % (vocab // 2) + 3).unsqueeze(0)
    rows = []
    for mode in ("none", "prefix", "dual"):
        cfg = DecodeConfig(gen_length=gen_length, block_length=block, steps=gen_length, cache=mode)
        session = make_session(model, prompt, cfg)
        session.begin_block(0)
        x = session.x
        start = session.prompt_len
        drafts = x.repeat(budget, 1)
        for k in range(budget):
            drafts[k, start + k] = 3 + k
        states = torch.cat([x, drafts])
        with torch.no_grad():
            base = peak_bytes(lambda: session.forward_states(x), device)
            spec = peak_bytes(lambda: session.forward_states(states), device)
        rows.append({"model": "tiny LLaDA (embedded)", "case": f"Spiffy, cache {mode}, 1 + {budget} states",
                     "baseline_bytes": base, "speculative_bytes": spec})
    return rows


def _ddtree_rows(budgets: Sequence[int], device: torch.device, context: int, depth: int) -> list[dict[str, Any]]:
    """The embedded tiny Qwen3 target on a ``context``-token prompt: one tree verification forward per budget vs the
    AR baseline's one-token forward (root only)."""
    target = load_model(embedded_model_path("ar-target"), device=device)
    vocab = int(target.config.vocab_size)
    runner = TargetRunner.for_target(target)
    prompt = (torch.arange(context) % (vocab // 2) + 3).tolist()
    g = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 3, dim=-1)
    buffers = RoundBuffers.allocate(1, 1 + max([0, *budgets]))
    peaks: dict[int, int] = {}
    with torch.no_grad():
        ids, positions, mask, valid, _pads = prefill_inputs([prompt], runner.device, runner.dtype)
        prefill(runner, ids, positions, mask)
        for budget in [0, *budgets]:
            tree = build_ddtree(logprobs, int(budget))
            compiled, _rows = compile_round([tree], [(5, context)], valid, runner.dtype, buffers)
            peaks[int(budget)] = peak_bytes(lambda: verify(runner, compiled), device)
            runner.cache.crop(-(1 + tree.num_nodes))
    return [{"model": "tiny Qwen3 target (embedded)", "case": f"DDTree, budget {b} (AR: 1 row)",
             "baseline_bytes": peaks[0], "speculative_bytes": peaks[b]} for b in budgets]


def measure_memory(spiffy_budget: int, budgets: Sequence[int], *, device: torch.device | str = "cpu", prompt_len: int = 16,
                   gen_length: int = 64, block: int = 32, context: int = 64, depth: int = 16) -> dict[str, Any]:
    """Peak memory of one verification forward against the baseline's one forward (see the module docstring)."""
    dev = torch.device(device)
    out: dict[str, Any] = {"method": MEMORY_METHODS["cuda" if dev.type == "cuda" else "cpu"], "rows": [], "missing": []}
    if is_embedded_available("dllm-llada"):  # LLaDA: every cache mode (SDAR has only its prefix cache)
        out["rows"] += _spiffy_rows(spiffy_budget, dev, prompt_len, gen_length, block)
    else:
        out["missing"].append("dllm-llada")
    if is_embedded_available("ar-target"):
        out["rows"] += _ddtree_rows(budgets, dev, context, depth)
    else:
        out["missing"].append("ar-target")
    return out
