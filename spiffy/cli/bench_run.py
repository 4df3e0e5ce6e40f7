"""``spiffy bench`` at run time (the parser and what each mode measures: :mod:`spiffy.cli.bench`)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from spiffy.arspec import ACCEPT_RULES
from spiffy.arspec.methods import DFLASH2_DRAFTER, DFLASH_DRAFTER, DLLM_DRAFTER
from spiffy.batch_invariance import batch_invariant
from spiffy.bench.ar import plan_entries, run_ar_bench
from spiffy.bench.common import parse_budgets
from spiffy.bench.datasets import held_out_from, load_benchmark_prompts
from spiffy.bench.dllm import run_dllm_bench
from spiffy.bench.overheads import markdown_overheads, run_overheads
from spiffy.bench.report import markdown_report, write_report
from spiffy.bench.throughput import ar_methods, dllm_methods, encode_prompts, markdown_throughput, measure, parse_batch_sizes, throughput_report
from spiffy.cli.graph_defaults import (
    DEFAULT_COMPANION_THRESHOLD,
    card_note,
    difference_note,
    differences,
    pick_defaults_graph,
    recorded_settings,
    settle_settings,
)
from spiffy.cli.placement import placement_kwargs, quantization_kwargs
from spiffy.cli.runtime import check_output_path, decode_config, default_device, quiet_loading, set_threads
from spiffy.distributed import join_data_parallel
from spiffy.embedded import (
    check_graph_fits,
    compatible_shipped_graph,
    embedded_model_path,
    is_embedded_available,
    resolve_graph_argument,
    shipped_graphs,
)
from spiffy.errors import ConfigError
from spiffy.io import atomic_write_json, atomic_write_text
from spiffy.models import drafter_kind, load_ar_drafter, load_model, load_tokenizer
from spiffy.models.hub import checkpoint_dir
from spiffy.models.prompting import stop_token_ids
from spiffy.selfspec.rivals import parse_rival_list
from spiffy.selfspec.graph import load_graph
from spiffy.torch_utils import model_device


def _no_mode(args: argparse.Namespace) -> int:
    args.bench_parser.print_help(sys.stderr)
    print("\nspiffy bench: choose a mode: dllm, ar or overheads", file=sys.stderr)
    return 2


def _unproven(res: dict[str, Any]) -> list[str]:
    """One line per divergence from the baseline that the near-tie rule did not prove (a threshold companion's
    included): the row, the prompt, the position and why."""
    rows = [(f"D*={r['budget']}" if r.get("method", "spiffy") == "spiffy" else f"{r['method']} {r['budget'] + 1}", r)
            for r in res.get("runs", [])] + [(m["name"], m) for m in res.get("methods", [])]
    lines = [f"{name} prompt {m['id']} at position {m['first_mismatch']}: {m.get('reason') or 'no proof ran'}"
             for name, row in rows for m in row.get("mismatches", []) if m.get("near_tie") is not True]
    companion = res.get("companion")
    return lines + ([f"threshold companion: {line}" for line in _unproven(companion)] if companion else [])


def _finish(args: argparse.Namespace, res: dict[str, Any], mismatch_warning: str) -> int:
    """Write the reports to ``--out``, print the Markdown report; 1 (with ``mismatch_warning`` and one stderr line
    per unproven divergence) if any output differs from its baseline, unless every divergence was proven a near tie
    within the dtype's rounding (:mod:`spiffy.bench.fidelity`: half precision, or a GPU's row-count-dependent
    kernels)."""
    if not getattr(args, "is_main_rank", True):  # under torchrun every rank holds the report; rank 0 writes it
        return 0 if res["all_identical"] or res.get("all_divergences_near_ties") else 1
    written = write_report(res, args.out, plots=not args.no_plots)
    print(markdown_report(res))
    for path in written.values():
        print(f"wrote {path}", file=sys.stderr)
    if not res["all_identical"]:
        if res.get("all_divergences_near_ties"):
            print(f"spiffy bench: note: {mismatch_warning}, each at a proven near tie within {res.get('dtype')} "
                  "rounding (see results.md)", file=sys.stderr)
            return 0
        bad = _unproven(res)
        print(f"spiffy bench: WARNING: {mismatch_warning}; {len(bad)} divergence(s) NOT proven near ties (a bug, not "
              "rounding; see results.md):", file=sys.stderr)
        for line in bad:
            print(f"spiffy bench:   {line}", file=sys.stderr)
        return 1
    return 0


def _plots_possible(args: argparse.Namespace) -> None:
    """Without matplotlib (a plain install lacks the 'plot' extra), skip the PNGs with a note instead of failing
    after the whole benchmark has run."""
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        print("spiffy bench: note: matplotlib is not installed, so no PNG plots (results.json and results.md are "
              "written); fix: pip install 'spiffy-decoding[plot]'", file=sys.stderr)
        args.no_plots = True


def announce_cost(command: str, prompts: int, configurations: list[str], unit: str, warmup: int) -> None:
    """Tell the user, before a long run starts, how many decodes it will make (prompts x configurations)."""
    runs = prompts * len(configurations)
    warm = f", after {warmup} untimed warm-up round(s)" if warmup else ""
    print(f"{command}: {prompts} prompt(s) x {len(configurations)} configuration(s) ({', '.join(configurations)}) = "
          f"{runs} {unit}{warm}; the progress bar shows the ETA", file=sys.stderr)


def _rival_widths(text: str | None, budgets: list[int]) -> str | None:
    """``--freedave`` / ``--ssd``: unset = the states per forward of the Spiffy rows (D* + 1, so every budget has
    its rivals at equal width in the same run); ``none`` = no rows."""
    if text is None:
        return ",".join(str(b + 1) for b in budgets)
    return None if text.strip().lower() in ("", "none") else text


def _prompts(args: argparse.Namespace) -> list[Any]:
    """The prompts of a dLLM run: ``--max-prompts`` of ``--dataset`` after the first ``--skip`` (unset: the prompts
    the embedded models' development used are skipped, :data:`~spiffy.bench.datasets.HELD_OUT_FROM`), said in one
    line when prompts are skipped by default."""
    skip = args.skip if args.skip is not None else held_out_from(args.dataset)
    prompts = load_benchmark_prompts(args.dataset, args.datasets, args.max_prompts, skip=skip)
    if args.skip is None and skip:
        print(f"spiffy bench dllm: prompts {prompts[0].id} to {prompts[-1].id} (the first {skip} served the "
              "embedded models' selection and calibration and the README's figures; --skip 0 uses them)",
              file=sys.stderr)
    return prompts


def _companion_graph(args: argparse.Namespace, cfg: Any, model_dir: Path) -> tuple[float, Path] | None:
    """``--also-threshold``: the threshold regime to run beside this one and the shipped graph calibrated for it,
    or ``None`` (unset: 0.9 when this run decodes one token per step with the default graph and a graph for 0.9
    ships with the model; ``none``: never). A value given with no graph for it shipped is a :class:`ConfigError`."""
    given = args.also_threshold  # None (unset), "none" or a confidence (flags.threshold_or_none)
    if given == "none" or (given is None and (cfg.threshold is not None or args.graph)):
        return None
    tau = DEFAULT_COMPANION_THRESHOLD if given is None else float(given)
    fitting = [path for path in shipped_graphs(model_dir)
               if (recorded_settings(path).get("decode_config") or {}).get("threshold") == tau]
    chosen = pick_defaults_graph(fitting, args.dtype, not args.no_chat, {"threshold": tau})
    if chosen is None and given is not None:
        raise ConfigError(f"--also-threshold {tau}: no graph shipped with {model_dir} was calibrated for threshold "
                          f"{tau}; fix: calibrate one (`spiffy calibrate --threshold {tau}`) and run `spiffy bench "
                          "dllm --graph FILE --threshold` with it, or pass --also-threshold none")
    return None if chosen is None else (tau, chosen)


def _companion_run(args: argparse.Namespace, companion: tuple[float, Path], run: Any) -> dict[str, Any]:
    """The threshold regime's baseline against Spiffy with its graph (``run``: :func:`run_dllm_bench` with the
    model, prompts and placement of the main run bound), the user's other decoding flags kept."""
    tau, path = companion
    flags = argparse.Namespace(**vars(args))
    flags.threshold = tau
    cfg, extra = decode_config(flags, recorded_settings(path).get("decode_config"))
    print(f"spiffy bench dllm: also threshold {tau} decoding with the shipped graph {path.name} "
          "(--also-threshold none skips it)", file=sys.stderr)
    return run(cfg, load_graph(path), extra, str(path))


def run_dllm(args: argparse.Namespace) -> int:
    """``spiffy bench dllm``."""
    budgets = parse_budgets(args.budgets)
    model_dir = checkpoint_dir(args.model) if args.model else embedded_model_path("dllm")
    graph_path = resolve_graph_argument(args.graph, model_dir) if args.graph else None
    prompts = _prompts(args)
    tokenizer = load_tokenizer(model_dir)
    # one default per model, whatever --graph names: the same settings as `spiffy generate` and `spiffy calibrate`
    settings = settle_settings(args, model_dir, chat=None if args.no_chat is None else not args.no_chat,
                               has_template=bool(getattr(tokenizer, "chat_template", None)),
                               device=default_device(args.device))
    note = card_note("spiffy bench dllm", model_dir, settings)
    if note:
        print(note, file=sys.stderr)
    args.dtype, args.no_chat, cfg, extra = settings.dtype, not settings.chat, settings.config, settings.extra
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    args.is_main_rank, device = dp.is_main, str(dp.device)
    placement = placement_kwargs(args)
    model = load_model(model_dir, dtype=args.dtype, device=device, **placement, **quantization_kwargs(args))
    device = str(model_device(model)) if placement else device  # inputs go where the embedding computes
    set_threads(args.threads, model)
    if graph_path is None:  # the graph shipped with the model for these decoding flags
        graph_path = compatible_shipped_graph(model, model_dir, cfg, prefer=settings.card, **extra)
        print(f"spiffy bench dllm: using the graph shipped with the model: {graph_path}", file=sys.stderr)
    graph = load_graph(graph_path)
    family_cfg = check_graph_fits(model, graph, str(graph_path), cfg, **extra)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    diffs = differences(recorded_settings(graph_path), dtype, not args.no_chat, family_cfg)
    if diffs:
        print(difference_note("spiffy bench dllm", graph_path, diffs), file=sys.stderr)
    beyond = [b for b in budgets if b > len(graph)]
    if beyond:  # the rows still run (at most one draft per node and step): said once, not left to the reader
        print(f"spiffy bench dllm: note: budget(s) {', '.join(map(str, beyond))} exceed the graph's {len(graph)} "
              f"nodes; those rows keep all {len(graph)} nodes per step (the same drafts as --budgets {len(graph)})",
              file=sys.stderr)
    if _batch_sizes(args):
        methods = dllm_methods(model, tokenizer, cfg, graph, budgets, device, extra, score=args.score)
        return _throughput(args, "dllm", methods, model, tokenizer, prompts, device, graph=str(graph_path),
                           gen_length=cfg.gen_length)
    freedave = parse_rival_list("freedave", _rival_widths(args.freedave, budgets))
    ssd = parse_rival_list("ssd", _rival_widths(args.ssd, budgets))
    companion = _companion_graph(args, cfg, model_dir)
    announce_cost("spiffy bench dllm", len(prompts),
                  ["baseline"] + [f"Spiffy D*={b}" for b in budgets] + [f"FreeDave {k}" for k in freedave]
                  + [f"SSD {k}" for k in ssd]
                  + ([f"threshold {companion[0]}: baseline"] + [f"Spiffy D*={b}" for b in budgets] if companion else []),
                  f"decodes of {cfg.gen_length} positions", args.warmup)

    def run(run_cfg: Any, run_graph: Any, run_extra: dict[str, Any], run_path: str, **rivals: Any) -> dict[str, Any]:
        return run_dllm_bench(
            model, tokenizer, prompts, run_cfg, run_graph, budgets, config_overrides=run_extra, chat=not args.no_chat,
            warmup=args.warmup, progress=not args.no_progress, model_name=str(model_dir), dataset=args.dataset,
            graph_path=run_path, device=device, parallel=dp, score=args.score, **rivals,
        )

    res = run(cfg, graph, extra, str(graph_path), freedave=freedave, ssd=ssd)
    if companion is not None:
        res["companion"] = _companion_run(args, companion, run)
        res["all_identical"] = bool(res["all_identical"] and res["companion"]["all_identical"])
        res["all_divergences_near_ties"] = bool(res["all_divergences_near_ties"]
                                                and res["companion"]["all_divergences_near_ties"])
    return _finish(args, res, "some speculative outputs differ from the baseline")


def run_ar(args: argparse.Namespace) -> int:
    """``spiffy bench ar``."""
    budgets = parse_budgets(args.budgets)
    accepts = [a.strip() for a in str(args.accept).split(",") if a.strip()]
    bad = [a for a in accepts if a not in ACCEPT_RULES]
    if bad or not accepts:
        raise ConfigError(f"--accept {args.accept!r}: use a comma-separated list of {', '.join(ACCEPT_RULES)}")
    drafts = parse_budgets(args.drafts, minimum=1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    dllm_dir = checkpoint_dir(args.dllm_drafter) if args.dllm_drafter else None
    if dllm_dir is None and not args.target and not args.drafter and is_embedded_available("ar-dllm-drafter"):
        dllm_dir = embedded_model_path("ar-dllm-drafter")
    target_dir = checkpoint_dir(args.target) if args.target else embedded_model_path("ar-target")
    drafter_dir = checkpoint_dir(args.drafter) if args.drafter else embedded_model_path("ar-drafter")
    prompts = load_benchmark_prompts(args.dataset, args.datasets, args.max_prompts, skip=args.skip or 0)
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    args.is_main_rank, device = dp.is_main, str(dp.device)
    placement = placement_kwargs(args)
    quiet_loading()
    target = load_model(target_dir, dtype=args.dtype, device=device, **placement, **quantization_kwargs(args))
    device = str(model_device(target)) if placement else device  # drafters and inputs: the embedding's device
    dtype = next(target.parameters()).dtype
    if drafter_kind(drafter_dir) == DLLM_DRAFTER.name:
        raise ConfigError(f"--drafter {drafter_dir} is a dLLM; fix: pass it as --dllm-drafter (--drafter takes a DFlash "
                          "or DFlash2 drafter)")
    quant = quantization_kwargs(args, drafter=True)
    drafter = load_ar_drafter(drafter_dir, dtype=dtype, device=device, **quant)
    dllm = load_ar_drafter(dllm_dir, dtype=dtype, device=device, **quant) if dllm_dir is not None else None
    set_threads(args.threads, target, drafter, dllm)
    tokenizer = load_tokenizer(target_dir)
    if _batch_sizes(args):
        methods = ar_methods(
            target, drafter, budgets, max_new_tokens=args.max_new_tokens, temperature=args.temperature or 0.0,
            top_p=1.0 if args.top_p is None else args.top_p, top_k=0 if args.top_k is None else args.top_k,
            seed=args.seed or 0, stops=stop_token_ids(target, tokenizer, not args.no_chat), dllm_drafter=dllm,
            drafts=drafts,
        )
        return _throughput(args, "ar", methods, target, tokenizer, prompts, device,
                           max_new_tokens=args.max_new_tokens)
    kind = drafter_kind(drafter)
    planned = plan_entries(budgets, methods=methods, accepts=accepts, drafts=drafts,
                           have_dflash=kind == DFLASH_DRAFTER.name, have_dllm=dllm is not None,
                           have_dflash2=kind == DFLASH2_DRAFTER.name)
    announce_cost("spiffy bench ar", len(prompts), [e.name for e in planned],
                  f"generations of up to {args.max_new_tokens} tokens", args.warmup)
    res = run_ar_bench(
        target, drafter, tokenizer, prompts, budgets, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
        top_k=0 if args.top_k is None else args.top_k, seed=args.seed, chat=not args.no_chat, warmup=args.warmup,
        progress=not args.no_progress, target_name=str(target_dir), drafter_name=str(drafter_dir),
        dataset=args.dataset, device=device, parallel=dp, dllm_drafter=dllm,
        dllm_drafter_name=str(dllm_dir) if dllm_dir is not None else None, methods=methods, accepts=accepts,
        drafts=drafts,
    )
    return _finish(args, res, "some outputs differ from plain AR")


def _batch_sizes(args: argparse.Namespace) -> list[int]:
    """The batch sizes of a throughput run (empty: the usual report)."""
    if args.batch_sizes is not None and args.batch_size is not None:
        raise ConfigError("give --batch-sizes or --batch-size, not both")
    if args.batch_size is not None:
        return parse_batch_sizes(str(args.batch_size))
    return [] if args.batch_sizes is None else parse_batch_sizes(args.batch_sizes)


def _throughput(args: argparse.Namespace, kind: str, methods: dict[str, Any], model: Any, tokenizer: Any,
                prompts: list[Any], device: str, **meta: Any) -> int:
    """Measure every method at every batch size; write throughput.json / throughput.md into --out (rank 0)."""
    sizes = _batch_sizes(args)
    encoded = encode_prompts(tokenizer, prompts, chat=not args.no_chat)
    n = max(len(encoded), max(sizes))
    announce_cost(f"spiffy bench {kind}", n, [f"{m} @ batch {b}" for m in methods for b in sizes], "decodes",
                  args.warmup)
    rows = measure(methods, encoded, sizes, device, warmup=args.warmup)
    res = throughput_report(kind, rows, model=model, device=device,
                            meta=dict(dataset=args.dataset, prompts=n, batch_sizes=sizes, **meta))
    if getattr(args, "is_main_rank", True):
        out = Path(args.out)
        atomic_write_json(out / "throughput.json", res)
        atomic_write_text(out / "throughput.md", markdown_throughput(res))
        print(markdown_throughput(res))
        print(f"wrote {out / 'throughput.json'} and {out / 'throughput.md'}", file=sys.stderr)
    differ = [r for r in rows if r["identical_to_batch_1"] < 1.0]
    bad = [r for r in differ if not r.get("all_divergences_near_ties")]
    if differ and not bad:  # half precision: each differing row proven a rounding-level near tie
        print("spiffy bench: note: batched outputs differ from batch 1 for "
              + ", ".join(f"{r['method']} @ {r['batch_size']}" for r in differ)
              + ", each at a proven near tie (spiffy.bench.batch_fidelity)", file=sys.stderr)
    if bad:
        print("spiffy bench: WARNING: batched outputs differ from batch 1, not proven near ties, for "
              + ", ".join(f"{r['method']} @ {r['batch_size']}" for r in bad), file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy bench MODE``; returns the exit status (1 when an output differs from its baseline)."""
    if args.bench_mode in ("dllm", "ar") and args.out is None:
        args.out = f"bench-{args.bench_mode}"  # in the working directory, like `bench overheads`
    if args.bench_mode in ("dllm", "ar", "overheads"):
        check_output_path(args.out, directory=True)  # before the run, not after it
    if args.bench_mode in ("dllm", "ar"):
        _batch_sizes(args)  # bad --batch-sizes fail before any model is loaded
        _plots_possible(args)
    with batch_invariant(bool(getattr(args, "batch_invariant", False))):
        if args.bench_mode == "dllm":
            return run_dllm(args)
        if args.bench_mode == "ar":
            return run_ar(args)
    if args.bench_mode == "overheads":
        return run_overheads_cli(args)
    return _no_mode(args)


def run_overheads_cli(args: argparse.Namespace) -> int:
    """``spiffy bench overheads``: measure, write results.json / results.md (/ overheads.png), print the tables."""
    _plots_possible(args)
    budgets = parse_budgets(args.budgets, minimum=1)
    threads = 1 if args.threads is None else (args.threads or None)  # 0: leave torch's default
    res = run_overheads(args.out, repeats=args.repeats, threads=threads, budgets=budgets, vocab=args.vocab,
                        nodes=args.nodes, spiffy_budget=args.spiffy_budget, memory=not args.no_memory,
                        plots=not args.no_plots, keep_freed_memory=not args.no_steady_allocator,
                        ar_tokens=args.ar_tokens)
    print(markdown_overheads(res))
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'results.md'}", file=sys.stderr)
    return 0
