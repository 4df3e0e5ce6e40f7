"""``spiffy generate`` at run time: the mode the user asked for, and dLLM mode (AR mode: :mod:`spiffy.cli.generate_ar`).

The mode follows from the flags the user set, never from a guess: ``--target``, ``--drafter`` or ``--method`` is AR
mode, anything else dLLM mode. A flag of the other mode is refused with a one-line error (exit 2).

dLLM defaults are one per model, whatever ``--graph`` says (:func:`spiffy.cli.graph_defaults.settle_settings`):
every flag the user left unset takes the model card's value (the configuration of the shipped graph that fits the
settings the user gave), else spiffy's own default, so ``spiffy generate --prompt TEXT`` prints the same tokens with
``--graph none``, ``auto``, ``FILE``, ``freedave:K`` or ``ssd:K``. A graph calibrated for other decoding rules is
refused with the flags it needs; one calibrated in another dtype or prompt format runs (exactly) with a note.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from spiffy.api import generate
from spiffy.batch_invariance import batch_invariant
from spiffy.cli import generate_ar
from spiffy.cli.flags import AR_FLAGS, DLLM_DECODING_FLAGS, refuse
from spiffy.cli.graph_defaults import card_note, differences, difference_note, recorded_settings, settle_settings
from spiffy.cli.placement import placement_kwargs, quantization_kwargs
from spiffy.cli.runtime import default_device, set_threads
from spiffy.embedded import (check_graph_fits, compatible_shipped_graph, default_dllm_path, resolve_graph_argument,
                             shipped_graphs)
from spiffy.errors import ConfigError
from spiffy.models.prompting import prompt_token_ids
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.rivals import parse_rival, rival_graph
from spiffy.selfspec.graph import load_graph
from spiffy.torch_utils import model_device

#: the flags that select AR mode
AR_SELECTORS: frozenset[str] = frozenset({"target", "drafter", "method"})
#: dest names of the flags only dLLM mode reads
DLLM_ONLY: frozenset[str] = frozenset({"model", "graph", "budget", "score", *DLLM_DECODING_FLAGS})
#: --graph values that are not files
NO_GRAPH, AUTO_GRAPH = "none", "auto"


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy generate``; returns the exit status (``--batch-invariant``: in :func:`spiffy.batch_invariant`)."""
    with batch_invariant(bool(getattr(args, "batch_invariant", False))):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    args.prompt = _prompts(args)
    asked = set(getattr(args, "given", set()))
    parser = getattr(args, "command_parser", None)
    if asked & AR_SELECTORS:
        refuse(asked & DLLM_ONLY, "diffusion-LM flags, and --target/--drafter/--method chose AR mode",
               "drop them (AR mode sizes its drafts with --tree-budget N for ddtree, --chain-length N, --drafts K for "
               "specdiff, and its output with --max-new-tokens N), or drop --target/--drafter/--method to decode "
               "with a diffusion LM", parser)
        return generate_ar.run_generate(args)
    refuse(asked & set(AR_FLAGS), "AR-mode flags (a Qwen3 target with a drafter), and no --method/--target chose AR mode",
           "drop them (a diffusion LM sets its length with --gen-length N), or add --method METHOD for AR mode", parser)
    return run_dllm(args, asked)


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = args.prompt if isinstance(args.prompt, list) else [args.prompt or ""]
    if not prompts or not all(prompts):  # the API refuses an empty prompt too (decoding.base / ar)
        raise ConfigError("the prompt is empty; fix: pass --prompt TEXT with at least one character")
    return prompts


def run_dllm(args: argparse.Namespace, asked: set[str]) -> int:
    """dLLM mode: baseline or Spiffy on a diffusion LM."""
    model_dir = args.model or default_dllm_path(" or --method METHOD for AR mode")
    graph_arg = args.graph if args.graph is not None else (AUTO_GRAPH if shipped_graphs(model_dir) else NO_GRAPH)
    if graph_arg == NO_GRAPH:
        refuse(asked & {"budget", "score"}, "Spiffy flags, and no draft graph runs here",
               "drop them, or pass --graph FILE|NAME|auto (`spiffy calibrate` makes one)", args.command_parser)
    tokenizer = load_tokenizer(model_dir)
    device = default_device(args.device)
    explicit_chat = args.chat  # --chat asks for a template; a default never fails for lack of one
    settings = settle_settings(args, model_dir, chat=args.chat, device=device,
                               has_template=bool(getattr(tokenizer, "chat_template", None)))
    note = card_note("spiffy generate", model_dir, settings)
    if note:
        print(note, file=sys.stderr)
    args.dtype, args.chat, cfg, extra = settings.dtype, settings.chat, settings.config, settings.extra
    placement = placement_kwargs(args)
    model = load_model(model_dir, dtype=args.dtype, device=device, **placement, **quantization_kwargs(args))
    if placement:  # inputs go where the model's embedding computes
        device = str(model_device(model))
    set_threads(args.threads, model)
    batch = [prompt_token_ids(tokenizer, p, chat=args.chat, require_template=bool(explicit_chat)) for p in args.prompt]
    graph, graph_path = _choose_graph(args, graph_arg, model, model_dir, cfg, extra, settings.card)
    if graph is not None and parse_rival(str(graph_path)) is None:  # a calibrated graph: does the run fit it?
        family_cfg = check_graph_fits(model, graph, str(graph_path), cfg, **extra)
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        diffs = differences(recorded_settings(graph_path), dtype, bool(args.chat), family_cfg)
        if diffs:
            print(difference_note("spiffy generate", str(graph_path), diffs), file=sys.stderr)
    budget = _check_budget(args.budget, graph)
    input_ids, attention_mask = _left_pad(batch, tokenizer)
    res = generate(model, input_ids, cfg, attention_mask=attention_mask, tokenizer=tokenizer, graph=graph,
                   budget=budget, score=args.score, progress=not args.no_progress and len(batch) == 1,
                   compile=getattr(args, "compile", "auto"), **extra)
    args.model, args.graph = str(model_dir), graph_path
    for r, ids in enumerate(batch):
        _print_row(args, res, r, ids, model, device, graph, budget)
    return 0


def _choose_graph(args: argparse.Namespace, graph_arg: str, model: Any, model_dir: str, cfg: Any,
                  extra: dict[str, Any], prefer: Path | None = None) -> tuple[Any, str | None]:
    """``(graph or None, its path or spec)`` for ``graph_arg``; an implicit ``auto`` that no shipped graph fits
    runs the baseline and says so on stderr."""
    if graph_arg == NO_GRAPH:
        return None, None
    rival = parse_rival(graph_arg)
    if rival is not None:  # FreeDave / SSD: the whole chain verified per forward
        graph = rival_graph(model, cfg, *rival, **extra)
        if args.budget is None:
            args.budget = len(graph)
        return graph, graph_arg
    if graph_arg == AUTO_GRAPH:
        try:
            path = compatible_shipped_graph(model, model_dir, cfg, prefer=prefer, **extra)
        except ConfigError as exc:
            if args.graph is not None:  # the user asked for auto: their error
                raise
            refuse(set(args.given) & {"budget", "score"}, f"Spiffy flags, and {exc}", "drop them",
                   args.command_parser)
            print(f"spiffy generate: note: decoding with the baseline (no Spiffy): {exc}", file=sys.stderr)
            return None, None
        return load_graph(path), str(path)
    path = resolve_graph_argument(graph_arg, model_dir)
    return load_graph(path), str(path)


def _check_budget(budget: int | None, graph: Any) -> int | None:
    """``--budget``, lowered (with one note on stderr) to the graph's node count when it asks for more drafts per
    step than the graph has nodes: the same drafts run either way, and the reports show the number that ran."""
    if budget is None or graph is None or budget <= len(graph):
        return budget
    print(f"spiffy generate: note: --budget {budget} exceeds the graph's {len(graph)} nodes (one draft per node and "
          f"step at most): running --budget {len(graph)}, which keeps the same drafts", file=sys.stderr)
    return len(graph)


def _left_pad(batch: list[list[int]], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, P]`` left-padded ids and their 0/1 mask (``None`` when every prompt has the same length)."""
    width = max(len(ids) for ids in batch)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = int(pad_id) if pad_id is not None else 0  # padded rows are masked out: the id never matters
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, ids in enumerate(batch):
        input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[r, width - len(ids) :] = 1
    return input_ids, None if bool(mask.all()) else mask


def _print_row(args: argparse.Namespace, res: Any, r: int, ids: list[int], model: Any, device: str, graph: Any,
               budget: int | None) -> None:
    """Print row ``r`` of a (possibly batched) result: text, or one JSON object."""
    text = res.text[r] if res.text else ""
    rows = res.stats.get("rows") if isinstance(res.stats, dict) else None
    row_stats = rows[r] if rows else res.to_dict()["stats"]
    nfe = int(row_stats.get("nfe", res.nfe)) if rows else res.nfe
    steps = int(row_stats.get("steps", res.steps)) if rows else res.steps
    if graph is not None and budget is None:  # report the budget that ran, not "null"
        budget = row_stats.get("budget") if isinstance(row_stats, dict) else None
    if args.json:
        payload = {
            "tokens": res.tokens[r],
            "text": text,
            "nfe": nfe,
            "seconds": res.seconds,
            "steps": steps,
            "batch_size": len(res.tokens),
            "batch_nfe": res.nfe,
            "family": res.family,
            "prompt_tokens": len(ids),
            "chat": bool(args.chat),
            "model": str(args.model),
            "graph": args.graph,
            "budget": budget,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "config": res.config.to_dict() if res.config is not None else None,
            "stats": row_stats,
        }
        print(json.dumps(payload))
    else:
        print(text)
        mode = f"spiffy, graph {Path(args.graph).stem}" if graph is not None and args.graph else (
            "spiffy" if graph is not None else "baseline")
        print(f"[{res.family} {mode}] {len(res.tokens[r])} positions, {steps} steps, {nfe} NFE (model calls), "
              f"{res.seconds:.2f}s", file=sys.stderr)
