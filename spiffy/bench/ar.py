"""``spiffy bench ar``: plain AR vs DFlash vs DDTree (at several node budgets) and, with a dLLM drafter, DDTree from
its marginals, DEER and SpecDiff-2 (K drafts), under the coupled and/or the rejection rule, on one Qwen3 target.

Every method runs on the same code path (:func:`spiffy.arspec.speculative_generate`), on the same prompts, in the
same process, after an untimed warm-up. Reported per method (SPEC sections 7 and 11): τ = mean acceptance length per
round **including the bonus token**, macro-averaged over responses (mean of each response's τ); the histogram of
acceptance lengths (summed over rounds); time per output token **excluding prefill** (mean over responses); speedup
= mean TPOT(AR) / mean TPOT(method) and the same against DFlash, τ against DFlash's, each with its 95% interval over
prompts (paired bootstrap, :mod:`spiffy.bench.stats`); per-stage times; the fraction of outputs identical
to AR (must be 1.0 for the coupled rule and at T = 0; each mismatch is listed with the near-tie proof of
:func:`spiffy.bench.spec_fidelity.prove_ar_divergence`, run by the rank that measured the prompt: the first differing
position, whether both runs were in the same state, the rule replayed, the logit deviation and the flipped margin
against their rounding bounds, and why it is not proven when it is not; the rejection rule at T > 0 equals AR in
distribution only, so its identical rate is reported but not required); target
NFE (forwards, prefill included) per generated token; distinct-token ratio and whitespace share of the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, speculative_generate
from spiffy.arspec.methods import (
    AR,
    CHAIN_BASELINE,
    DEFAULT_ACCEPT,
    DFLASH2_DRAFTER,
    DFLASH_DRAFTER,
    DLLM_DRAFTER,
    METHODS,
    REGISTRY,
    Method,
    get_accept,
    get_method,
)
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
from spiffy.bench.fidelity import NEAR_TIE_RULE, divergence_entry
from spiffy.bench.spec_fidelity import prove_ar_divergence
from spiffy.bench.stats import interval_method, mean_interval, ratio_of_means, ratio_of_means_interval
from spiffy.distributed import DataParallel
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.ar_drafters import drafter_kind
from spiffy.models.prompting import prompt_token_ids, stop_token_ids

TAU_NOTE = "tau = tokens committed per verification round including the bonus token, macro average over responses"


#: methods ``spiffy bench ar`` can run: the registry's (:mod:`spiffy.arspec.methods`)
BENCH_METHODS: tuple[str, ...] = METHODS
#: the bench flag that supplies each drafter kind
DRAFTER_FLAGS: dict[str, str] = {DFLASH_DRAFTER.name: "--drafter DIR", DFLASH2_DRAFTER.name: "--drafter DIR (a DFlash2 "
                                 "checkpoint)", DLLM_DRAFTER.name: "--dllm-drafter DIR"}
#: ``BenchEntry.drafter`` of a method without a drafter
NO_DRAFTER = "none"


@dataclass(frozen=True)
class BenchEntry:
    """One measured configuration: a method of the registry, its drafter kind (``"dflash"``, ``"dllm"`` or
    ``"none"``), the node budget (tree methods) or number of drafts (specdiff), and the acceptance rule."""

    name: str
    method: str
    drafter: str
    budget: int | None
    drafts: int
    accept: str


def _entries_of(method: Method, budgets: Sequence[int], drafts: Sequence[int]) -> list[BenchEntry]:
    """One entry per size of ``method``'s sizing knob (``ddtree@64``, ``specdiff@K4``), or one entry."""
    kind = method.drafter.name if method.drafter is not None else NO_DRAFTER
    if method.size_knob == "budget":
        return [BenchEntry(f"{method.name}@{b}", method.name, kind, int(b), 1, DEFAULT_ACCEPT) for b in budgets]
    if method.size_knob == "drafts":
        return [BenchEntry(f"{method.name}@K{k}", method.name, kind, None, int(k), DEFAULT_ACCEPT) for k in drafts]
    return [BenchEntry(method.name, method.name, kind, None, 1, DEFAULT_ACCEPT)]


def plan_entries(
    budgets: Sequence[int],
    *,
    methods: Sequence[str] | None = None,
    accepts: Sequence[str] = (DEFAULT_ACCEPT,),
    drafts: Sequence[int] = (1, 4, 8),
    have_dflash: bool = True,
    have_dllm: bool = False,
    have_dflash2: bool = False,
) -> list[BenchEntry]:
    """The configurations of one bench run, AR first. ``methods`` (default: every one whose drafter is present)
    picks among :data:`BENCH_METHODS`; each drafted method runs once per rule in ``accepts`` (the default rule keeps
    the historical names, e.g. ``ddtree@64``; another rule appends ``/rule``)."""
    present = {kind.name for kind, have in ((DFLASH_DRAFTER, have_dflash), (DFLASH2_DRAFTER, have_dflash2),
                                            (DLLM_DRAFTER, have_dllm)) if have}
    wanted = list(methods) if methods else [m.name for m in REGISTRY.values()
                                            if m.drafter is None or m.drafter.name in present]
    unknown = [m for m in wanted if m not in BENCH_METHODS]
    if unknown:
        raise ConfigError(f"unknown bench method(s) {', '.join(unknown)}; fix: choose from {', '.join(BENCH_METHODS)}")
    for name in wanted:
        kind = get_method(name).drafter
        if kind is not None and kind.name not in present:
            raise ConfigError(f"bench method {name} needs {kind.help}; fix: pass {DRAFTER_FLAGS[kind.name]}")
    base = [e for name in wanted if get_method(name).needs_drafter for e in _entries_of(get_method(name), budgets, drafts)]
    entries = [BenchEntry(AR.name, AR.name, NO_DRAFTER, 0, 1, DEFAULT_ACCEPT)]
    for rule in accepts:
        suffix = "" if rule == DEFAULT_ACCEPT else f"/{get_accept(rule).name}"
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
    accepts: Sequence[str] = (DEFAULT_ACCEPT,),
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
    kind = drafter_kind(drafter) if drafter is not None else None  # --drafter: a DFlash or a DFlash2 drafter
    if kind == DLLM_DRAFTER.name:
        raise ConfigError("the drafter is a diffusion LM; fix: pass it as dllm_drafter (--dllm-drafter)")
    entries = plan_entries(budgets, methods=methods, accepts=accepts, drafts=drafts, have_dflash=kind == DFLASH_DRAFTER.name,
                           have_dllm=dllm_drafter is not None, have_dflash2=kind == DFLASH2_DRAFTER.name)
    keys = [(e.name, e.method, e.budget) for e in entries]
    by_name = {e.name: e for e in entries}
    wrapped = {DFLASH_DRAFTER.name: as_drafter(drafter) if drafter is not None else None,
               DFLASH2_DRAFTER.name: as_drafter(drafter) if drafter is not None else None,
               DLLM_DRAFTER.name: as_drafter(dllm_drafter) if dllm_drafter is not None else None, NO_DRAFTER: None}
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    encoded = [(p, prompt_token_ids(tokenizer, p.prompt, chat=chat)) for p in prompts]

    def _expects_identical(e: BenchEntry) -> bool:
        return get_accept(e.accept).exact_tokens or float(temperature) == 0

    def _config(e: BenchEntry) -> ARSpecConfig:
        return ARSpecConfig(method=e.method, budget=int(e.budget or 0), drafts=e.drafts, accept=e.accept,
                            max_new_tokens=int(max_new_tokens), stop_token_ids=tuple(stops), sampling=sampling)

    def _run_entry(ids: list[int], e: BenchEntry) -> Any:
        return speculative_generate(target, wrapped[e.drafter], ids, _config(e))

    def _run(ids: list[int], method: str, budget: int | None, name: str = "") -> Any:
        return _run_entry(ids, by_name[name])

    def _proofs(ids: list[int], outs: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The near-tie proof of every output that differs from AR where it must not (the proof re-runs both)."""
        ref = list(outs[AR.name].tokens)
        found = {}
        for e in entries:
            if list(outs[e.name].tokens) != ref and _expects_identical(e):
                found[e.name] = divergence_entry(prove_ar_divergence(
                    target, wrapped[e.drafter], ids, _config(e), outputs=(ref, list(outs[e.name].tokens)),
                    compared=f"{e.name} vs ar"))
        return found

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
                measured.append((k, (prompt, ids, str(exc), {})))
                continue
            measured.append((k, (prompt, ids, outs, _proofs(ids, outs))))
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
    for prompt, ids, outs, proofs in dp.gather_in_order(measured, len(encoded)):
        if isinstance(outs, str):
            skipped.append({"id": prompt.id, "reason": outs})
            continue
        ref = outs[AR.name].tokens
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
                a["mismatches"].append({"id": prompt.id, "first_mismatch": first_mismatch(ref, r.tokens),
                                        **proofs[name]})
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

    tpot_ar = _mean(acc[AR.name]["tpots"])
    tpot_df = _mean(acc[CHAIN_BASELINE.name]["tpots"]) if CHAIN_BASELINE.name in acc else 0.0
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
        "samples": [{"id": r["id"], "text": t[:400]} for r, t in zip(per_prompt[:3], acc[AR.name]["texts"][:3])],
        "environment": {**environment_info(target, device if device is not None else getattr(target, "device", None),
                                           drafter),
                        "processes": dp.world_size},
    }


__all__ = ["BENCH_METHODS", "BenchEntry", "DRAFTER_FLAGS", "NO_DRAFTER", "plan_entries", "run_ar_bench", "stop_token_ids",
           "TAU_NOTE"]
