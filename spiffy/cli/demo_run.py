"""``spiffy demo`` at run time: the tour (the parser and what the demo shows: :mod:`spiffy.cli.demo`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from spiffy.arspec.methods import get_method
from spiffy.cli.demo import AR_PART_FLAGS, CALIBRATION_PROMPTS, DEMO_PROMPTS, DLLM_PART_FLAGS
from spiffy.cli.flags import refuse
from spiffy.cli.runtime import default_device, quiet_loading, set_threads
from spiffy.bench.ar import run_ar_bench
from spiffy.bench.datasets import BenchPrompt
from spiffy.bench.dllm import run_dllm_bench
from spiffy.bench.report import divergence_verdict
from spiffy.decoding import DecodeConfig
from spiffy.embedded import (
    embedded_graph_path,
    embedded_model_path,
    is_embedded_available,
    missing_message,
    resolve_graph_argument,
)
from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.models.ar_drafters import drafter_kind, load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.hub import checkpoint_dir
from spiffy.models.tiny import make_tiny
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.graph import load_graph

def _resolve(args: argparse.Namespace) -> tuple[dict[str, Path], bool, bool]:
    """Paths of the parts to run: ``({'dllm', 'target', 'drafter': path}, run_dllm, run_ar)``; raises ConfigError
    listing everything missing."""
    do_dllm = args.only in (None, "dllm")
    do_ar = args.only in (None, "ar")
    paths: dict[str, Path] = {}
    missing: list[str] = []
    wanted = []
    if do_dllm:
        wanted.append(("dllm", args.model, "dllm", "--model"))
    if do_ar:
        wanted += [("target", args.target, "ar-target", "--target"), ("drafter", args.drafter, "ar-drafter", "--drafter")]
    for key, explicit, kind, flag in wanted:
        if not explicit and getattr(args, "random_tiny", False):
            explicit = str(_random_tiny(args.random_tiny_dir, kind))
        if explicit:
            paths[key] = _checkpoint(flag, explicit)
            continue
        try:
            paths[key] = embedded_model_path(kind)
        except ConfigError:
            missing.append(f"  - {flag}: {missing_message(kind)}")
    if do_ar and not missing:
        dllm_drafter = _dllm_drafter_path(args)
        if dllm_drafter is not None:
            paths["dllm_drafter"] = dllm_drafter
    if missing:
        raise ConfigError(
            "spiffy demo needs checkpoints that are not available:\n" + "\n".join(missing) + "\n"
            "fix: pass them explicitly, e.g. `spiffy demo --model DIR --graph FILE --target DIR --drafter DIR` "
            "(tiny random ones: `spiffy tiny llada DIR`, `spiffy tiny qwen3 DIR`, `spiffy tiny dflash DIR --target DIR`), "
            "or run only one part with --only dllm|ar"
        )
    return paths, do_dllm, do_ar


def _checkpoint(flag: str, value: str) -> Path:
    """The checkpoint directory a flag names (a directory, or a Hub id ORG/NAME[@REV]); ConfigError without a
    config.json there."""
    path = checkpoint_dir(value)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {path}: no config.json there; fix: pass a checkpoint directory")
    return path


def _dllm_drafter_path(args: argparse.Namespace) -> Path | None:
    """The diffusion drafter of the AR part: ``--dllm-drafter``; a tiny random one with ``--random-tiny``; else the
    embedded one when it is shipped and the target is the embedded one too (it was aligned to that target); else
    ``None`` (the DEER / SpecDiff-2 rows are skipped)."""
    if args.dllm_drafter:
        path = _checkpoint("--dllm-drafter", args.dllm_drafter)
        kind = drafter_kind(path)
        if kind != "dllm":
            raise ConfigError(f"--dllm-drafter {path} is a {kind} drafter; fix: pass a diffusion drafter (e.g. "
                              "`spiffy tiny dllm-drafter DIR --target TARGET`), or a DFlash one with --drafter")
        return path
    if args.target:  # the embedded / random drafter shares only the embedded / random target's tokenizer
        return None
    if getattr(args, "random_tiny", False):
        return _random_tiny(args.random_tiny_dir, "ar-dllm-drafter")
    return embedded_model_path("ar-dllm-drafter") if is_embedded_available("ar-dllm-drafter") else None


def _random_tiny(root: Path, kind: str) -> Path:
    """Write (once per run) a tiny random checkpoint for ``kind`` into the run's temporary directory ``root``
    (removed when the demo ends)."""
    if kind == "dllm":
        out = root / "tiny-llada"
        if not out.exists():
            make_tiny("llada", out, seed=0)
        return out
    target = root / "tiny-qwen3"
    if not target.exists():
        make_tiny("qwen3", target, seed=0)
    if kind == "ar-target":
        return target
    if kind == "ar-dllm-drafter":
        out = root / "tiny-dllm-drafter"
        if not out.exists():
            make_tiny_dllm_drafter(out, target, seed=0)
        return out
    out = root / "tiny-dflash"
    if not out.exists():
        make_tiny("dflash", out, seed=0, target=target)
    return out


def _demo_config(graph: Any, gen_length: int, block_length: int | None) -> Any:
    """The decoding config: the graph's calibrated rule with the demo's gen_length, else a one-token-per-step one."""
    dec = None
    if graph is not None:
        cal = graph.meta.get("calibration", {}) if isinstance(graph.meta, dict) else {}
        dec = cal.get("decode_config") if isinstance(cal, dict) else None
    if dec:
        cfg = DecodeConfig.from_dict({k: v for k, v in dec.items() if k != "seed"})
        bl = int(block_length or cfg.resolved_block_length)
        spb = cfg.steps_per_block
        n = max(1, gen_length // bl)
        steps = None if cfg.steps is None and spb == bl else n * spb
        return cfg.replace(gen_length=n * bl, block_length=bl, steps=steps)
    bl = int(block_length or 16)
    n = max(1, gen_length // bl)
    return DecodeConfig(gen_length=n * bl, block_length=bl)


def _dllm_part(args: argparse.Namespace, model_dir: Path, prompts: list[Any], device: str) -> dict[str, Any]:
    model = load_model(model_dir, dtype=args.dtype, device=device)
    set_threads(args.threads, model)
    tokenizer = load_tokenizer(model_dir)
    # the graphs shipped with this very checkpoint (none for --random-tiny ones: those calibrate on the fly)
    graph_path = resolve_graph_argument(args.graph, model_dir) if args.graph else embedded_graph_path(model_dir)
    note = None
    if graph_path is not None:
        graph = load_graph(graph_path)
        cfg = _demo_config(graph, args.gen_length, args.block_length)
    else:
        cfg = _demo_config(None, args.gen_length, args.block_length)
        t0 = time.perf_counter()
        print(f"no calibrated graph for {model_dir}: calibrating one on the fly "
              f"({len(CALIBRATION_PROMPTS)} built-in code prompts, 10 nodes)...", file=sys.stderr)
        graph = calibrate(model, tokenizer, list(CALIBRATION_PROMPTS), cfg, nodes=10, chat=False,
                          progress=not args.no_progress, dataset="demo-code")
        note = (f"graph calibrated on the fly ({len(CALIBRATION_PROMPTS)} built-in code prompts, "
                f"{time.perf_counter() - t0:.1f}s; projected NFE reduction {graph.projected.get('reduction', 0):.2f}x)")
    res = run_dllm_bench(model, tokenizer, prompts, cfg, graph, [int(args.budget)], chat=False, warmup=1,
                         progress=not args.no_progress, model_name=str(model_dir), dataset="demo",
                         graph_path=str(graph_path) if graph_path else "(calibrated on the fly)", device=device)
    res["graph_note"] = note
    return res


def _ar_part(args: argparse.Namespace, paths: dict[str, Path], prompts: list[Any], device: str) -> dict[str, Any]:
    """AR vs DFlash vs DDTree, plus DEER / SpecDiff-2 / DDTree over the diffusion drafter when there is one."""
    quiet_loading()
    target = load_model(paths["target"], dtype=args.dtype, device=device)
    dtype = next(target.parameters()).dtype
    drafter = load_ar_drafter(paths["drafter"], dtype=dtype, device=device)  # DFlash or DFlash2
    tokenizer = load_tokenizer(paths["target"])
    dllm_dir = paths.get("dllm_drafter")
    dllm_drafter = load_ar_drafter(dllm_dir, dtype=dtype, device=device) if dllm_dir is not None else None
    set_threads(args.threads, target, drafter, dllm_drafter)
    return run_ar_bench(target, drafter, tokenizer, prompts, [int(args.tree_budget)],
                        max_new_tokens=int(args.max_new_tokens), chat=False, warmup=1,
                        progress=not args.no_progress, target_name=str(paths["target"]),
                        drafter_name=str(paths["drafter"]), dataset="demo", device=device,
                        dllm_drafter=dllm_drafter, dllm_drafter_name=str(dllm_dir) if dllm_dir else None,
                        drafts=[int(args.drafts)])  # every method whose drafter is present


LEGEND = """\
What the tables mean:
  NFE        model forward calls (function evaluations); the dLLM baseline makes one per denoising step
  tau        tokens produced per target forward (verification round), including the bonus token; plain AR = 1
  drafter    DFlash: a small model reading the target's hidden states; dLLM: a diffusion LM drafting a block
             from the committed tokens alone (DEER: one chain; SpecDiff-2: K sampled drafts verified together as
             a tree; DDTree: the best tree under the node budget from either drafter's per-position distributions)
  identical  speculative outputs equal to their baseline token for token (lossless: always all of them)
  speedup    wall-clock ratio against the baseline, measured in this process on these prompts"""

#: the honest word on wall-clock, printed after every demo
WALL_CLOCK_NOTE = (
    "Wall-clock: on a CPU a forward over 1 + D rows costs about 1 + D times one row, so these tiny models decode "
    "no faster with fewer forwards (speedups below 1x are expected here); on a GPU a large model is memory-bound, "
    "extra rows in a batch are nearly free, and fewer forwards become the speedup."
)

#: shown with the embedded (trained) checkpoints, whose text is not the point
QUALITY_NOTE = (
    "note: the embedded models are tiny (about 4M parameters, 45 minutes to 4 hours of CPU training each): their "
    "text is Python-shaped but often repetitive; what the demo shows is the identical-output check, NFE and tau."
)


def _x(v: Any) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def format_dllm(res: dict[str, Any], prompts: list[Any]) -> str:
    """Generated texts and the baseline-vs-Spiffy table of a demo run."""
    b, r = res["baseline"], res["runs"][0]
    dec = res["decoding"]
    lines = [f"== diffusion LM: {res['model']} ({res['family']}), gen_length {dec['gen_length']}, block "
             f"{dec['block_length']}, Spiffy budget {r['budget']} ==", ""]
    if res.get("graph_note"):
        lines += [f"note: {res['graph_note']}", ""]
    for p, s in zip(prompts, res.get("outputs", [])):
        lines += [f"--- prompt: {p.prompt!r}", p.prompt + s, ""]
    ident = f"{r['identical']}/{res['num_prompts']}" + _verdict(r)
    lines += [
        "| decoder  | NFE | NFE reduction | tokens/s | speedup | identical |",
        "|----------|-----|---------------|----------|---------|-----------|",
        f"| baseline | {b['nfe_total']} | 1.00x | {_num(b['tokens_per_s'])} | 1.00x | - |",
        f"| Spiffy   | {r['nfe_total']} | {_x(r['nfe_reduction'])} | {_num(r['tokens_per_s'])} | {_x(r['speedup'])} | {ident} |",
        "",
    ]
    return "\n".join(lines)


def _shape(m: dict[str, Any]) -> str:
    """What a method drafts per round: a chain, ``K=`` sampled drafts, or a tree ``budget`` nodes large."""
    spec = get_method(m["method"])
    if spec.size_knob == "drafts":
        return f"K={m['drafts']}"
    if spec.size_knob == "budget":
        return f"budget {m['budget']}"
    return spec.shape if spec.needs_drafter else "-"


def _verdict(row: dict[str, Any]) -> str:
    """``"  MISMATCH"`` / ``"  (near tie)"`` after a row's identical count (nothing when all are identical)."""
    verdict = divergence_verdict(row)
    return "" if not verdict else ("  (near tie)" if verdict == "near tie" else "  MISMATCH")


def format_ar(res: dict[str, Any], prompts: list[Any]) -> str:
    """Generated texts and the AR-vs-speculative table of a demo run (one row per method and drafter)."""
    head = f"== AR target: {res['target']} + DFlash drafter {res['drafter']}"
    if res.get("dllm_drafter"):
        head += f" + dLLM drafter {res['dllm_drafter']}"
    lines = [f"{head}, max_new_tokens {res['decoding']['max_new_tokens']} ==", ""]
    for p, s in zip(prompts, res.get("outputs", [])):
        lines += [f"--- prompt: {p.prompt!r}", p.prompt + s, ""]
    lines += ["| method | drafter | drafts | tau (incl. bonus) | tokens/s | speedup vs AR | identical to AR |",
              "|--------|---------|--------|-------------------|----------|---------------|-----------------|"]
    for m in res["methods"]:
        ident = f"{m['identical']}/{res['num_prompts']}" + _verdict(m)
        spec = get_method(m["method"])
        drafter = spec.drafter.label if spec.drafter is not None else "-"
        lines.append(f"| {spec.label} | {drafter} | {_shape(m)} | {m['tau']:.2f} | "
                     f"{_num(m['tokens_per_s'])} | {_x(m['speedup_vs_ar'])} | {ident} |")
    lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy demo``; returns 0, or 1 when a speculative output differs from its baseline."""
    if not 1 <= int(args.max_prompts) <= len(DEMO_PROMPTS):
        raise ConfigError(f"--max-prompts must be in 1..{len(DEMO_PROMPTS)}, got {args.max_prompts}")
    if int(args.drafts) < 1:
        raise ConfigError(f"--drafts must be >= 1, got {args.drafts}; fix: pass e.g. --drafts 4")
    if int(args.threads or 0) < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}; fix: pass 1, or 0 for torch's default")
    threads_before = torch.get_num_threads()
    scratch = tempfile.TemporaryDirectory(prefix="spiffy-demo-") if args.random_tiny else None
    args.random_tiny_dir = Path(scratch.name) if scratch is not None else None
    try:
        return _run(args)
    finally:  # the caller's setting back (the demo may run inside a larger process), and no directory left behind
        torch.set_num_threads(threads_before)
        if scratch is not None:
            scratch.cleanup()


def _run(args: argparse.Namespace) -> int:
    asked = set(getattr(args, "given", set()))
    parser = getattr(args, "command_parser", None)
    if args.only == "ar":
        refuse(asked & DLLM_PART_FLAGS, "read by the diffusion part only, and --only ar skips it",
               "drop them, or drop --only ar", parser)
    if args.only == "dllm":
        refuse(asked & AR_PART_FLAGS, "read by the AR part only, and --only dllm skips it",
               "drop them, or drop --only dllm", parser)
    paths, do_dllm, do_ar = _resolve(args)
    if getattr(args, "random_tiny", False):
        print("note: --random-tiny: tiny RANDOM checkpoints; outputs are gibberish and acceptance rates mean nothing, "
              "but every speculative output must still equal its baseline.\n")
    elif not (args.model or args.target or args.drafter):
        print(QUALITY_NOTE + "\n")
    ok = _tour(args, paths, do_dllm, do_ar, default_device(args.device))
    return 0 if ok else 1


def _tour(args: argparse.Namespace, paths: dict[str, Path], do_dllm: bool, do_ar: bool, device: str) -> bool:
    """Run the requested parts, print their tables, the legend and the timing line; True when all identical."""
    prompts = [BenchPrompt(str(k), p, "demo") for k, p in enumerate(DEMO_PROMPTS[: int(args.max_prompts)])]
    t0 = time.perf_counter()
    ok, near_ties = True, False
    for part in ("dllm", "ar") if do_dllm and do_ar else ("dllm",) if do_dllm else ("ar",):
        res = _dllm_part(args, paths["dllm"], prompts, device) if part == "dllm" else _ar_part(args, paths, prompts, device)
        res["outputs"] = [s["text"] for s in res.get("samples", [])]
        print(format_dllm(res, prompts) if part == "dllm" else format_ar(res, prompts))
        near_ties |= not res["all_identical"] and bool(res.get("all_divergences_near_ties"))
        ok &= bool(res["all_identical"] or res.get("all_divergences_near_ties"))
    print(LEGEND + "\n" + WALL_CLOCK_NOTE + "\n")
    verdict = ("identical to their baselines, apart from divergences proven to be rounding-level near ties"
               if near_ties else "identical to their baselines")
    print(f"demo finished in {time.perf_counter() - t0:.1f}s of wall-clock on {device} ({torch.get_num_threads()} "
          f"thread(s)); speculative outputs {verdict if ok else 'DIFFER from their baselines (a bug: please report it)'}.")
    return ok
