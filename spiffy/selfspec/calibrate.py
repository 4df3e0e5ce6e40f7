"""Offline calibration of a Spiffy draft graph (SPEC section 6).

Run the baseline decoder on a prompt set, record at every step which ``(i, j)`` formulas the actual future
followed (:mod:`spiffy.selfspec.chains`), select ``D`` nodes forming a parent-closed graph that maximises the saved
forwards (:mod:`spiffy.selfspec.select`), and return the :class:`~spiffy.selfspec.graph.DraftGraph` with what it
was calibrated for, how, and its projected NFE reduction (the ceiling with every node kept).

Deterministic for a seed: prompt ``k`` decodes with ``seed + k`` (only matters at temperature > 0), selection
ties are broken by fixed rules, and the file differs between two runs only in ``calibration.date``.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import warnings
from typing import Any, Sequence

import torch
import transformers
from tqdm.auto import tqdm

from spiffy._version import __version__
from spiffy.decoding import DecodeConfig, make_session
from spiffy.distributed import DataParallel
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.selfspec.chains import Trajectory, all_chains, describe, record_chains
from spiffy.selfspec.graph import DraftGraph, runtime_signature
from spiffy.selfspec.prompts import load_prompts, prompt_token_ids
from spiffy.selfspec.pruning import check_score
from spiffy.selfspec.select import OBJECTIVES, build_graph
from spiffy.selfspec.tune import check_tune_budget, tune_for_budget
from spiffy.torch_utils import dtype_name, model_device, model_dtype

DEFAULT_NODES = 10
DEFAULT_J_MAX = 4


def _model_name(model: Any) -> str | None:
    cfg = getattr(model, "config", None)
    for v in (getattr(cfg, "_name_or_path", None), getattr(model, "name_or_path", None)):
        if isinstance(v, str) and v:
            return v
    return None


@torch.no_grad()
def calibrate(
    model: Any,
    tokenizer: Any,
    prompts: str | os.PathLike[str] | Sequence[str | Sequence[int]],
    config: DecodeConfig | None = None,
    *,
    nodes: int = DEFAULT_NODES,
    max_level: int | None = None,
    i_max: int | None = None,
    j_max: int = DEFAULT_J_MAX,
    objective: str = "greedy",
    score: str | None = None,
    budget: int | None = None,
    max_prompts: int | None = None,
    seed: int = 0,
    chat: bool = True,
    progress: bool = True,
    dataset: str | None = None,
    model_name: str | None = None,
    command: str | None = None,
    skip_long: bool = True,
    config_overrides: dict[str, Any] | None = None,
    parallel: DataParallel | None = None,
) -> DraftGraph:
    """Calibrate a draft graph for ``model`` under the decoding configuration ``config``.

    Args:
        model: a loaded LLaDA / Dream / SDAR model.
        tokenizer: its tokenizer (needed for text prompts and the chat template; may be ``None`` for id prompts).
        prompts: a named set (``"default"``), a JSONL path (field ``"prompt"``), or a list of texts / token-id lists.
        config: the decoding configuration the graph is for (default :class:`DecodeConfig`).
        nodes: ``D``, graph nodes to select.
        max_level: deepest lookahead recorded (``None`` = to the block end).
        i_max: position-rank cap (``None`` = the block length: every position).
        j_max: token-rank cap.
        objective: ``"greedy"`` (default), ``"cumfreq"``, ``"degree1"`` or ``"exact"``.
        score: the pruning score to record in the file (``calibration.score``), which the runtime then uses by
            default (:func:`spiffy.selfspec.pruning.resolve_score`); ``None`` records none (the runtime uses
            ``"gm"``). ``"reach"`` suits graphs with branches (a small ``max_level``).
        budget: tune the graph for this many drafts kept per step (``D*``): the default graph, one capped at
            lookahead ``D*`` and FreeDave's chain of depth ``D*`` are built from the same trajectories, the
            runtime's pruning is replayed on them with each score, and the one that saves most at ``D*`` is
            returned if it saves clearly more than the chain, else the chain (:mod:`spiffy.selfspec.tune`; it
            records its ``nodes``, ``max_level``, ``shape``, ``score`` and ``budget``; ``projected["at_budget"]``
            and ``projected["candidates"]`` say what each saved). ``None``: no tuning. Chooses the score itself,
            so ``score`` must then be ``None``.
        max_prompts: use only the first ``max_prompts`` prompts.
        seed: prompt ``k`` decodes with seed ``seed + k``.
        chat: apply the tokenizer's chat template (when it has one).
        progress: tqdm progress bar on stderr.
        dataset: label stored in the file (default: the prompt set's name/path, or ``"custom"``).
        model_name: model name/path stored in the file (default: the config's ``_name_or_path``).
        command: the command line stored in the file (the CLI passes its own).
        skip_long: skip (with a warning) prompts that do not fit the model's context instead of failing.
        config_overrides: family-specific decoding options passed to :func:`spiffy.decoding.make_session`
            (e.g. SDAR's ``strategy``).
        parallel: the data-parallel run (:func:`spiffy.distributed.data_parallel`) to share the prompts with:
            this rank decodes prompts ``k % world_size == rank``, the trajectories are gathered in prompt order and
            every rank builds the same graph (the same as a single process would). ``None``: one process.
    Returns:
        The calibrated :class:`DraftGraph` (``meta``: ``calibrated_for`` / ``calibration``; ``projected``).
    Raises:
        ConfigError: bad arguments or prompts; PromptTooLongError: a prompt does not fit (``skip_long=False``)
        or none does.
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown calibration objective {objective!r}; fix: use one of {', '.join(OBJECTIVES)}")
    if score is not None:
        check_score(score)
    if budget is not None:
        check_tune_budget(budget)  # before decoding: tuning comes after it
        if score is not None:
            raise ConfigError("budget= tunes the pruning score itself; fix: pass either a budget or a score, not both")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"nodes={nodes!r} must be an integer >= 0; fix: pass e.g. nodes=10")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} must be an integer")
    cfg = config if config is not None else DecodeConfig()
    overrides = dict(config_overrides or {})
    if i_max is not None and (isinstance(i_max, bool) or not isinstance(i_max, int) or i_max < 1):
        raise ConfigError(f"i_max={i_max!r} must be None or an integer >= 1; fix: pass e.g. --i-max 8")
    if isinstance(j_max, bool) or not isinstance(j_max, int) or j_max < 1:
        raise ConfigError(f"j_max={j_max!r} must be an integer >= 1; fix: pass e.g. --j-max 4")
    if max_level is not None and (isinstance(max_level, bool) or not isinstance(max_level, int) or max_level < 1):
        raise ConfigError(f"max_level={max_level!r} must be None or an integer >= 1")
    if isinstance(prompts, (str, os.PathLike)):
        label = dataset or str(prompts)
        texts: list[Any] = list(load_prompts(prompts))
    else:
        label = dataset or "custom"
        texts = list(prompts)
    if not texts:
        raise ConfigError("no calibration prompts given; fix: pass --prompts default or a JSONL file with prompts")
    if max_prompts is not None:
        if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < 1:
            raise ConfigError(f"max_prompts={max_prompts!r} must be None or an integer >= 1")
        texts = texts[:max_prompts]

    device = model_device(model)
    encoded: list[list[int]] = []
    for k, t in enumerate(texts):
        if isinstance(t, str):
            if tokenizer is None:
                raise ConfigError("text prompts need a tokenizer; fix: pass the model's tokenizer (or token-id lists)")
            encoded.append(prompt_token_ids(tokenizer, t, chat=chat))
        else:
            encoded.append([int(v) for v in t])
        if not encoded[-1]:
            raise ConfigError(f"prompt {k} encodes to no tokens; fix: remove empty prompts")

    dp = parallel if parallel is not None else DataParallel(None, device)
    mine = dp.shard(len(encoded))
    bar = None
    if progress and dp.is_main:
        bar = tqdm(total=None, desc="calibrating", unit="step", file=sys.stderr, dynamic_ncols=True)
    steps_per_prompt: int | None = None

    # per prompt k: (k, ("ok", trajectory, signature, decode_config, i_max)) or (k, ("skipped",))
    local: list[tuple[int, tuple[Any, ...]]] = []
    n_skipped = 0
    sig: dict[str, Any] | None = None
    try:
        for n_done, k in enumerate(mine):
            ids = encoded[k]
            if bar is not None:
                bar.set_postfix_str(f"prompt {n_done + 1}/{len(mine)}")
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)
            try:
                session = make_session(model, input_ids, cfg, tokenizer=tokenizer, seed=seed + k, **overrides)
            except PromptTooLongError as exc:
                if not skip_long:
                    raise
                local.append((k, ("skipped",)))
                n_skipped += 1
                warnings.warn(f"calibration prompt {k} skipped: {exc}", stacklevel=2)
                if bar is not None and bar.total is not None and steps_per_prompt is not None:
                    bar.total = max(0, bar.total - steps_per_prompt)
                    bar.refresh()
                continue
            scfg = getattr(session, "config", cfg)
            if i_max is None:
                i_max = int(session.block_length)
            if steps_per_prompt is None and getattr(scfg, "tokens_per_step", "dynamic") != "dynamic" and hasattr(scfg, "resolved_steps"):
                steps_per_prompt = int(scfg.resolved_steps)
                if bar is not None:
                    bar.total = steps_per_prompt * (len(mine) - n_skipped)
                    bar.refresh()
            trajectory = record_chains(session, i_max, j_max, max_level, prompt=k,
                                       progress=(lambda n: bar.update(n)) if bar is not None else None)
            if sig is None:
                sig = runtime_signature(model, session)
            decode_cfg = {kk: v for kk, v in scfg.to_dict().items() if kk != "seed"} if hasattr(scfg, "to_dict") else None
            local.append((k, ("ok", trajectory, sig, decode_cfg, i_max)))
    finally:
        if bar is not None:
            bar.close()
    # merged in prompt order: the same trajectories (and so the same graph) for any number of processes
    results = dp.gather_in_order([(k, (k, r)) for k, r in local], len(encoded))
    done = [r for _k, r in results if r[0] == "ok"]
    skipped: list[int] = [k for k, r in results if r[0] == "skipped"]
    trajectories: list[Trajectory] = [r[1] for r in done]
    signature: dict[str, Any] | None = done[0][2] if done else None
    decode_config: dict[str, Any] | None = done[0][3] if done else None
    i_max = done[0][4] if done else i_max
    if not trajectories:
        raise PromptTooLongError(
            f"none of the {len(encoded)} calibration prompts fits the model's context with gen_length={cfg.gen_length}; "
            "fix: lower --gen-length or use shorter prompts"
        )
    assert signature is not None and i_max is not None
    calibrated_for: dict[str, Any] = {"family": signature.get("family"), "model": model_name or _model_name(model)}
    for key, v in signature.items():
        if key not in calibrated_for:
            calibrated_for[key] = v
    calibration = {
        "dataset": label,
        "num_prompts": len(trajectories),
        "skipped_prompts": skipped,
        "seed": seed,
        "chat": bool(chat and tokenizer is not None and getattr(tokenizer, "chat_template", None)),
        "i_max": i_max,
        "j_max": j_max,
        "max_level": max_level,
        "nodes": nodes,
        "objective": objective,
        **({"score": score} if score is not None else {}),
        "gen_length": int(cfg.gen_length),
        "config_overrides": overrides or None,
        "decode_config": decode_config,
        "dtype": dtype_name(model_dtype(model)),
        "device": device.type,
        "library_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "transformers_version": _transformers_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "command": command
        or _api_command(label, nodes, objective, max_prompts, seed, i_max, j_max, max_level, score, budget),
    }
    tps = calibrated_for.get("tokens_per_step")
    tps_int = tps if isinstance(tps, int) and not isinstance(tps, bool) else None
    chains = all_chains(trajectories)
    meta = {"calibrated_for": calibrated_for, "calibration": calibration}
    if budget is None:
        graph = build_graph(chains, nodes, objective, meta=meta, tokens_per_step=tps_int, trajectories=trajectories)
    else:
        graph = tune_for_budget(chains, trajectories, budget, nodes=nodes, objective=objective, max_level=max_level,
                                meta=meta, tokens_per_step=tps_int)
    graph.projected.update({f"calibration_{k}": v for k, v in describe(trajectories).items()})
    return graph


def _transformers_version() -> str | None:
    return str(transformers.__version__)


def _api_command(label: str, nodes: int, objective: str, max_prompts: int | None, seed: int, i_max: int, j_max: int,
                 max_level: int | None, score: str | None, budget: int | None) -> str:
    extra = (f", score={score!r}" if score is not None else "") + (f", budget={budget}" if budget is not None else "")
    return (
        f"spiffy.selfspec.calibrate.calibrate(prompts={label!r}, nodes={nodes}, objective={objective!r}, "
        f"max_prompts={max_prompts}, seed={seed}, i_max={i_max}, j_max={j_max}, max_level={max_level}{extra})"
    )


__all__ = ["calibrate", "runtime_signature", "DEFAULT_NODES", "DEFAULT_J_MAX"]
