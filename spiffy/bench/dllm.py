"""``spiffy bench dllm``: baseline vs Spiffy speculative decoding of a diffusion LM, measured in one process.

For every prompt the baseline and Spiffy at each budget run back to back in the same process, on the same prompt,
with the same decoding configuration and seed, after an untimed warm-up. Reported per budget (SPEC section 11):
NFE per generated token for both paths, NFE reduction, tokens/s and speedup (ratio of the measured wall times of
this run), each ratio with its 95% interval over prompts (paired bootstrap, :mod:`spiffy.bench.stats`; a Spiffy row
also against the FreeDave and SSD rows of the same width), the histogram of accepted drafts per verification forward,
accepted drafts per graph level, per-stage times, the fraction of outputs identical to the baseline (must be 1.0;
every mismatch is listed with its near-tie proof, :func:`spiffy.bench.spec_fidelity.prove_dllm_divergence`, run by
the rank that measured the prompt: in half precision on a GPU the verification forward over ``1 + D`` states rounds
differently from the baseline's forward over one, and a divergence is accepted only as a proven rounding-level near
tie), and the degenerate-output checks (distinct-token ratio, whitespace share).

"Generated tokens" are the ``gen_length`` positions each prompt decodes (EOS padding included), the unit in which
diffusion decoders spend their steps.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch

from spiffy.api import generate
from spiffy.bench.common import (
    add_counts,
    add_times,
    check_bench_inputs,
    degenerate_stats,
    environment_info,
    first_mismatch,
    progress_bar,
    skip_prompt,
    sorted_hist,
    stage_share,
    warm_up,
)
from spiffy.bench.datasets import BenchPrompt
from spiffy.bench.fidelity import NEAR_TIE_RULE, divergence_entry
from spiffy.bench.spec_fidelity import prove_dllm_divergence
from spiffy.bench.stats import interval_method, ratio_of_means, ratio_of_means_interval
from spiffy.distributed import DataParallel
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.prompting import prompt_token_ids
from spiffy.selfspec.rivals import RIVALS, rival_graph
from spiffy.selfspec.pruning import resolve_score

TOKEN_UNIT = "generated positions (gen_length per prompt, EOS padding included)"


def _special_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    if tokenizer is not None:
        ids.update(int(t) for t in getattr(tokenizer, "all_special_ids", []) or [])
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(getattr(model, "config", None), name, None)
        if isinstance(v, int):
            ids.add(v)
    return ids


def _graph_info(graph: Any, path: str | None, score: str) -> dict[str, Any]:
    meta = getattr(graph, "meta", {}) or {}
    cal = meta.get("calibration", {}) if isinstance(meta, dict) else {}
    return {
        "path": path,
        "nodes": len(getattr(graph, "nodes", []) or []),
        "score": score,
        "calibration_dataset": cal.get("dataset"),
        "calibration_prompts": cal.get("num_prompts"),
        "projected": dict(getattr(graph, "projected", {}) or {}),
    }


def _add_intervals(runs: list[dict[str, Any]], keys: Sequence[Any], per_prompt: list[dict[str, Any]]) -> None:
    """Give every run the 95% intervals over prompts of its ratios (:mod:`spiffy.bench.stats`), in
    ``run["intervals"]``: ``nfe_reduction`` and ``speedup`` against the baseline and, for a Spiffy row with a rival's
    row of the same states per forward (``run["rivals"]``: ``{"freedave": "freedave 3", "ssd": "ssd 3"}``;
    ``run["rival"]`` = the FreeDave one), ``nfe_reduction_vs_<rival>`` (the rival's forwards / Spiffy's) and
    ``speedup_vs_<rival>`` (the rival's seconds / Spiffy's), also stored as figures."""
    base_nfe = [row["baseline"]["nfe"] for row in per_prompt]
    base_s = [row["baseline"]["seconds"] for row in per_prompt]
    series = {str(k): ([row["spiffy"][str(k)]["nfe"] for row in per_prompt],
                       [row["spiffy"][str(k)]["seconds"] for row in per_prompt]) for k in keys}
    rival_keys = {(run["method"], run["states_per_forward"]): str(k) for k, run in zip(keys, runs)
                  if run["method"] in RIVALS}
    for key, run in zip(keys, runs):
        nfe, seconds = series[str(key)]
        intervals = {"nfe_reduction": ratio_of_means_interval(base_nfe, nfe),
                     "speedup": ratio_of_means_interval(base_s, seconds)}
        run["rivals"] = {}
        for name in RIVALS if run["method"] == "spiffy" else ():
            rival = rival_keys.get((name, run["states_per_forward"]))
            if rival is None:
                continue
            run["rivals"][name] = f"{name} {run['states_per_forward']}"
            rival_nfe, rival_s = series[rival]
            run[f"nfe_reduction_vs_{name}"] = ratio_of_means(rival_nfe, nfe)
            run[f"speedup_vs_{name}"] = ratio_of_means(rival_s, seconds)
            intervals[f"nfe_reduction_vs_{name}"] = ratio_of_means_interval(rival_nfe, nfe)
            intervals[f"speedup_vs_{name}"] = ratio_of_means_interval(rival_s, seconds)
        run["rival"] = run["rivals"].get("freedave")
        run["intervals"] = intervals


def _slim(res: Any) -> SimpleNamespace:
    """What the report needs of one :class:`~spiffy.api.DiffusionResult` (no tensors: it travels between ranks)."""
    return SimpleNamespace(tokens=res.tokens, text=res.text, nfe=int(res.nfe), seconds=float(res.seconds),
                           steps=int(res.steps), stats=dict(res.stats or {}), family=res.family)


@torch.no_grad()
def run_dllm_bench(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    config: Any,
    graph: Any,
    budgets: Sequence[int],
    *,
    config_overrides: dict[str, Any] | None = None,
    chat: bool = True,
    warmup: int = 1,
    progress: bool = True,
    model_name: str | None = None,
    dataset: str | None = None,
    graph_path: str | None = None,
    device: Any = None,
    parallel: DataParallel | None = None,
    freedave: Sequence[int] = (),
    ssd: Sequence[int] = (),
    score: str | None = None,
) -> dict[str, Any]:
    """Benchmark baseline vs Spiffy at each budget on ``prompts``; returns a JSON-ready results dict.

    Args:
        model: a loaded LLaDA / Dream / SDAR model; tokenizer: its tokenizer.
        prompts: the benchmark prompts (user messages; wrapped in the chat template when ``chat`` and available).
        config: the :class:`~spiffy.decoding.DecodeConfig` both paths decode with; prompt ``k`` uses seed
            ``config.resolved_seed + k`` on both paths.
        graph: the calibrated :class:`~spiffy.selfspec.graph.DraftGraph`; budgets: drafts kept per step (D*).
        config_overrides: family-specific options passed to ``generate`` (e.g. SDAR ``strategy``).
        warmup: untimed warm-up rounds (baseline + Spiffy at the first budget on the first prompt).
        progress: tqdm bar on stderr over the runs.
        parallel: the data-parallel run (:func:`spiffy.distributed.data_parallel`): this rank measures prompts
            ``k % world_size == rank`` and every rank returns the same report built from all of them, in prompt
            order (timings are each rank's own). ``None``: one process.
        freedave: FreeDave draft steps ``K`` to add as comparison rows (``K`` states per forward, like Spiffy at
            ``D* = K - 1``): the top-k chain graph of :mod:`spiffy.selfspec.freedave` at budget ``K - 1``, same prompts.
        ssd: SSD's states per forward ``K`` to add as comparison rows (its verification tree of ``K - 1`` self-drafted
            nodes, :mod:`spiffy.selfspec.ssd`, at budget ``K - 1``), same prompts.
        score: the pruning score of the Spiffy rows (``None`` = the graph's recorded one, else ``"gm"``); a FreeDave
            chain keeps the same nodes under every score.
    Returns:
        dict with ``baseline``, ``runs`` (one per budget), ``per_prompt``, ``environment`` and the run's metadata.
    Raises:
        ConfigError: no budgets / prompts, or no prompt fits the context.
    """
    check_bench_inputs(budgets, prompts, "[1, 3, 5]")
    extra = dict(config_overrides or {})
    budgets = [int(b) for b in budgets]
    # one row per (key, graph, budget): Spiffy rows keyed by budget, a rival's rows by "NAME:K" (K states per forward)
    score = resolve_score(score, graph)
    rows_spec: list[tuple[Any, Any, int]] = [(b, graph, b) for b in budgets]
    for name, widths in (("freedave", freedave), ("ssd", ssd)):
        for k in (RIVALS[name].parse(v) for v in widths):
            rows_spec.append((f"{name}:{k}", rival_graph(model, config, name, k, **extra), k - 1))
    base_seed = int(config.resolved_seed)
    encoded = [(p, prompt_token_ids(tokenizer, p.prompt, chat=chat)) for p in prompts]

    def _run(ids: list[int], seed: int, budget: int | None, row_graph: Any = graph) -> Any:
        return generate(
            model,
            torch.tensor([ids], dtype=torch.long, device=device),
            config.replace(seed=seed),
            tokenizer=tokenizer,
            graph=None if budget is None else row_graph,
            budget=budget,
            score=score if row_graph is graph else None,
            **extra,
        )

    def _prove(ids: list[int], seed: int, key: Any, row_graph: Any, budget: int) -> dict[str, Any]:
        """The near-tie proof of a speculative output that differs from the baseline (untimed; re-runs both)."""
        label = f"spiffy D*={key}" if row_graph is graph else str(key).replace(":", " ")
        return divergence_entry(prove_dllm_divergence(
            model, ids, config.replace(seed=seed), graph=row_graph, budget=budget,
            score=score if row_graph is graph else None, tokenizer=tokenizer, overrides=extra,
            compared=f"{label} vs baseline"))

    # ---------------------------------------------------------------- warm-up (untimed)
    def _warm(ids: list[int]) -> None:
        _run(ids, base_seed, None)
        _run(ids, base_seed, budgets[0])

    warm_up(encoded, warmup, _warm)
    dp = parallel if parallel is not None else DataParallel(None, torch.device("cpu"))
    mine = dp.shard(len(encoded))
    bar = progress_bar(progress and dp.is_main, len(mine) * (1 + len(rows_spec)), "bench dllm")
    # measure this rank's prompts; (k, (prompt, ids, ("ok", baseline, {budget: spiffy}) | ("skipped", reason)))
    measured: list[tuple[int, Any]] = []
    try:
        for k in mine:
            prompt, ids = encoded[k]
            seed = base_seed + k
            try:
                b_res = _slim(_run(ids, seed, None))
            except PromptTooLongError as exc:
                skip_prompt([], prompt, exc, bar, 1 + len(rows_spec))
                measured.append((k, (prompt, ids, ("skipped", str(exc)))))
                continue
            if bar is not None:
                bar.update(1)
            spiffy_runs: dict[Any, SimpleNamespace] = {}
            for key, row_graph, b in rows_spec:
                s_res = _slim(_run(ids, seed, b, row_graph))
                s_res.proof = {} if s_res.tokens[0] == b_res.tokens[0] else _prove(ids, seed, key, row_graph, b)
                spiffy_runs[key] = s_res
                if bar is not None:
                    bar.update(1)
            measured.append((k, (prompt, ids, ("ok", b_res, spiffy_runs))))
    finally:
        if bar is not None:
            bar.close()
    specials = _special_ids(tokenizer, model)
    base_tokens: list[list[int]] = []
    base_texts: list[str] = []
    base = {"nfe": 0, "seconds": 0.0, "positions": 0, "steps": 0}
    per_budget: dict[Any, dict[str, Any]] = {
        key: {"nfe": 0, "seconds": 0.0, "positions": 0, "accepted_total": 0, "reused_steps": 0, "forwards": 0,
            "drafts_evaluated": 0, "baseline_equivalent_nfe": 0, "hist": {}, "levels": {}, "stages": {},
            "identical": 0, "mismatches": [], "tokens": [], "texts": []}
        for key, _g, _b in rows_spec
    }
    per_prompt: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    family = None
    # every rank's measurements in prompt order: the report does not depend on the number of processes
    for prompt, ids, outcome in dp.gather_in_order(measured, len(encoded)):
        if outcome[0] == "skipped":
            skipped.append({"id": prompt.id, "reason": outcome[1]})
            continue
        b_res, spiffy_runs = outcome[1], outcome[2]
        family = b_res.family
        toks = b_res.tokens[0]
        text = b_res.text[0] if b_res.text else ""
        base_tokens.append(toks)
        base_texts.append(text)
        base["nfe"] += b_res.nfe
        base["seconds"] += b_res.seconds
        base["positions"] += len(toks)
        base["steps"] += b_res.steps
        row: dict[str, Any] = {"id": prompt.id, "prompt_tokens": len(ids), "positions": len(toks),
                               "baseline": {"nfe": b_res.nfe, "seconds": b_res.seconds}, "spiffy": {}}
        for key, _g, _b in rows_spec:
            s_res = spiffy_runs[key]
            acc = per_budget[key]
            st = s_res.stats or {}
            s_toks = s_res.tokens[0]
            same = s_toks == toks
            acc["nfe"] += s_res.nfe
            acc["seconds"] += s_res.seconds
            acc["positions"] += len(s_toks)
            acc["accepted_total"] += int(st.get("accepted_total", 0))
            acc["reused_steps"] += int(st.get("reused_steps", 0))
            acc["forwards"] += int(st.get("forwards", 0))
            acc["drafts_evaluated"] += int(st.get("drafts_evaluated", 0))
            acc["baseline_equivalent_nfe"] += int(st.get("baseline_equivalent_nfe", 0))
            add_counts(acc["hist"], st.get("accepted_per_forward", {}) or {})
            add_counts(acc["levels"], st.get("accepted_per_level", {}) or {})
            add_times(acc["stages"], st.get("stage_times", {}) or {})
            acc["tokens"].append(s_toks)
            acc["texts"].append(s_res.text[0] if s_res.text else "")
            if same:
                acc["identical"] += 1
            else:
                acc["mismatches"].append({"id": prompt.id, "first_mismatch": first_mismatch(toks, s_toks),
                                          **s_res.proof})
            row["spiffy"][str(key)] = {"nfe": s_res.nfe, "seconds": s_res.seconds, "identical": same,
                                     "accepted": int(st.get("accepted_total", 0))}
        per_prompt.append(row)
    if not per_prompt:
        raise ConfigError(
            f"none of the {len(encoded)} prompts fits the model's context with gen_length={config.gen_length}; "
            "fix: lower --gen-length or choose a dataset with shorter prompts"
        )
    n = len(per_prompt)
    positions = max(1, base["positions"])
    baseline = {
        "nfe_total": base["nfe"],
        "steps_total": base["steps"],
        "positions_total": base["positions"],
        "nfe_per_token": base["nfe"] / positions,
        "seconds": base["seconds"],
        "tokens_per_s": base["positions"] / base["seconds"] if base["seconds"] > 0 else None,
        "degenerate": degenerate_stats(base_texts, base_tokens, specials),
    }
    runs: list[dict[str, Any]] = []
    for key, _g, b in rows_spec:
        acc = per_budget[key]
        stages = {k: v for k, v in acc["stages"].items()}
        forwards = acc["forwards"]
        levels = sorted_hist(acc["levels"])
        runs.append({
            "method": key.split(":")[0] if isinstance(key, str) else "spiffy",
            "budget": b,
            "states_per_forward": b + 1,
            "nfe_total": acc["nfe"],
            "nfe_per_token": acc["nfe"] / max(1, acc["positions"]),
            "nfe_reduction": base["nfe"] / acc["nfe"] if acc["nfe"] else None,
            "baseline_equivalent_nfe": acc["baseline_equivalent_nfe"],
            "seconds": acc["seconds"],
            "tokens_per_s": acc["positions"] / acc["seconds"] if acc["seconds"] > 0 else None,
            "speedup": base["seconds"] / acc["seconds"] if acc["seconds"] > 0 else None,
            "accepted_total": acc["accepted_total"],
            "reused_steps": acc["reused_steps"],
            "verification_forwards": forwards,
            "drafts_evaluated": acc["drafts_evaluated"],
            "mean_accepted_per_forward": acc["accepted_total"] / forwards if forwards else 0.0,
            "acceptance_histogram": sorted_hist(acc["hist"]),
            "accepted_per_level": levels,
            "acceptance_rate_per_level": {k: v / forwards if forwards else 0.0 for k, v in levels.items()},
            "stage_times": stages,
            "stage_share": stage_share(stages),
            "identical": acc["identical"],
            "identical_fraction": acc["identical"] / n,
            "mismatches": acc["mismatches"],
            "degenerate": degenerate_stats(acc["texts"], acc["tokens"], specials),
        })
    _add_intervals(runs, [key for key, _g, _b in rows_spec], per_prompt)
    cfg_dict = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    cfg_dict.update(extra)
    if hasattr(config, "resolved_steps"):
        cfg_dict["steps_resolved"] = int(config.resolved_steps)
        cfg_dict["block_length_resolved"] = int(config.resolved_block_length)
    return {
        "kind": "dllm",
        "model": model_name or getattr(model, "name_or_path", None),
        "family": family,
        "decoding": cfg_dict,
        "chat": bool(chat and getattr(tokenizer, "chat_template", None)),
        "dataset": dataset,
        "num_prompts": n,
        "prompt_ids": [r["id"] for r in per_prompt],
        "skipped_prompts": skipped,
        "token_unit": TOKEN_UNIT,
        "timing": "wall time of each decode (tokenisation excluded), same process, same prompts, after "
                  f"{max(0, int(warmup))} untimed warm-up round(s); speedup = baseline seconds / Spiffy seconds",
        "warmup": max(0, int(warmup)),
        "intervals": interval_method(),
        "graph": _graph_info(graph, graph_path, score),
        "budgets": budgets,
        "baseline": baseline,
        "runs": runs,
        "all_identical": all(r["identical_fraction"] == 1.0 for r in runs),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "near_tie_rule": NEAR_TIE_RULE,
        "all_divergences_near_ties": all(m.get("near_tie") is True for r in runs for m in r["mismatches"]),
        "per_prompt": per_prompt,
        "samples": [{"id": r["id"], "text": t[:400]} for r, t in zip(per_prompt[:3], base_texts[:3])],
        "environment": {**environment_info(model, device if device is not None else getattr(model, "device", None)),
                        "processes": dp.world_size},
    }


__all__ = ["run_dllm_bench", "TOKEN_UNIT"]
