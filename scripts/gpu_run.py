#!/usr/bin/env python
"""The GPU run: lossless checks on CUDA in bfloat16, forward costs at real sizes, CUDA-graph verification, and the
speedups they project. One command, at most 9 minutes on one H100/H200:

    PYTHONPATH=. python scripts/gpu_run.py --out docs/gpu

It needs only torch with CUDA, transformers and accelerate (spiffy from the working tree via PYTHONPATH). Every
section writes its rows to ``results.json`` as soon as it ends (a run cut short keeps what it measured) and
``GPU_RESULTS.md`` summarises them. Sections:

1. ``lossless``: random tiny LLaDA / Dream / SDAR in bfloat16 on CUDA, every cache mode, SDPA and flex attention
   (compiled on CUDA), T = 0 and T = 0.7 seeded: Spiffy (FreeDave's chain graph, 3 drafts) equals the baseline
   bitwise; batched Spiffy equals the batched baseline. Random tiny Qwen3 + DFlash drafter: DFlash and DDTree
   against AR (greedy and seeded), first divergence reported.
2. ``bench``: ``spiffy bench dllm`` and ``spiffy bench ar`` on the embedded trained models, bfloat16 on CUDA
   (identical outputs, NFE reductions and tau: the acceptance the projections use).
3. ``costs``: random-weight LLaDA-8B and SDAR-8B (one ``forward_states`` over 1..8 states per cache mode),
   Qwen3-8B and Qwen3-30B-A3B (1-token decode against tree verification of 16..1024 nodes over a 1,024-token
   context, eager and captured in a CUDA graph), the Qwen3-8B DFlash drafter (one block).
4. ``captured``: the public entry point eager against ``compile=True`` (Qwen3-8B with a random DFlash drafter: AR,
   DFlash, DDTree at 16 / 64 / 256; Qwen3-30B-A3B: AR), ms per round and per token, capture time, beside
   transformers' static-cache ``generate`` and the bandwidth limit (:mod:`spiffy.bench.gpu_captured`).
   ``dllm_captured``: ``spiffy.generate`` eager against ``compile=True`` for LLaDA-8B, SDAR-8B and LLaDA2.0-mini
   (baseline, Spiffy, FreeDave, SSD at 4 states per forward; ms per forward and per token beside the bandwidth
   limit; LLaDA-8B's prefix-cache forward alone at 1 and 4 states) (:mod:`spiffy.bench.gpu_dllm`).
   ``inductor``: Qwen3-8B plain AR and DDTree@64 with ``compile="inductor"`` (the captured steps compiled by
   TorchInductor first: fused kernels), the first call's seconds being the compilation (skipped by the self-check).
5. ``exactness``: random-weight LLaDA-8B, SDAR-8B and Qwen3-8B + DFlash drafter in float32 (TF32 off), bfloat16 and
   bfloat16 in batch-invariant mode: Spiffy vs baseline, DFlash / DDTree vs AR, batched rows vs alone; float32 and
   the batch-invariant mode must be bitwise, every bfloat16 divergence a proven near tie
   (:mod:`spiffy.bench.exactness`); the mode's cost per token, eager and captured (``compile=True``: AR and
   DDTree@16), the mode's linear layers on int8 digit products (:mod:`spiffy.exact_linear`).
6. ``projections``: measured acceptance x measured costs. Labelled projections: a real model's acceptance is not
   the tiny models'.

``--self-check`` runs every section at toy sizes on the CPU in under a minute (the suite runs it so the script
cannot rot), its captured buckets replayed as a GPU replays them (:func:`spiffy.capture.emulate_replays`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import transformers

import spiffy
from spiffy.arspec import ddtree_generate
from spiffy.bench import exactness as exact
from spiffy.bench import gpu_costs as gc_costs
from spiffy.bench.gpu_captured import captured_timings, inductor_timings
from spiffy.bench.gpu_dllm import dllm_captured_markdown, dllm_captured_timings
from spiffy.capture import emulate_replays
from spiffy.decoding import DecodeConfig
from spiffy.io import atomic_write_json, atomic_write_text
from spiffy.models import load_model
from spiffy.models.dflash import load_drafter
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.freedave import chain_graph_for

CACHES = {"llada": ("none", "prefix", "dual"), "dream": ("none", "prefix", "dual"), "sdar": ("prefix",)}


class Run:
    """Results so far, saved after every section; the time budget every section checks."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline, self.data = out, time.monotonic() + budget_s, {"sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def partial(self, name: str, result: Any) -> None:
        """A section's results so far, saved at once (replaced by the whole result when the section ends)."""
        self.data["sections"][name] = {"partial": result}
        atomic_write_json(self.out / "results.json", self.data)

    def section(self, name: str, fn: Callable[[], Any], min_left_s: float = 0.0) -> None:
        if self.left() < min_left_s:
            self.data["sections"][name] = {"skipped": f"{self.left():.0f} s left, needs {min_left_s:.0f} s"}
        else:
            t0 = time.monotonic()
            try:
                self.data["sections"][name] = {"result": fn()}
            except Exception as exc:  # noqa: BLE001  (record the failure, keep the other sections)
                self.data["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                               "traceback": traceback.format_exc()[-3000:]}
            self.data["sections"][name]["seconds"] = round(time.monotonic() - t0, 1)
            print(f"[gpu_run] {name}: {self.data['sections'][name].get('error', 'ok')} "
                  f"({self.data['sections'][name]['seconds']} s)", flush=True)
        atomic_write_json(self.out / "results.json", self.data)
        free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: torch.device) -> dict[str, Any]:
    env = {"spiffy": spiffy.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda}
    return env


class _Alarm(Exception):
    """A check ran past its time limit (a decoding loop that does not end is a failure to report)."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise :class:`_Alarm` in the main thread after ``seconds`` (SIGALRM; a no-op where there is none)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def ring(signum: int, frame: Any) -> None:
        raise _Alarm(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _same(a: Any, b: Any) -> bool:
    """Token sequences (tensors or nested lists) identical."""
    return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))


def lossless(device: torch.device, dtype: torch.dtype, tmp: Path, small: bool) -> dict[str, Any]:
    """Spiffy vs baseline (dLLMs) and DFlash / DDTree vs AR (Qwen3 pair) on random tiny checkpoints."""
    rows, attns = [], ("sdpa", "flex_attention")
    prompt = torch.tensor([[11, 25, 47, 3, 99, 140, 7]], device=device)
    batch = torch.tensor([[0, 0, 11, 25, 47], [5, 9, 13, 17, 21]], device=device)
    batch_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=device)
    for family, caches in CACHES.items():
        ckpt = make_tiny(family, tmp / family, seed=0)
        for attn in attns:
            model = load_model(ckpt, dtype=dtype, device=device, attn_implementation=attn)
            for cache in caches[:1] if small else caches:
                for temperature in (0.0, 0.7):
                    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, cache=cache,
                                       temperature=temperature, seed=3)
                    graph = chain_graph_for(model, cfg, 3)
                    row: dict[str, Any] = {"family": family, "attn": attn, "cache": cache, "temperature": temperature}
                    try:
                        with time_limit(30 if small else 60):
                            base = spiffy.generate(model, prompt, cfg)
                            spec = spiffy.generate(model, prompt, cfg, graph=graph, budget=3)
                            bbase = spiffy.generate(model, batch, cfg, attention_mask=batch_mask, seeds=[3, 4])
                            bspec = spiffy.generate(model, batch, cfg, attention_mask=batch_mask, seeds=[3, 4],
                                                    graph=graph, budget=3)
                        row |= {"single_identical": _same(base.tokens, spec.tokens),
                                "batch_identical": _same(bbase.tokens, bspec.tokens), "nfe": [base.nfe, spec.nfe]}
                    except _Alarm as exc:
                        row |= {"single_identical": False, "batch_identical": False, "error": str(exc)}
                    print(f"[gpu_run] lossless {row}", flush=True)
                    rows.append(row)
            del model
    target_dir = make_tiny("qwen3", tmp / "qwen3", seed=1)
    drafter_dir = make_tiny("dflash", tmp / "dflash", seed=1, target=str(target_dir))
    for attn in attns:
        target = load_model(target_dir, dtype=dtype, device=device, attn_implementation=attn)
        drafter = load_drafter(drafter_dir, dtype=dtype, device=device)
        for temperature in (0.0, 0.7):
            kw = {"max_new_tokens": 24, "temperature": temperature, "seed": 5}
            ar = ddtree_generate(target, None, [3, 14, 15, 92, 65], method="ar", **kw).tokens
            for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
                got = ddtree_generate(target, drafter, [3, 14, 15, 92, 65], method=method, budget=budget, **kw).tokens
                first = next((i for i, (a, b) in enumerate(zip(ar, got)) if a != b), None)
                rows.append({"family": "qwen3", "attn": attn, "method": method, "budget": budget,
                             "temperature": temperature, "identical": list(ar) == list(got),
                             "first_divergence": first})
    dllm = [r for r in rows if r["family"] != "qwen3"]
    return {"rows": rows,
            "dllm_single_identical": f"{sum(r['single_identical'] for r in dllm)}/{len(dllm)}",
            "dllm_batch_identical": f"{sum(r['batch_identical'] for r in dllm)}/{len(dllm)}",
            "ar_identical": f"{sum(r['identical'] for r in rows if r['family'] == 'qwen3')}/"
                            f"{sum(r['family'] == 'qwen3' for r in rows)}"}


def bench(device: torch.device, dtype: torch.dtype, out: Path, small: bool) -> dict[str, Any]:
    """The two ``spiffy bench`` commands on the embedded models; their JSON results are read back."""
    common = ["--device", str(device), "--dtype", str(dtype).removeprefix("torch."), "--no-plots", "--no-progress",
              "--warmup", "0" if small else "1"]
    runs = {
        "dllm": ["dllm", "--dataset", "humaneval", "--skip", "0", "--no-chat", "--gen-length", "64", "--block-length", "32",
                 "--steps", "64", "--cache", "prefix", "--max-prompts", "1" if small else "10",
                 "--budgets", "1" if small else "1,3,5", "--freedave", "2" if small else "2,4,6"],
        "ar": ["ar", "--dataset", "humaneval", "--max-prompts", "1" if small else "8",
               "--max-new-tokens", "16" if small else "128", "--methods", "ar,dflash,ddtree",
               "--budgets", "16" if small else "16,32,64,128,256"],
    }
    result: dict[str, Any] = {}
    for name, argv in runs.items():
        target = out / f"bench_{name}"
        cmd = [sys.executable, "-m", "spiffy", "bench", *argv, *common, "--out", str(target)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=os.environ | {"PYTHONWARNINGS": "ignore"})
        result[name] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "stderr_tail": proc.stderr[-1500:]}
        if proc.returncode == 0:
            result[name]["results"] = json.loads((target / "results.json").read_text())
    return result


def costs(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, Any]:
    """Real-size forward costs with random weights (toy sizes in the self-check)."""
    size = gc_costs.shrink_config if small else (lambda c: c)
    states, budgets = (range(1, 3), (16,)) if small else (range(1, 9), (16, 32, 64, 128, 256, 512, 1024))
    ctx, prompt, gen = (32, 16, 32) if small else (1024, 512, 256)
    out: dict[str, Any] = {}
    for name, fixture, caches in (("LLaDA-8B", "GSAI-ML--LLaDA-8B-Instruct", ("none", "prefix", "dual")),
                                  ("SDAR-8B", "JetLM--SDAR-8B-Chat", ("prefix",))):
        config = gc_costs.real_config(fixture)
        config.setdefault("mask_token_id", 151669)  # SDAR's <|MASK|> lives in its tokenizer, not its config
        model = gc_costs.build_random(size(config), device, dtype)
        out[name] = {"parameters": gc_costs.count_parameters(model),
                     "rows": gc_costs.dllm_state_costs(model, prompt, gen, 32 if not small else 16, caches, states)}
        del model
        free_memory()
    for name, fixture in (("Qwen3-8B", "Qwen--Qwen3-8B"), ("Qwen3-30B-A3B", "Qwen--Qwen3-30B-A3B")):
        target = gc_costs.build_random(size(gc_costs.real_config(fixture)), device, dtype)
        entry: dict[str, Any] = {"parameters": gc_costs.count_parameters(target),
                                 "experts_implementation": getattr(target.config, "_experts_implementation", None),
                                 "eager": gc_costs.ar_verify_costs(target, ctx, budgets),
                                 "cuda_graph": gc_costs.ar_verify_graph_costs(target, ctx, budgets)}
        if name == "Qwen3-8B":
            drafter = gc_costs.build_random(size(gc_costs.real_config("z-lab--Qwen3-8B-DFlash-b16")), device, dtype)
            entry["drafter"] = {"parameters": gc_costs.count_parameters(drafter),
                                **gc_costs.drafter_cost(drafter, target.get_input_embeddings(), ctx)}
            del drafter
        out[name] = entry
        del target
        free_memory()
    return out


def projections(data: dict[str, Any]) -> dict[str, Any]:
    """Acceptance measured on the embedded models x costs measured at real sizes (projections, not measurements)."""
    sections = data["sections"]
    bench_res = sections.get("bench", {}).get("result", {})
    cost = sections.get("costs", {}).get("result", {})
    out: dict[str, Any] = {"label": "PROJECTION: tiny-model acceptance x real-size forward costs"}
    dllm = bench_res.get("dllm", {}).get("results", {})
    measured = [{"budget": r["budget"], "nfe_reduction": r["nfe_reduction"]}
                for r in dllm.get("runs", []) if r.get("nfe_reduction") and r.get("method", "spiffy") == "spiffy"]
    for name in ("LLaDA-8B", "SDAR-8B"):
        if name in cost:
            out[name] = gc_costs.project_dllm(cost[name]["rows"], measured)
    ar = bench_res.get("ar", {}).get("results", {})
    taus = [{"method": m["method"], "budget": m["budget"], "tau": m["tau"]}  # the bench ran ar, dflash and ddtree
            for m in ar.get("methods", []) if m.get("budget") and m.get("tau")]
    drafter_ms = cost.get("Qwen3-8B", {}).get("drafter", {}).get("ms", 0.0)
    for name in ("Qwen3-8B", "Qwen3-30B-A3B"):
        for mode in ("eager", "cuda_graph"):
            if name in cost:
                out[f"{name} {mode}"] = gc_costs.project_ar(cost[name][mode], taus, drafter_ms)
    return out


def markdown(data: dict[str, Any]) -> str:
    """GPU_RESULTS.md: every section's figures as tables."""
    s, lines = data["sections"], ["# GPU run", "", "Written by `scripts/gpu_run.py`; raw figures in results.json.", ""]
    lines += ["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in data.get("environment", {}).items()]
    for name, sec in s.items():
        lines += ["", f"## {name} ({sec.get('seconds', '?')} s)", ""]
        if "error" in sec or "skipped" in sec:
            lines.append(f"**{'error' if 'error' in sec else 'skipped'}**: {sec.get('error', sec.get('skipped'))}")
            continue
        if "partial" in sec:  # the run was cut inside this section: what it had measured
            lines.append("**partial**: the run ended inside this section")
        res = sec.get("result", sec.get("partial"))
        if name == "lossless":
            lines += [f"dLLM single prompt identical: {res['dllm_single_identical']}; batched Spiffy = batched "
                      f"baseline: {res['dllm_batch_identical']}; DFlash/DDTree = AR: {res['ar_identical']}", ""]
            lines += ["| model | attn | cache/method | T | identical | note |", "|---|---|---|---|---|---|"]
            for r in res["rows"]:
                same = r.get("identical", r.get("single_identical") and r.get("batch_identical"))
                note = f"first divergence at {r['first_divergence']}" if r.get("first_divergence") is not None else r.get("error", "")
                lines.append(f"| {r['family']} | {r['attn']} | {r.get('cache', r.get('method'))}"
                             f"{'@' + str(r['budget']) if r.get('budget') else ''} | {r['temperature']} | {same} | {note} |")
        elif name == "bench":
            for kind, b in res.items():
                lines += [f"- `{kind}`: return code {b['returncode']}; all identical: "
                          f"{b.get('results', {}).get('all_identical')}; `{b['command']}`"]
                if b["returncode"] != 0:
                    lines += ["", "```", b["stderr_tail"], "```"]
        elif name == "costs":
            for model, entry in res.items():
                lines += [f"### {model} ({entry['parameters'] / 1e9:.2f} B parameters)", ""]
                if "rows" in entry:
                    lines += ["| cache | states per forward | ms | x one state |", "|---|---|---|---|"]
                    lines += [f"| {r['cache']} | {r['states']} | {r['ms']:.2f} | {r['relative']:.2f} |" for r in entry["rows"]]
                else:
                    graph = {r["budget"]: r for r in entry["cuda_graph"]}
                    lines += ["| budget (nodes) | eager ms | x decode | CUDA graph ms | x decode |", "|---|---|---|---|---|"]
                    for r in entry["eager"]:
                        g = graph.get(r["budget"], {})
                        gms = f"{g['ms']:.2f} | {g['relative']:.2f}" if "ms" in g else f"{g.get('error', '-')[:60]} | -"
                        lines.append(f"| {r['budget'] or '1-token decode'} | {r['ms']:.2f} | {r['relative']:.2f} | {gms} |")
                    if "drafter" in entry:
                        d = entry["drafter"]
                        lines.append(f"\nDFlash drafter ({d['parameters'] / 1e9:.2f} B): {d['ms']:.2f} ms per block of "
                                     f"{d['block_size']} (the projections use it for both targets: no 30B-A3B drafter "
                                     "config is shipped).")
                lines.append("")
        elif name == "captured":
            lines += [f"**{res['label']}**; read bandwidth {res['read_bandwidth_gb_s']:.0f} GB/s", ""]
            for model in ("Qwen3-8B", "Qwen3-30B-A3B"):
                entry = res.get(model)
                if not entry:
                    continue
                hf = entry["transformers_static"]
                lines += [f"### {model}: bandwidth limit {entry['bandwidth_limit_ms_per_token']:.2f} ms/token; "
                          f"transformers static-cache generate {hf.get('ms_per_token', float('nan')):.2f} ms/token", "",
                          "| method | budget | compile | ms/round | draft ms/round | ms/token | tau | capture s "
                          "(target, drafter) |", "|---|---|---|---|---|---|---|---|"]
                for r in entry["rows"]:
                    if r.get("accept", "coupled") != "coupled":  # the rejection row (T = 1)
                        r = {**r, "method": f"{r['method']} ({r['accept']}, T = 1)"}
                    if "error" in r:
                        lines.append(f"| {r['method']} | {r['budget']} | {r['compile']} | {r['error'][:80]} | | | | |")
                        continue
                    cap = ", ".join(str((r.get(k) or {}).get("capture_seconds", "-")) for k in ("capture", "drafter_capture")
                                    ) if r["compile"] else ""
                    draft_ms = r.get("ms_per_round_by_stage", {}).get("draft", float("nan"))
                    lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['compile']} | {r['ms_per_round']:.2f} | "
                                 f"{draft_ms:.2f} | {r['ms_per_token']:.2f} | {r['tau']:.2f} | {cap} |")
                lines.append("")
        elif name == "inductor":
            if "skipped" in res:
                lines.append(f"skipped: {res['skipped']}")
                continue
            lines += [f"**{res['label']}**; Qwen3-8B, compile='inductor' (first call: every bucket compiled)", "",
                      "| method | budget | ms/round | ms/token | tau | first call s |", "|---|---|---|---|---|---|"]
            for r in res["rows"]:
                if "error" in r:
                    lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['error'][:80]} | | | |")
                    continue
                lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['ms_per_round']:.2f} | "
                             f"{r['ms_per_token']:.2f} | {r['tau']:.2f} | {r['first_call_s']:.1f} |")
        elif name == "exactness":
            backends = res.get(exact.BACKEND_KEY)
            if backends:
                lines += [f"The mode's stages on the device: int8 digit products (fused and eager) == float64 products "
                          f"(bfloat16 inputs, shapes {[r['shape'] for r in backends['rows'][:-1]]}), and its other "
                          f"stages fused == eager: **{backends['identical']}** identical; compiled "
                          f"{backends.get('compiled')}, fell back {backends.get('fell_back') or 'none'}", ""]
            lines += ["| model | mode | identical | unproven | first divergences |", "|---|---|---|---|---|"]
            for model, modes in res.items():
                if model == exact.BACKEND_KEY:
                    continue
                for label, r in modes.items():
                    if label != "batch_invariant_cost":
                        firsts = ", ".join(f"{x['pair']}: {x['first_divergence']}" for x in r["rows"] if not x["identical"])
                        lines.append(f"| {model} | {label} | {r['identical']} | {r['unproven'] or '-'} | {firsts or '-'} |")
                lines.append(f"| {model} | batch-invariant cost (x bfloat16 per token) | {modes.get('batch_invariant_cost')} | | |")
                same = {label: r["captured_equals_eager"] for label, r in modes.items() if "captured_equals_eager" in r}
                if same:
                    lines.append(f"| {model} | captured tokens == eager (compile=True) | {same} | | |")
        elif name == "dllm_captured":
            lines += dllm_captured_markdown(res)
        elif name == "projections":
            lines += [f"**{res['label']}**", ""]
            for key, rows in res.items():
                if key == "label" or not rows:
                    continue
                lines += [f"### {key}", ""]
                if "cache" in rows[0]:
                    lines += ["| cache | D* | NFE reduction (tiny) | cost x one state | projected speedup |", "|---|---|---|---|---|"]
                    lines += [f"| {r['cache']} | {r['budget']} | {r['nfe_reduction']:.2f} | {r['cost_ratio']:.2f} | "
                              f"{r['projected_speedup']:.2f}x |" for r in rows]
                else:
                    lines += ["| method | nodes | tau (tiny) | verify ms | drafter ms | projected speedup vs AR |", "|---|---|---|---|---|---|"]
                    lines += [f"| {r['method']} | {r['budget']} | {r['tau']:.2f} | {r['verify_ms']:.2f} | {r['drafter_ms']:.2f} | "
                              f"{r['projected_speedup']:.2f}x |" for r in rows]
                lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for results.json and GPU_RESULTS.md")
    parser.add_argument("--self-check", action="store_true", help="toy sizes on the CPU (what the suite runs)")
    parser.add_argument("--time-budget", type=float, default=510.0, help="seconds; later sections are skipped when "
                        "too little is left (default 510 = 8.5 minutes)")
    parser.add_argument("--sections", default="captured,dllm_captured,lossless,bench,costs,inductor,exactness,"
                        "projections",
                        help="comma-separated subset")
    parser.add_argument("--render", action="store_true", help="only rewrite GPU_RESULTS.md from --out's results.json "
                        "(a run cut short saved every finished section, and the exactness section's models so far)")
    args = parser.parse_args(argv)
    if args.render:
        atomic_write_text(args.out / "GPU_RESULTS.md", markdown(json.loads((args.out / "results.json").read_text())))
        return 0
    small = args.self_check or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    if small:
        torch.set_num_threads(1)
    run = Run(args.out, args.time_budget)
    run.data["environment"] = environment(device) | {"mode": "self-check (toy sizes, CPU)" if small else "GPU"}
    wanted = set(args.sections.split(","))
    with tempfile.TemporaryDirectory() as tmp, emulate_replays(small):
        # real-size costs first: they are what only a GPU can give; a section starts only with enough time left
        plan = [("captured", lambda: captured_timings(device, dtype, small), 0),
                ("dllm_captured", lambda: dllm_captured_timings(device, dtype, small), 0),
                ("costs", lambda: costs(device, dtype, small), 0),
                ("inductor", lambda: inductor_timings(device, dtype, small), 240),
                ("bench", lambda: bench(device, dtype, args.out, small), 90),
                ("lossless", lambda: lossless(device, dtype, Path(tmp), small), 60),
                ("exactness", lambda: exact.real_size_exactness(device, small, lambda r: run.partial("exactness", r)),
                 120),
                ("projections", lambda: projections(run.data), 0)]
        for name, fn, need in plan:
            if name in wanted:
                run.section(name, fn, need)
    atomic_write_text(args.out / "GPU_RESULTS.md", markdown(run.data))
    failed = [n for n, s in run.data["sections"].items() if "error" in s]
    failed += [f"bench {k}" for k, b in run.data["sections"].get("bench", {}).get("result", {}).items()
               if b["returncode"] != 0]
    failed += exact.failures(run.data["sections"].get("exactness", {}).get("result", {}))
    print(f"[gpu_run] wrote {args.out}/results.json and GPU_RESULTS.md; failed sections: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
