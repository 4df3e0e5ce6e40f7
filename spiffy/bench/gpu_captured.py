"""Eager against captured, through the public entry point (``scripts/gpu_run.py``, section ``captured``).

For each real-size target (random weights, the published ``config.json``): ``ddtree_generate`` with ``compile=False``
and ``compile=True`` for plain AR, DFlash and DDTree at several budgets (a random DFlash drafter: tau near 1, so a
round's cost is what is measured; captured, its block forward is a captured step too), each timed on its third call
(the first builds the buckets and runs each eagerly, the second records their CUDA graphs; both times are reported,
and the buckets' capture seconds, the target's and the drafter's apart),
with a round's time per stage (draft, tree build, compile, verify, commit), beside transformers'
``generate(cache_implementation="static")`` and the memory bandwidth limit of a decode (the target's weight bytes
over a measured read bandwidth). One more DDTree row runs the rejection rule at T = 1 (``speculative_generate``:
its draws, tree walk and bonus on the device when captured). ms per round and ms per token are measurements at the
measured tau; nothing here is projected. :func:`inductor_timings` times ``compile="inductor"`` (section
``inductor``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, ddtree_generate, speculative_generate
from spiffy.arspec.captured import static_target_of
from spiffy.arspec.captured_drafter import static_drafter_of
from spiffy.arspec.methods import get_method
from spiffy.bench import gpu_costs

__all__ = ["captured_timings", "inductor_timings", "read_bandwidth"]


def read_bandwidth(device: torch.device, gib: float = 2.0, reps: int = 5) -> float:
    """Bytes per second of a streaming read (``sum`` over a ``gib`` GiB tensor), median of ``reps``."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.float16, device=device)
    seconds = gpu_costs.time_ms(lambda: x.sum(), device, warmup=1, reps=reps) / 1e3
    return x.numel() * x.element_size() / seconds



def _row(target: torch.nn.Module, drafter: Any, prompt: list[int], method: str, budget: int | None, new: int,
         mode: bool | str, device: torch.device, accept: str = "coupled") -> dict[str, Any]:
    kw = {"method": method, "budget": budget, "max_new_tokens": new, "compile": mode}

    def generate() -> Any:
        if accept == "coupled":  # greedy: the keyword entry point with its defaults
            return ddtree_generate(target, drafter, prompt, **kw)
        config = ARSpecConfig(method=method, budget=budget, max_new_tokens=new, accept=accept,
                              sampling=SamplingConfig(temperature=1.0, seed=0))
        return speculative_generate(target, as_drafter(drafter), prompt, config, compile=mode)

    first, first_s = gpu_costs.timed(device, generate)  # builds every bucket (each run eagerly once)
    second_s = gpu_costs.timed(device, generate)[1] if mode else None  # records them (a bucket's second call)
    res, _s = gpu_costs.timed(device, generate)
    decode = res.seconds - res.prefill_seconds
    row = {"method": method, "budget": budget, "accept": accept, "compile": mode, "tokens": len(res.tokens),
           "rounds": res.rounds,
           "tau": res.tau, "ms_per_round": 1e3 * decode / max(res.rounds, 1),
           "ms_per_token": 1e3 * decode / max(len(res.tokens) - 1, 1), "first_call_s": first_s,
           "second_call_s": second_s, "same_tokens_as_first_call": first.tokens == res.tokens,
           # the stages a round spends its time in (the draft stage: the drafter's block forward and read-out)
           "ms_per_round_by_stage": {k: 1e3 * v / max(res.rounds, 1) for k, v in res.stage_times.items()}}
    if mode:
        static = static_target_of(target)
        row["capture"] = None if static is None else static.graphs.stats.as_dict()
        if get_method(method).needs_drafter and drafter is not None:  # the drafter's block forward, captured as the target's steps are
            drafting = static_drafter_of(drafter)
            row["drafter_capture"] = None if drafting is None else drafting.graphs.stats.as_dict()
    return row


def captured_timings(device: torch.device, dtype: torch.dtype, small: bool,
                     budgets: Sequence[int] = (16, 64, 256)) -> dict[str, Any]:
    """Per target: the eager and captured rows, transformers' static-cache generate, the bandwidth limit."""
    size = gpu_costs.shrink_config if small else (lambda c: c)
    prompt_len, new = (16, 8) if small else (512, 64)
    budgets = budgets[:1] if small else budgets
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": new,
                           "label": "MEASURED: random weights (tau near 1: the cost of a round)"}
    bandwidth = read_bandwidth(device, 0.0625 if small else 2.0)
    out["read_bandwidth_gb_s"] = bandwidth / 1e9
    for name, fixture in (("Qwen3-8B", "Qwen--Qwen3-8B"), ("Qwen3-30B-A3B", "Qwen--Qwen3-30B-A3B")):
        config = size(gpu_costs.real_config(fixture))
        target = gpu_costs.build_random(config, device, dtype)
        vocab = int(target.config.vocab_size)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in target.parameters()}.values())
        entry: dict[str, Any] = {"parameters": gpu_costs.count_parameters(target),
                                 "bandwidth_limit_ms_per_token": 1e3 * weight_bytes / bandwidth, "rows": []}
        drafter = None
        if name == "Qwen3-8B":  # the one shipped drafter config (z-lab's Qwen3-8B DFlash)
            drafter = gpu_costs.build_random(size(gpu_costs.real_config("z-lab--Qwen3-8B-DFlash-b16")), device, dtype)
        runs: list[tuple[str, int | None, str]] = [("ar", None, "coupled")]
        if drafter is not None:
            runs += [("dflash", None, "coupled")] + [("ddtree", b, "coupled") for b in budgets]
            runs.append(("ddtree", 64 if 64 in budgets else budgets[0], "rejection"))
        for method, budget, accept in runs:
            for mode in (False, True):
                try:
                    entry["rows"].append(_row(target, drafter, prompt, method, budget, new, mode, device, accept))
                except Exception as exc:  # noqa: BLE001  (a failed row is a result to report)
                    entry["rows"].append({"method": method, "budget": budget, "accept": accept, "compile": mode,
                                          "error": f"{type(exc).__name__}: {exc}"[:300]})
        entry["transformers_static"] = _transformers_static(target, prompt, new, device, small)
        out[name] = entry
        del target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def inductor_timings(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, Any]:
    """Qwen3-8B plain AR and DDTree@64 with ``compile="inductor"`` (the captured steps compiled by TorchInductor:
    fused kernels), timed as :func:`captured_timings` times its rows; the first call's seconds include the
    compilation of every bucket. Its own section, after the others: compiling an 8B target takes minutes. The CPU
    self-check skips it (``tests/test_captured_steps.py`` runs the mode on tiny models)."""
    if small:
        return {"skipped": "the self-check does not compile with TorchInductor (minutes on a CPU)"}
    target = gpu_costs.build_random(gpu_costs.real_config("Qwen--Qwen3-8B"), device, dtype)
    drafter = gpu_costs.build_random(gpu_costs.real_config("z-lab--Qwen3-8B-DFlash-b16"), device, dtype)
    vocab = int(target.config.vocab_size)
    prompt_len, new = 512, 64
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": new, "rows": [],
                           "label": "MEASURED: random weights (tau near 1: the cost of a round)"}
    for method, budget in (("ar", None), ("ddtree", 64)):
        try:
            out["rows"].append(_row(target, drafter, prompt, method, budget, new, "inductor", device))
        except Exception as exc:  # noqa: BLE001  (a failed row is a result to report)
            out["rows"].append({"method": method, "budget": budget, "compile": "inductor",
                                "error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def _transformers_static(target: torch.nn.Module, prompt: list[int], new: int, device: torch.device,
                         small: bool) -> dict[str, Any]:
    """transformers' own ``generate(cache_implementation="static")`` (its automatic compile on CUDA): ms/token of
    the second call, and the first call's seconds."""
    ids = torch.tensor([prompt], device=device)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "cache_implementation": "static"}
    if small:
        kw["disable_compile"] = True
    try:
        _o, first = gpu_costs.timed(device, lambda: target.generate(ids, **kw))
        short, t_short = gpu_costs.timed(device, lambda: target.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}))
        _o, t_full = gpu_costs.timed(device, lambda: target.generate(ids, **kw))
        return {"ms_per_token": 1e3 * (t_full - t_short) / max(new - 1, 1), "first_call_s": first}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
