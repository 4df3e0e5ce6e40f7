"""``spiffy bench ar``: plain AR vs DFlash vs DDTree (at several node budgets) and, with a dLLM drafter, DDTree from
its marginals, DEER and SpecDiff-2 (K drafts), under the coupled and/or the rejection rule, on one Qwen3 target.

Every method runs on the same code path (:func:`spiffy.arspec.speculative_generate`), on the same prompts, in the
same process, after an untimed warm-up. Reported per method (SPEC sections 7 and 11): τ = mean acceptance length per
round **including the bonus token**, macro-averaged over responses (mean of each response's τ); the histogram of
acceptance lengths (summed over rounds); time per output token **excluding prefill** (mean over responses); speedup
= mean TPOT(AR) / mean TPOT(method) and the same against DFlash, τ against DFlash's, each with its 95% interval over
prompts (paired bootstrap, :mod:`spiffy.bench.stats`); per-stage times; the fraction of outputs identical
to AR (must be 1.0 for the coupled rule and at T = 0; mismatches listed with the position and the baseline's logit
gap there, and whether that gap is a near tie within the dtype's rounding error, :mod:`spiffy.bench.fidelity`; the
rejection rule at T > 0 equals AR in distribution only, so its identical rate is reported but not required); target
NFE (forwards, prefill included) per generated token; distinct-token ratio and whitespace share of the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.bench.common import (
    add_times,
    check_bench_inputs,
    degenerate_stats,
    environment_info,
    first_mismatch,
    progress_bar,
    skip_prompt,
    stage_share,
    warm_up,
)
from spiffy.bench.datasets import BenchPrompt
from spiffy.bench.fidelity import NEAR_TIE_RULE, explain_ar_divergence
from spiffy.bench.stats import interval_method, mean_interval, ratio_of_means, ratio_of_means_interval
from spiffy.distributed import DataParallel
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.prompting import prompt_token_ids, stop_token_ids

TAU_NOTE = "tau = tokens committed per verification round including the bonus token, macro average over responses"


#: methods ``spiffy bench ar`` can run; ``ddtree-dllm`` is DDTree from the dLLM drafter's marginals
BENCH_METHODS: tuple[str, ...] = ("ar", "dflash", "ddtree", "ddtree-dllm", "deer", "specdiff")


@dataclass(frozen=True)
class BenchEntry:
    """One measured configuration: a method, its drafter (``"dflash"``, ``"dllm"`` or ``"none"``), the node budget
    (ddtree) or number of drafts (specdiff), and the acceptance rule."""

    name: str
    method: str
    drafter: str
    budget: int | None
    drafts: int
    accept: str


def plan_entries(
    budgets: Sequence[int],
    *,
    methods: Sequence[str] | None = None,
    accepts: Sequence[str] = ("coupled",),
    drafts: Sequence[int] = (1, 4, 8),
    have_dflash: bool = True,
    have_dllm: bool = False,
) -> list[BenchEntry]:
    """The configurations of one bench run, AR first. ``methods`` (default: every one whose drafter is present)
    picks among :data:`BENCH_METHODS`; each non-AR method runs once per rule in ``accepts`` (the coupled rule keeps
    the historical names, e.g. ``ddtree@64``; the rejection rule appends ``/rejection``)."""
    wanted = list(methods) if methods else [m for m in BENCH_METHODS if m in ("ar",)
                                            or (have_dflash and m in ("dflash", "ddtree"))
                                            or (have_dllm and m in ("ddtree-dllm", "deer", "specdiff"))]
    unknown = [m for m in wanted if m not in BENCH_METHODS]
    if unknown:
        raise ConfigError(f"unknown bench method(s) {', '.join(unknown)}; fix: choose from {', '.join(BENCH_METHODS)}")
    for m in wanted:
        if m in ("dflash", "ddtree") and not have_dflash:
            raise ConfigError(f"bench method {m} needs a DFlash drafter; fix: pass --drafter DIR")
        if m in ("ddtree-dllm", "deer", "specdiff") and not have_dllm:
            raise ConfigError(f"bench method {m} needs a dLLM drafter; fix: pass --dllm-drafter DIR")
    base: list[BenchEntry] = []
    for m in wanted:
        if m == "dflash":
            base.append(BenchEntry("dflash", "dflash", "dflash", None, 1, "coupled"))
        elif m == "ddtree":
            base += [BenchEntry(f"ddtree@{b}", "ddtree", "dflash", int(b), 1, "coupled") for b in budgets]
        elif m == "ddtree-dllm":
            base += [BenchEntry(f"ddtree-dllm@{b}", "ddtree", "dllm", int(b), 1, "coupled") for b in budgets]
        elif m == "deer":
            base.append(BenchEntry("deer", "deer", "dllm", None, 1, "coupled"))
        elif m == "specdiff":
            base += [BenchEntry(f"specdiff@K{k}", "specdiff", "dllm", None, int(k), "coupled") for k in drafts]
    entries = [BenchEntry("ar", "ar", "none", 0, 1, "coupled")]
    for rule in accepts:
        suffix = "" if rule == "coupled" else f"/{rule}"
        entries += [BenchEntry(e.name + suffix, e.method, e.drafter, e.budget, e.drafts, rule) for e in base]
    return entries


def _add_intervals(methods: list[dict[str, Any]], per_prompt: list[dict[str, Any]]) -> None:
    """Give every method the 95% intervals over prompts of its figures (:mod:`spiffy.bench.stats`), in
    ``method["intervals"]``: ``tau`` (a mean), ``speedup_vs_ar`` and ``speedup_vs_dflash`` (ratios of mean TPOTs,
    paired by prompt) and ``tau_vs_dflash`` (mean τ / DFlash's, also stored as a figure); none against itself."""
    tau = {m["name"]: [row["methods"][m["name"]]["tau"] for row in per_prompt] for m in methods}
    tpot = {m["name"]: [row["methods"][m["name"]]["tpot"] for row in per_prompt] for m in methods}
    for m in methods:
        name = m["name"]
        intervals: dict[str, Any] = {}
        if name != "ar":  # AR's tau is 1 by definition
            intervals["tau"] = mean_interval(tau[name])
            intervals["speedup_vs_ar"] = ratio_of_means_interval(tpot["ar"], tpot[name])
        if "dflash" in tau and name != "dflash":
            m["tau_vs_dflash"] = ratio_of_means(tau[name], tau["dflash"])
            intervals["tau_vs_dflash"] = ratio_of_means_interval(tau[name], tau["dflash"])
            intervals["speedup_vs_dflash"] = ratio_of_means_interval(tpot["dflash"], tpot[name])
        m["intervals"] = intervals


@torch.no_grad()
def run_ar_bench(
    target: Any,
    drafter: Any,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    budgets: Sequence[int],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = True,
    warmup: int = 1,
    progress: bool = True,
    target_name: str | None = None,
    drafter_name: str | None = None,
    dataset: str | None = None,
    device: Any = None,
    parallel: DataParallel | None = None,
    dllm_drafter: Any = None,
    dllm_drafter_name: str | None = None,
    methods: Sequence[str] | None = None,
    accepts: Sequence[str] = ("coupled",),
    drafts: Sequence[int] = (1, 4, 8),
) -> dict[str, Any]:
    """Benchmark AR against every drafted method (:func:`plan_entries`) on ``prompts``; returns a JSON-ready dict.

    Args:
        target: a Qwen3 target (transformers ``Qwen3ForCausalLM``); drafter: its DFlash drafter (or ``None``).
        tokenizer: the target's tokenizer; prompts: user messages (chat template applied when ``chat``).
        budgets: DDTree node budgets (root excluded).
        max_new_tokens, temperature, top_p, top_k, seed: the decoding rule shared by all methods.
        warmup: untimed warm-up rounds (every method once on the first prompt that fits).
        parallel: the data-parallel run (:func:`spiffy.distributed.data_parallel`): this rank measures prompts
            ``k % world_size == rank`` and every rank returns the same report built from all of them, in prompt
            order (timings are each rank's own). ``None``: one process.
        dllm_drafter: a dLLM drafter model sharing the target's tokenizer (enables ddtree-dllm, deer, specdiff).
        methods, accepts, drafts: which methods, acceptance rules and SpecDiff-2 draft counts to run.
    Returns:
        dict with ``methods`` (one entry per configuration: ar, dflash, ddtree@B, ...), ``per_prompt``, ...
    """
    check_bench_inputs(budgets, prompts, "[16, 32, 64]")
    stops = stop_token_ids(target, tokenizer, chat)
    entries = plan_entries(budgets, methods=methods, accepts=accepts, drafts=drafts,
                           have_dflash=drafter is not None, have_dllm=dllm_drafter is not None)
    keys = [(e.name, e.method, e.budget) for e in entries]
    by_name = {e.name: e for e in entries}
    wrapped = {"dflash": as_drafter(drafter) if drafter is not None else None,
               "dllm": as_drafter(dllm_drafter) if dllm_drafter is not None else None, "none": None}
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    encoded = [(p, prompt_token_ids(tokenizer, p.prompt, chat=chat)) for p in prompts]

    def _expects_identical(e: BenchEntry) -> bool:
        return e.accept == "coupled" or float(temperature) == 0

    def _run_entry(ids: list[int], e: BenchEntry) -> Any:
        cfg = ARSpecConfig(method=e.method, tree_budget=int(e.budget or 0), drafts=e.drafts, accept=e.accept,
                           max_new_tokens=int(max_new_tokens), stop_token_ids=tuple(stops), sampling=sampling)
        return speculative_generate(target, wrapped[e.drafter], ids, cfg)

    def _run(ids: list[int], method: str, budget: int | None, name: str = "") -> Any:
        return _run_entry(ids, by_name[name])

    def _warm(ids: list[int]) -> None:
        seen: set[tuple[str, str]] = set()
        for e in entries:  # every method x drafter once (the first budget / K of each)
            if (e.method, e.drafter) not in seen:
                seen.add((e.method, e.drafter))
                _run_entry(ids, e)

    warm_up(encoded, warmup, _warm)
    dp = parallel if parallel is not None else DataParallel(None, torch.device("cpu"))
    mine = dp.shard(len(encoded))
    bar = progress_bar(progress and dp.is_main, len(mine) * len(keys), "bench ar")
    # measure this rank's prompts: (k, (prompt, ids, {method name: result}) or (prompt, ids, reason skipped))
    measured: list[tuple[int, Any]] = []
    try:
        for k in mine:
            prompt, ids = encoded[k]
            outs: dict[str, Any] = {}
            try:
                for name, method, budget in keys:
                    outs[name] = _run(ids, method, budget, name)
                    if bar is not None:
                        bar.update(1)
            except PromptTooLongError as exc:
                skip_prompt([], prompt, exc, bar, len(keys) - len(outs))
                measured.append((k, (prompt, ids, str(exc))))
                continue
            measured.append((k, (prompt, ids, outs)))
    finally:
        if bar is not None:
            bar.close()
    specials = {int(t) for t in (getattr(tokenizer, "all_special_ids", None) or [])}
    acc: dict[str, dict[str, Any]] = {
        name: {"taus": [], "tpots": [], "hist": [], "stages": {}, "rounds": 0, "tokens_total": 0, "decode_s": 0.0,
               "seconds": 0.0, "prefill_s": 0.0, "identical": 0, "mismatches": [], "tokens": [], "texts": [],
               "nodes": 0, "block_size": 1, "budget": 0, "nfe": 0}
        for name, _m, _b in keys
    }
    per_prompt: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    # every rank's measurements in prompt order: the report does not depend on the number of processes
    for prompt, ids, outs in dp.gather_in_order(measured, len(encoded)):
        if isinstance(outs, str):
            skipped.append({"id": prompt.id, "reason": outs})
            continue
        ref = outs["ar"].tokens
        row: dict[str, Any] = {"id": prompt.id, "prompt_tokens": len(ids), "new_tokens": len(ref), "methods": {}}
        for name, _method, _budget in keys:
            r = outs[name]
            a = acc[name]
            a["taus"].append(float(r.tau))
            a["tpots"].append(float(r.time_per_output_token))
            hist = list(r.histogram)
            if len(hist) > len(a["hist"]):
                a["hist"] += [0] * (len(hist) - len(a["hist"]))
            for i, v in enumerate(hist):
                a["hist"][i] += int(v)
            add_times(a["stages"], r.stage_times)
            a["rounds"] += int(r.rounds)
            a["nfe"] += int(r.rounds) + 1  # the prefill plus one verification forward per round
            a["tokens_total"] += len(r.tokens)
            a["seconds"] += float(r.seconds)
            a["prefill_s"] += float(r.prefill_seconds)
            a["decode_s"] += float(r.seconds) - float(r.prefill_seconds)
            a["nodes"] += sum(r.nodes_per_round)
            a["block_size"] = int(r.block_size)
            a["budget"] = int(r.budget)
            a["tokens"].append(list(r.tokens))
            a["texts"].append(tokenizer.decode(r.tokens, skip_special_tokens=True) if tokenizer is not None else "")
            same = list(r.tokens) == list(ref)
            if same:
                a["identical"] += 1
            elif _expects_identical(by_name[name]):
                div = explain_ar_divergence(target, ids, ref, r.tokens, greedy=float(temperature) == 0)
                a["mismatches"].append({"id": prompt.id, "first_mismatch": first_mismatch(ref, r.tokens),
                                        **(div.to_dict() if div is not None else {})})
            row["methods"][name] = {"tau": float(r.tau), "tpot": float(r.time_per_output_token),
                                    "rounds": int(r.rounds), "identical": same}
        per_prompt.append(row)
    if not per_prompt:
        raise ConfigError(
            f"none of the {len(encoded)} prompts fits the target's context with max_new_tokens={max_new_tokens}; "
            "fix: lower --max-new-tokens or choose shorter prompts"
        )
    n = len(per_prompt)

    def _mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    tpot_ar = _mean(acc["ar"]["tpots"])
    tpot_df = _mean(acc["dflash"]["tpots"]) if "dflash" in acc else 0.0
    methods: list[dict[str, Any]] = []
    for name, method, _budget in keys:
        a = acc[name]
        tpot = _mean(a["tpots"])
        stages = dict(a["stages"])
        entry = by_name[name]
        methods.append({
            "name": name,
            "method": method,
            "drafter_kind": entry.drafter,
            "accept": entry.accept,
            "drafts": entry.drafts,
            "identical_expected": _expects_identical(entry),
            "nfe_total": a["nfe"],
            "nfe_per_token": a["nfe"] / a["tokens_total"] if a["tokens_total"] else None,
            "budget": a["budget"],
            "block_size": a["block_size"],
            "tau": _mean(a["taus"]),
            "tau_per_response": a["taus"],
            "acceptance_histogram": {str(k): v for k, v in enumerate(a["hist"])},
            "rounds_total": a["rounds"],
            "tokens_total": a["tokens_total"],
            "mean_nodes_per_round": a["nodes"] / a["rounds"] if a["rounds"] else 0.0,
            "tpot_s": tpot,
            "tokens_per_s": 1.0 / tpot if tpot > 0 else None,
            "decode_seconds": a["decode_s"],
            "prefill_seconds": a["prefill_s"],
            "speedup_vs_ar": tpot_ar / tpot if tpot > 0 else None,
            "speedup_vs_dflash": tpot_df / tpot if tpot > 0 and tpot_df > 0 else None,
            "stage_times": stages,
            "stage_share": stage_share(stages),
            "identical": a["identical"],
            "identical_fraction": a["identical"] / n,
            "mismatches": a["mismatches"],
            "degenerate": degenerate_stats(a["texts"], a["tokens"], specials),
        })
    _add_intervals(methods, per_prompt)
    return {
        "kind": "ar",
        "target": target_name or getattr(target, "name_or_path", None),
        "drafter": drafter_name or getattr(drafter, "name_or_path", None),
        "dllm_drafter": dllm_drafter_name or getattr(dllm_drafter, "name_or_path", None),
        "accepts": list(accepts),
        "decoding": {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
                     "top_k": int(top_k), "seed": int(seed), "stop_token_ids": stops},
        "chat": bool(chat and getattr(tokenizer, "chat_template", None)),
        "dataset": dataset,
        "num_prompts": n,
        "prompt_ids": [r["id"] for r in per_prompt],
        "skipped_prompts": skipped,
        "tau_definition": TAU_NOTE,
        "timing": "TPOT = decode seconds excluding prefill / generated tokens, mean over responses; speedup = mean "
                  "TPOT(AR or DFlash) / mean TPOT(method); same process, same prompts, after "
                  f"{max(0, int(warmup))} untimed warm-up round(s)",
        "warmup": max(0, int(warmup)),
        "intervals": interval_method(),
        "budgets": [int(b) for b in budgets],
        "methods": methods,
        "all_identical": all(m["identical_fraction"] == 1.0 for m in methods if m["identical_expected"]),
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "near_tie_rule": NEAR_TIE_RULE,
        "all_divergences_near_ties": all(x.get("near_tie") is True for m in methods for x in m["mismatches"]),
        "per_prompt": per_prompt,
        "samples": [{"id": r["id"], "text": t[:400]} for r, t in zip(per_prompt[:3], acc["ar"]["texts"][:3])],
        "environment": {**environment_info(target, device if device is not None else getattr(target, "device", None)),
                        "processes": dp.world_size},
    }


__all__ = ["BENCH_METHODS", "BenchEntry", "plan_entries", "run_ar_bench", "stop_token_ids", "TAU_NOTE"]
