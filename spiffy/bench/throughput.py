"""``spiffy bench dllm|ar --batch-sizes 1,4,16``: throughput of every method at several batch sizes, in one run.

The same ``N`` prompts (the benchmark prompts, cycled up to the largest batch size) are decoded at every batch size
``b``, ``b`` prompts per call, by every method: the dLLM baseline and Spiffy at each budget (batched Spiffy,
:mod:`spiffy.selfspec.runtime`), or plain AR, DFlash and DDTree at each budget (:mod:`spiffy.arspec.batch`) and, with a
diffusion drafter, DEER, SpecDiff-2 at each draft count and DDTree over the diffusion drafter's marginals.
Reported per method and batch size:

* ``tokens_per_second``: generated tokens of all ``N`` prompts / total wall time of the calls;
* ``latency_per_token_ms``: mean over calls of (call time / tokens generated per row), i.e. how long one user waits
  per token of their own answer;
* ``forwards``: model calls of all calls (dLLM: NFE; AR: verification rounds of the longest row per call are not
  tracked, so the AR report gives ``rounds`` summed over rows);
* ``identical_to_batch_1``: the fraction of prompts whose tokens equal the batch-1 run of the same method (1.0 in
  float32/float64 for every method: each row is decoded exactly as that prompt alone, with its own random
  generator);
* ``divergences``: for every prompt whose batched tokens differ from batch 1 (half precision: the batched forward
  rounds differently), the near-tie proof of :mod:`spiffy.bench.batch_fidelity` (kind, gap, bound, deviation in
  ulps, ``near_tie``); ``all_divergences_near_ties`` is true when there are some and each is proven.

Speedups are ratios of measured wall times in this run, each with its 95% interval over the calls of that batch size
(paired bootstrap, :mod:`spiffy.bench.stats`: method and plain method decode the same prompts in the same calls; no
interval from a single call); on a 2-core CPU the forward is compute-bound at any batch
size, so batching helps little there and speculative gains stay roughly constant; on a GPU the forward is
memory-bound at small batches, and speculative gains shrink as the batch grows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from spiffy.api import generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.dllm_drafter import as_drafter
from spiffy.arspec.methods import (
    AR,
    DDTREE,
    DDTREE_DFLASH2,
    DDTREE_DLLM,
    DEER,
    DFLASH,
    DFLASH2,
    DFLASH2_DRAFTER,
    DLLM_DRAFTER,
    SPECDIFF,
)
from spiffy.bench.batch_fidelity import BATCH_NEAR_TIE_RULE, explain_dllm_batch_row
from spiffy.bench.fidelity import NearTieProof
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.bench.common import environment_info
from spiffy.bench.datasets import BenchPrompt
from spiffy.bench.stats import interval_method, ratio_of_means_interval
from spiffy.errors import ConfigError
from spiffy.models.ar_drafters import drafter_kind
from spiffy.models.prompting import prompt_token_ids
from spiffy.sampling import SamplingConfig

#: one batched call: prompts (token-id lists) -> (token lists per row, forwards or rounds of the call)
BatchCall = Callable[[list[list[int]]], tuple[list[list[int]], int]]
#: the near-tie proof of one row: (the batch's prompts, the row that differs from its batch-1 run) -> divergence
Explain = Callable[[list[list[int]], int], "NearTieProof | None"]


@dataclass
class BatchMethod:
    """A :data:`BatchCall` with the proof :func:`measure` runs for a batched row that differs from batch 1."""

    call: BatchCall
    explain: Explain | None = None

    def __call__(self, batch: list[list[int]]) -> tuple[list[list[int]], int]:
        return self.call(batch)


def parse_batch_sizes(text: str | Sequence[int]) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (ConfigError for empty, non-integer or < 1 entries)."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    try:
        sizes = [int(t) for t in items if t]
    except ValueError:
        raise ConfigError(f"--batch-sizes {text!r} must be comma-separated integers, e.g. 1,4,16") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch-sizes {text!r} needs at least one batch size, each >= 1; fix: e.g. 1,4,16")
    return sizes


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(methods: dict[str, BatchCall | BatchMethod], prompts: list[list[int]], batch_sizes: Sequence[int], device: Any,
            warmup: int = 1) -> list[dict[str, Any]]:
    """Run every method at every batch size on the same prompts (cycled to the largest batch size)."""
    n = max(len(prompts), max(batch_sizes))
    work = [prompts[k % len(prompts)] for k in range(n)]
    for _ in range(max(0, warmup)):
        for call in methods.values():
            call(work[:1])
    rows: list[dict[str, Any]] = []
    reference: dict[str, list[list[int]]] = {}
    for name, call in methods.items():
        for b in batch_sizes:
            tokens: list[list[int]] = []
            seconds, latencies, forwards, call_seconds = 0.0, [], 0, []
            for start in range(0, n, b):
                chunk = work[start : start + b]
                _sync(device)
                t0 = time.perf_counter()
                out, calls = call(chunk)
                _sync(device)
                dt = time.perf_counter() - t0
                seconds += dt
                call_seconds.append(dt)
                forwards += calls
                per_row = max(1, max(len(t) for t in out))
                latencies.append(dt / per_row)
                tokens.extend(out)
            reference.setdefault(name, tokens)
            ref = reference[name]
            same = sum(1 for a, c in zip(tokens, ref) if a == c) / len(ref)
            total = sum(len(t) for t in tokens)
            divergences = _divergences(getattr(call, "explain", None), work, tokens, ref, b)
            rows.append({
                "method": name, "batch_size": b, "prompts": n, "tokens": total, "seconds": seconds,
                "tokens_per_second": total / seconds if seconds > 0 else None,
                "latency_per_token_ms": 1000.0 * sum(latencies) / len(latencies), "forwards": forwards,
                "identical_to_batch_1": same, "call_seconds": call_seconds, "divergences": divergences,
                "all_divergences_near_ties": bool(divergences) and all(d["near_tie"] for d in divergences),
            })
    return rows


def _divergences(explain: Explain | None, work: list[list[int]], tokens: list[list[int]], ref: list[list[int]],
                 b: int) -> list[dict[str, Any]]:
    """The near-tie proof of every prompt whose batch-``b`` tokens differ from its batch-1 tokens (after the timed
    calls; a method without a proof, or a divergence the proof's re-run does not reproduce, counts as unproven)."""
    out: list[dict[str, Any]] = []
    for k, (got, want) in enumerate(zip(tokens, ref)):
        if got == want:
            continue
        start = (k // b) * b
        div = explain(work[start : start + b], k - start) if explain is not None else None
        found = {"near_tie": False, "kind": "unproven"} if div is None else div.to_dict()
        out.append({"prompt": k, **found})
    return out


def dllm_methods(model: Any, tokenizer: Any, config: Any, graph: Any, budgets: Sequence[int], device: Any,
                 extra: dict[str, Any], *, score: str | None = None) -> dict[str, BatchMethod]:
    """The dLLM baseline and batched Spiffy at each budget as :data:`BatchCall` s (left-padded batches); ``score``:
    the pruning score (``None`` = the graph's recorded one, else ``"gm"``)."""

    def make(budget: int | None) -> BatchMethod:
        def call(batch: list[list[int]]) -> tuple[list[list[int]], int]:
            width = max(len(ids) for ids in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for r, row in enumerate(batch):
                ids[r, width - len(row) :] = torch.tensor(row, dtype=torch.long, device=device)
                mask[r, width - len(row) :] = 1
            res = generate(model, ids, config, attention_mask=None if bool(mask.all()) else mask, tokenizer=tokenizer,
                           graph=None if budget is None else graph, budget=budget, score=score, **extra)
            return res.tokens, int(res.nfe)

        def explain(batch: list[list[int]], row: int) -> NearTieProof | None:
            return explain_dllm_batch_row(model, batch, row, config, graph=None if budget is None else graph,
                                          budget=budget, score=score, tokenizer=tokenizer, overrides=extra)
        return BatchMethod(call, explain)

    methods = {"baseline": make(None)}
    methods.update({f"Spiffy D*={b}": make(b) for b in budgets})
    return methods


def ar_methods(target: Any, drafter: Any, budgets: Sequence[int], *, max_new_tokens: int, temperature: float,
               top_p: float, top_k: int, seed: int, stops: Sequence[int], dllm_drafter: Any = None,
               drafts: Sequence[int] = (4,)) -> dict[str, BatchMethod]:
    """Plain AR, DFlash and DDTree at each budget as :data:`BatchCall` s (``speculative_generate_batch``, one fresh
    drafter wrapper per row; DFlash2's chain and DDTree when ``drafter`` is a DFlash2 drafter); with a ``dllm_drafter`` (a loaded diffusion drafter model) also DEER, SpecDiff-2 at each
    of ``drafts`` and DDTree over its marginals at each budget."""
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    common = dict(max_new_tokens=int(max_new_tokens), stop_token_ids=tuple(int(t) for t in stops), sampling=sampling)

    def make(config: ARSpecConfig, model: Any) -> BatchMethod:
        """``config`` on every row of a call, each row with its own wrapper of the drafter ``model`` (``None``:
        plain AR)."""
        def call(batch: list[list[int]]) -> tuple[list[list[int]], int]:
            drafters = None if model is None else [as_drafter(model) for _ in batch]
            res = speculative_generate_batch(target, drafters, batch, config)
            return [list(r.tokens) for r in res], sum(int(r.rounds) for r in res)

        def explain(batch: list[list[int]], row: int) -> NearTieProof | None:
            return explain_ar_batch_row(target, None if model is None else (lambda: as_drafter(model)), batch, row,
                                        config)
        return BatchMethod(call, explain)

    dflash2 = drafter is not None and drafter_kind(drafter) == DFLASH2_DRAFTER.name
    chain, tree = (DFLASH2, DDTREE_DFLASH2) if dflash2 else (DFLASH, DDTREE)
    methods = {AR.label: make(ARSpecConfig(method=AR.name, **common), None),  # type: ignore[arg-type]
               chain.label: make(ARSpecConfig(method=chain.name, **common), drafter)}  # type: ignore[arg-type]
    methods.update({f"{tree.label} {b}": make(ARSpecConfig(method=tree.name, budget=int(b), **common), drafter)  # type: ignore[arg-type]
                    for b in budgets})
    if dllm_drafter is not None:
        methods[DEER.label] = make(ARSpecConfig(method=DEER.name, **common), dllm_drafter)  # type: ignore[arg-type]
        methods.update({f"{SPECDIFF.label} K={k}": make(ARSpecConfig(method=SPECDIFF.name, drafts=int(k), **common), dllm_drafter)  # type: ignore[arg-type]
                        for k in drafts})
        methods.update({f"{DDTREE_DLLM.label} {b} ({DLLM_DRAFTER.label})":
                        make(ARSpecConfig(method=DDTREE_DLLM.name, budget=int(b), **common), dllm_drafter)  # type: ignore[arg-type]
                        for b in budgets})
    return methods


def throughput_report(kind: str, rows: list[dict[str, Any]], *, model: Any, device: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready report: the rows plus speedups over the plain method at the same batch size, each with its 95%
    interval over the calls (``speedup_interval``; ``None`` for the plain method itself and for a single call)."""
    plain = "baseline" if kind == "dllm" else AR.label
    base = {r["batch_size"]: r for r in rows if r["method"] == plain}
    for r in rows:
        ref = base.get(r["batch_size"])
        r["speedup"] = (ref["seconds"] / r["seconds"]) if ref and r["seconds"] > 0 else None
        paired = ref is not None and ref is not r and "call_seconds" in r and "call_seconds" in ref
        r["speedup_interval"] = ratio_of_means_interval(ref["call_seconds"], r["call_seconds"]) if paired else None
    return {"kind": f"throughput-{kind}", "rows": rows, "intervals": interval_method("call"),
            "environment": environment_info(model, device), **meta}


def markdown_throughput(res: dict[str, Any]) -> str:
    """The throughput report as a Markdown table (one row per method and batch size)."""
    lines = [
        f"# spiffy bench {res['kind'].split('-')[-1]}: throughput by batch size",
        "",
        f"{res.get('prompts', '?')} prompts from {res.get('dataset')}; every method decodes the same prompts at every "
        "batch size. Speedup = plain method's wall time / this method's, same batch size"
        + (f"; brackets: {res['intervals']}; n.s.: the interval includes 1.0." if res.get("intervals") else "."),
        "",
        "| method | batch | tokens/s | latency/token (ms) | speedup | forwards | identical to batch 1 | "
        "divergences proven near ties |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        tps = "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.1f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        iv = r.get("speedup_interval")
        if iv:
            sp += f" [{iv['low']:.2f}, {iv['high']:.2f}]" + (" n.s." if iv["includes_one"] else "")
        divs = r.get("divergences") or []
        proven = f"{sum(1 for d in divs if d['near_tie'])}/{len(divs)}" if divs else "-"
        lines.append(f"| {r['method']} | {r['batch_size']} | {tps} | {r['latency_per_token_ms']:.1f} | {sp} | "
                     f"{r['forwards']} | {r['identical_to_batch_1']:.2f} | {proven} |")
    if any(r.get("divergences") for r in res["rows"]):
        lines += ["", f"Batched rows that differ from batch 1 (rounding of another reduction shape): {BATCH_NEAR_TIE_RULE}."]
        for r in res["rows"]:
            for d in r.get("divergences") or []:
                verdict = "near tie" if d["near_tie"] else "NOT proven a near tie (a bug)"
                lines.append(f"- {r['method']} @ {r['batch_size']}, prompt {d['prompt']}: {d['kind']} at token "
                             f"{d.get('position')}, gap {d.get('gap')} (bound {d.get('bound')}), logits "
                             f"{d.get('deviation_ulps')} ulps apart: {verdict}")
    env = res.get("environment", {})
    lines += ["", f"Environment: {', '.join(f'{k}={v}' for k, v in env.items() if not isinstance(v, dict))}"]
    return "\n".join(lines) + "\n"


def encode_prompts(tokenizer: Any, prompts: Sequence[BenchPrompt], chat: bool) -> list[list[int]]:
    """Token ids of the benchmark prompts (chat template when ``chat`` and available)."""
    return [prompt_token_ids(tokenizer, p.prompt, chat=chat) for p in prompts]


__all__ = [
    "BatchMethod",
    "ar_methods",
    "dllm_methods",
    "encode_prompts",
    "markdown_throughput",
    "measure",
    "parse_batch_sizes",
    "throughput_report",
]
