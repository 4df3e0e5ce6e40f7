"""``spiffy bench overheads``: what speculative decoding costs besides the model's forward, at real vocabulary sizes.

A speculative method wins wall-clock time only if the forwards it saves are worth more than the work it adds around
them. This benchmark measures that added work on synthetic logits of the real sizes (no 8B model needed):

* **Spiffy** (LLaDA-8B's vocabulary ``V = 126,464``, block 32, one token per step, greedy, no cache): a graph of
  ``D = 10`` nodes calibrated with the project's own tools on a synthetic model's trajectory
  (:func:`~spiffy.bench.synthetic.calibrated_graph`), ``D* = 5`` kept per step. Per denoising step, the non-forward
  wall time (everything but the model call: ranking, pruning, instantiation, the walk and its transitions) of
  :func:`~spiffy.selfspec.runtime.speculative_generate` against :func:`~spiffy.decoding.batch.run_baseline`'s (the
  transition: softmax, confidences, selection), on a model whose drafts are never accepted (every step pays the
  whole drafting work: the worst case) and on one whose drafts often are. A third row ranks with its own softmax
  instead of reusing the transition's, to show what the reuse saves.
* **DDTree** (Qwen3's vocabulary ``V = 151,936``, depth 16 = the DFlash block): per round, the non-forward stages
  (tree build, :func:`~spiffy.verify.compile_tree` via ``compile_round``, commit on a Qwen3-8B-shaped K/V cache:
  36 layers, 8 K/V heads of 128, bfloat16) per budget; and the tree builder against the reference algorithm
  (:mod:`spiffy.bench.ddtree_reference`) on identical logits.
* **Builder and compile vs the reference** at ``V = 4,096`` and ``151,936``, and **plain AR against a bare decode
  loop** (:mod:`spiffy.bench.overheads_ar`; medians).
* **Host synchronisations** (:class:`~spiffy.bench.syncs.SyncCounter`): per Spiffy step / forward and per DDTree
  round.
* **Memory** (:mod:`spiffy.bench.memory`): peak of one verification forward, Spiffy per cache mode on the embedded
  tiny LLaDA, DDTree per budget on the embedded tiny Qwen3 target, each against the baseline's one forward.

Methods are interleaved. A Spiffy figure is the median of ``repeats`` whole generations (each spans many scheduler
time slices; the fastest is kept beside it); a DDTree figure, a few milliseconds of work, is the fastest of
``3 * repeats`` (timeit's convention: on a shared machine the least disturbed run is the closest to the code's own
cost; the median is kept beside it). Run it with ``--threads 1`` on a machine as idle as possible.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from spiffy._version import __version__
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.methods import DDTREE
from spiffy.arspec.stages import RoundBuffers, TargetRunner, build_trees, commit, compile_round
from spiffy.arspec.tree import DraftTree
from spiffy.bench.ddtree_reference import reference_build, reference_visibility
from spiffy.bench.memory import MEMORY_METHODS, measure_memory
from spiffy.bench.overheads_ar import (BUILDER_VOCABS, markdown_ar_overhead, markdown_builders, measure_ar_overhead,
                                       measure_builders)
from spiffy.bench.synthetic import SyntheticDLLM, calibrated_graph, synthetic_draft_logits, synthetic_session
from spiffy.bench.syncs import SyncCounter
from spiffy.decoding.batch import run_baseline
from spiffy.errors import ConfigError
from spiffy.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from spiffy.selfspec.graph import DraftGraph
from spiffy.selfspec.runtime import speculative_generate

__all__ = [
    "LLADA_VOCAB", "QWEN3_VOCAB", "DEFAULT_BUDGETS", "run_overheads", "measure_spiffy", "measure_ddtree",
    "spiffy_sync_counts", "ddtree_sync_counts", "markdown_overheads",
]

LLADA_VOCAB = 126_464
QWEN3_VOCAB = 151_936
DEFAULT_BUDGETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
#: Qwen3-8B's K/V cache layout: layers, K/V heads, head dim
QWEN3_8B_CACHE: tuple[int, int, int] = (36, 8, 128)
PROMPT_LEN = 8
ACCEPTED_PATH = 9  # nodes committed per DDTree round (DDTree's tau ~ 10 on Qwen3-8B, bonus included)


def steady_allocator() -> bool:
    """Make glibc keep freed memory for reuse, as PyTorch's caching allocator does on a GPU (returns whether it could).

    By default glibc hands large freed blocks back to the kernel and the next allocation of the same size faults its
    pages in again (milliseconds for the 16 MB softmax of a 32-row window at V = 126,464), so timings would depend on
    the allocation history rather than on the work. This raises the mmap threshold to its maximum (32 MB) and stops
    trimming, for the rest of the process. Not available off glibc (then nothing changes).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
        return libc.mallopt(_M_TOP_PAD, 256 << 20) == 1 and ok
    except (OSError, AttributeError):
        return False


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters


def _median_ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def _best_ms(values: Sequence[float]) -> float:
    """The fastest of the repeated runs (timeit's convention: on a shared machine the least disturbed run is the
    closest to the code's own cost; the medians are kept beside it in results.json)."""
    return 1e3 * min(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------------- Spiffy
def _spiffy_run(model: SyntheticDLLM, graph: DraftGraph | None, budget: int, block: int, reuse: bool = True) -> dict[str, Any]:
    """One generation (one block) on ``model``; ``graph=None`` = the baseline. Non-forward = wall - model time."""
    session = synthetic_session(model, PROMPT_LEN, block, block)
    if not reuse:
        session.publish_probs = lambda *published: None  # type: ignore[method-assign]
    model.forward_seconds = 0.0
    t0 = time.perf_counter()
    if graph is None:
        stats: Any = run_baseline(session)
        forwards, stages, accepted = int(stats.nfe), {}, 0
    else:
        stats = speculative_generate(session, graph, budget)
        forwards, stages, accepted = int(stats.forwards), dict(stats.stage_times), int(stats.accepted_total)
    wall = time.perf_counter() - t0
    return {"non_forward": wall - model.forward_seconds, "steps": int(stats.steps), "forwards": forwards,
            "accepted": accepted, "stages": stages, "tokens": session.x[0].tolist()}


def spiffy_models(vocab: int, block: int, nodes: int, seed: int = 0) -> tuple[DraftGraph, dict[str, SyntheticDLLM]]:
    """The calibrated graph and the two synthetic models (``"nothing accepted"``, ``"drafts accepted"``)."""
    seq = PROMPT_LEN + block
    accepting = SyntheticDLLM(vocab, seq, tables=4, drift=0.3, seed=seed)
    graph = calibrated_graph(accepting, PROMPT_LEN, block, block, nodes)
    rejecting = SyntheticDLLM(vocab, seq, tables=4, drift=math.inf, seed=seed + 1)
    return graph, {"nothing accepted": rejecting, "drafts accepted": accepting}


def measure_spiffy(vocab: int = LLADA_VOCAB, block: int = 32, nodes: int = 10, budget: int = 5, repeats: int = 3) -> dict[str, Any]:
    """Non-forward time per step of Spiffy vs the baseline on both synthetic models (module docstring)."""
    graph, models = spiffy_models(vocab, block, nodes)
    out: dict[str, Any] = {"vocab": vocab, "block": block, "nodes": len(graph.nodes), "budget": budget,
                           "graph": [{"level": int(n.level), "pairs": [list(p) for p in n.pairs]} for n in graph.nodes],
                           "scenarios": []}
    variants = {"baseline": (None, True), "spiffy": (graph, True), "spiffy (ranking recomputes the softmax)": (graph, False)}
    for name, model in models.items():
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _ in range(max(1, repeats)):
            for v, (g, reuse) in variants.items():
                runs[v].append(_spiffy_run(model, g, budget, block, reuse))
        base_tokens = runs["baseline"][0]["tokens"]
        row: dict[str, Any] = {"scenario": name}
        for v, rs in runs.items():
            r0 = rs[0]
            row[v] = {  # a run spans many scheduler time slices: the median is the robust figure here
                "ms_per_step": _median_ms([r["non_forward"] / r["steps"] for r in rs]),
                "ms_per_forward": _median_ms([r["non_forward"] / r["forwards"] for r in rs]),
                "best_ms_per_step": _best_ms([r["non_forward"] / r["steps"] for r in rs]),
                "steps": r0["steps"], "forwards": r0["forwards"], "accepted": r0["accepted"],
                "stage_ms_per_forward": {k: _median_ms([r["stages"][k] / r["forwards"] for r in rs])
                                         for k in ("rank", "prune", "instantiate", "walk")} if r0["stages"] else {},
                "identical_to_baseline": all(r["tokens"] == base_tokens for r in rs),
            }
        base = row["baseline"]["ms_per_step"]
        row["ratio_per_step"] = row["spiffy"]["ms_per_step"] / base
        row["ratio_per_forward"] = row["spiffy"]["ms_per_forward"] / base
        out["scenarios"].append(row)
    return out


def spiffy_sync_counts(vocab: int, block: int, nodes: int, budget: int, static: bool = False,
                       scenario: str = "nothing accepted") -> dict[str, Any]:
    """Would-be device syncs of one generation on a synthetic model (``scenario``: ``"nothing accepted"``, every
    step one forward with the full drafting work, or ``"drafts accepted"``): baseline and Spiffy, per step and per
    verification forward (exact integers). ``static``: the forwards on the static path (``compile=True``)."""
    graph, models = spiffy_models(vocab, block, nodes)
    model = models[scenario]
    res: dict[str, Any] = {}
    for name, g in (("baseline", None), ("spiffy", graph)):
        session = synthetic_session(model, PROMPT_LEN, block, block)
        if static:
            session.use_static(capture=True)
        with SyncCounter() as counter:
            stats: Any = run_baseline(session) if g is None else speculative_generate(session, g, budget)
        forwards = int(stats.nfe) if g is None else int(stats.forwards)
        res[name] = {"total": counter.total, "steps": int(stats.steps), "forwards": forwards,
                     "accepted": 0 if g is None else int(stats.accepted_total),
                     "per_step": counter.total / stats.steps, "per_forward": counter.total / forwards,
                     "by_call": dict(sorted(counter.counts.items()))}
    return res


# ---------------------------------------------------------------------------------------------------- DDTree
def _cache(layers: int, heads: int, head_dim: int, rows: int, dtype: torch.dtype) -> Any:
    cache = DynamicCache()
    _append(cache, layers, heads, head_dim, rows, dtype)
    return cache


def _append(cache: Any, layers: int, heads: int, head_dim: int, rows: int, dtype: torch.dtype) -> None:
    """Stand-in for a verification forward's K/V: ``rows`` new positions in every layer (not timed)."""
    kv = torch.zeros(1, heads, rows, head_dim, dtype=dtype)
    for layer in range(layers):
        cache.update(kv, kv, layer)


def _best_path(tree: DraftTree, length: int) -> list[int]:
    """The first ``length`` nodes of the best path (each node's best child is its lowest-index child)."""
    parents = tree.parents.tolist()
    path: list[int] = []
    current = -1
    for node, parent in enumerate(parents):
        if len(path) >= length:
            break
        if parent == current:
            path.append(node)
            current = node
    return path


def _round_stages(config: ARSpecConfig, logits: torch.Tensor, runner: TargetRunner, context: int,
                  cache_shape: tuple[int, int, int], clock: Callable[[str], None] | None = None) -> DraftTree:
    """One round's non-forward stages (the generation loop's own stage functions, a batch of one); ``clock(stage)``
    is called after each timed stage."""
    valid = torch.ones(1, context, dtype=torch.bool)
    buffers = RoundBuffers.allocate(1, 1 + int(config.budget))
    roots = [(1, context)]
    if clock:
        clock(None)  # start the clock here
    tree = build_trees([config.spec], [config], [logits], roots)[0]
    if clock:
        clock("tree_build")
    compile_round([tree], roots, valid, runner.dtype, buffers)
    if clock:
        clock("compile")
    _append(runner.cache, *cache_shape, 1 + tree.num_nodes, runner.cache.layers[0].keys.dtype)  # the forward's K/V
    accepted = _best_path(tree, ACCEPTED_PATH)
    if clock:
        clock(None)
    commit(runner, valid, context, [[0] + [a + 1 for a in accepted]])
    if clock:
        clock("commit")
    runner.cache.crop(-(1 + len(accepted)))  # back to the committed context for the next measurement
    return tree


def _tree_sequences(tree: DraftTree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
    return set(paths)


def measure_ddtree(vocab: int = QWEN3_VOCAB, depth: int = 16, budgets: Sequence[int] = DEFAULT_BUDGETS, repeats: int = 3,
                   context: int = 256, cache_shape: tuple[int, int, int] = QWEN3_8B_CACHE) -> dict[str, Any]:
    """Per-round non-forward stage times per budget, and our builder vs the reference on identical logits."""
    logits = synthetic_draft_logits(depth, vocab)
    runner = TargetRunner(None, None, torch.device("cpu"), torch.float32, _cache(*cache_shape, context, torch.bfloat16))  # type: ignore[arg-type]
    rows = []
    for budget in budgets:
        config = ARSpecConfig(method=DDTREE.name, budget=int(budget))
        times: dict[str, list[float]] = {k: [] for k in ("tree_build", "compile", "commit", "builder", "reference",
                                                          "reference_visibility")}
        for _ in range(max(1, repeats)):  # whole rounds: build, compile, then commit on the big cache
            mark = [time.perf_counter()]

            def clock(stage: str | None) -> None:
                now = time.perf_counter()
                if stage is not None:
                    times[stage].append(now - mark[0])
                mark[0] = time.perf_counter()

            tree = _round_stages(config, logits.clone(), runner, context, cache_shape, clock)
        same = True
        for _ in range(max(1, repeats)):  # the builders alone, alternating; each gets freshly written logits (as
            fresh = logits.clone()       # right after the drafter's forward; the copy is not timed)
            t0 = time.perf_counter()
            config.spec.build_tree(config, fresh, context)
            times["builder"].append(time.perf_counter() - t0)
            ref = reference_build(logits.clone(), int(budget))
            times["reference"].append(ref.copy_seconds + ref.heap_seconds)
            t0 = time.perf_counter()
            reference_visibility(ref)
            times["reference_visibility"].append(time.perf_counter() - t0)
            same = same and _tree_sequences(tree) == ref.sequences()
        best = {k: _best_ms(v) for k, v in times.items()}
        rows.append({"budget": int(budget), "nodes": tree.num_nodes, "tree_depth": tree.max_depth(), **{f"{k}_ms": v for k, v in best.items()},
                     **{f"{k}_median_ms": _median_ms(v) for k, v in times.items()},
                     "round_non_forward_ms": best["tree_build"] + best["compile"] + best["commit"],
                     "builder_speedup_vs_reference": best["reference"] / best["builder"], "same_tree_as_reference": same})
    return {"vocab": vocab, "depth": depth, "context": context, "cache_layers_heads_dim": list(cache_shape),
            "accepted_path": ACCEPTED_PATH, "rows": rows}


def ddtree_sync_counts(vocab: int, depth: int, budget: int, context: int = 16,
                       cache_shape: tuple[int, int, int] = (2, 2, 8)) -> dict[str, Any]:
    """Would-be device syncs of one round's non-forward stages (tree build, compile, commit), exact integers."""
    logits = synthetic_draft_logits(depth, vocab)
    runner = TargetRunner(None, None, torch.device("cpu"), torch.float32, _cache(*cache_shape, context, torch.float32))  # type: ignore[arg-type]
    config = ARSpecConfig(method=DDTREE.name, budget=int(budget))
    counts: dict[str, int] = {}
    counter = SyncCounter()

    def clock(stage: str | None) -> None:
        if stage is not None:
            counts[stage] = counter.total
        counter.reset()

    with counter:
        tree = _round_stages(config, logits, runner, context, cache_shape, clock)
    return {"budget": int(budget), "vocab": vocab, "nodes": tree.num_nodes, **counts, "per_round": sum(counts.values())}


# ---------------------------------------------------------------------------------------------------- report
def markdown_overheads(res: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    sp, dd = res["spiffy"], res["ddtree"]
    lines = [f"# spiffy bench overheads ({res['device']}, {res['threads']} thread(s), Spiffy: median of {res['repeats']} runs, "
             f"DDTree: best of {3 * res['repeats']}, "
             f"load average {res.get('load_average_before')} -> {res.get('load_average_after')})", "",
             f"## Spiffy: non-forward time per denoising step (V = {sp['vocab']:,}, block {sp['block']}, "
             f"D = {sp['nodes']}, D* = {sp['budget']}, one token per step, greedy, no cache)", "",
             "| scenario | baseline ms/step | Spiffy ms/step | ratio | Spiffy ms/forward | ratio | forwards (steps) | "
             "rank / prune / instantiate ms per forward | recomputing softmax: ms/step | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in sp["scenarios"]:
        b, s, r = row["baseline"], row["spiffy"], row["spiffy (ranking recomputes the softmax)"]
        st = s["stage_ms_per_forward"]
        lines.append(f"| {row['scenario']} | {b['ms_per_step']:.2f} | {s['ms_per_step']:.2f} | {row['ratio_per_step']:.2f}x | "
                     f"{s['ms_per_forward']:.2f} | {row['ratio_per_forward']:.2f}x | {s['forwards']} ({s['steps']}) | "
                     f"{st['rank']:.2f} / {st['prune']:.2f} / {st['instantiate']:.2f} | {r['ms_per_step']:.2f} | "
                     f"{'yes' if s['identical_to_baseline'] and r['identical_to_baseline'] else 'NO'} |")
    lines += ["", f"## DDTree: per-round non-forward time (V = {dd['vocab']:,}, depth {dd['depth']}, context {dd['context']}, "
              f"commit of {dd['accepted_path']} nodes on a {dd['cache_layers_heads_dim'][0]}-layer cache)", "",
              "| budget | tree build ms | compile ms | commit ms | round ms | builder alone ms | reference builder ms | "
              "builder speedup | reference visibility ms | same tree |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in dd["rows"]:
        lines.append(f"| {row['budget']} | {row['tree_build_ms']:.2f} | {row['compile_ms']:.2f} | {row['commit_ms']:.2f} | "
                     f"{row['round_non_forward_ms']:.2f} | {row['builder_ms']:.2f} | {row['reference_ms']:.2f} | "
                     f"{row['builder_speedup_vs_reference']:.2f}x | {row['reference_visibility_ms']:.2f} | "
                     f"{'yes' if row['same_tree_as_reference'] else 'no'} |")
    sy = res["syncs"]
    lines += ["", "## Host synchronisations (calls that would block on a GPU; upper bound on a CPU run)", "",
              f"- Spiffy, per verification forward (nothing accepted): baseline {sy['spiffy']['baseline']['per_forward']:.0f}, "
              f"Spiffy {sy['spiffy']['spiffy']['per_forward']:.2f} (per step {sy['spiffy']['spiffy']['per_step']:.2f})",
              "- DDTree, per round (tree build + compile + commit): " + ", ".join(
                  f"B={r['budget']}: {r['per_round']}" for r in sy["ddtree"])]
    if res.get("builders"):
        lines += markdown_builders(res["builders"])
    if res.get("ar"):
        lines += markdown_ar_overhead(res["ar"])
    mem = res.get("memory")
    if mem:
        lines += ["", f"## Peak memory of one verification forward ({mem['method']})", "", "| model | case | baseline MiB | speculative MiB | ratio |", "|---|---|---|---|---|"]
        for row in mem["rows"]:
            lines.append(f"| {row['model']} | {row['case']} | {row['baseline_bytes'] / 2**20:.2f} | {row['speculative_bytes'] / 2**20:.2f} | "
                         f"{row['speculative_bytes'] / max(1, row['baseline_bytes']):.2f}x |")
    elif res.get("memory_note"):
        lines += ["", f"Memory: {res['memory_note']}"]
    return "\n".join(lines) + "\n"


def _plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = res["ddtree"]["rows"]
    budgets = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [r["builder_ms"] for r in rows], "o-", label="spiffy tree build (alone)")
    ax.plot(budgets, [r["reference_ms"] for r in rows], "s-", label="reference builder")
    ax.plot(budgets, [r["round_non_forward_ms"] for r in rows], "^-", label="spiffy round (build+compile+commit)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget")
    ax.set_ylabel("ms")
    ax.set_title(f"DDTree non-forward time, V = {res['ddtree']['vocab']:,}")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return True


def _load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (``None`` where the OS does not report them)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def run_overheads(out: str | Path, *, repeats: int = 3, threads: int | None = 1, budgets: Sequence[int] = DEFAULT_BUDGETS,
                  vocab: int | None = None, block: int = 32, nodes: int = 10, spiffy_budget: int = 5, depth: int = 16,
                  memory: bool = True, plots: bool = True, keep_freed_memory: bool = False,
                  ar_tokens: int = 64) -> dict[str, Any]:
    """Run every measurement and write ``results.json``, ``results.md`` (and ``overheads.png``) into ``out``.

    ``vocab`` replaces every real vocabulary size (for quick runs); ``threads`` sets ``torch.set_num_threads``;
    ``ar_tokens``: tokens per plain-AR run against the bare loop (0 skips it);
    ``keep_freed_memory`` calls :func:`steady_allocator` first (the command does; it changes the whole process).
    """
    if ar_tokens < 0:
        raise ConfigError(f"ar_tokens={ar_tokens} must be >= 0; fix: e.g. --ar-tokens 64 (0 skips plain AR)")
    if repeats < 1 or not budgets or any(b < 1 for b in budgets):
        raise ConfigError(f"repeats={repeats} and budgets={list(budgets)} must be >= 1; fix: e.g. --repeats 3 --budgets 16,32")
    if threads is not None:
        torch.set_num_threads(int(threads))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    steady = steady_allocator() if keep_freed_memory else False
    res: dict[str, Any] = {
        "library": __version__, "torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(),
        "machine": platform.machine(), "repeats": repeats,
        "statistic": "Spiffy: median of repeats (best_* keys: fastest); DDTree: fastest of 3 x repeats (*_median_ms keys)",
        "steady_allocator": steady,
        "load_average_before": _load_average(),
        "spiffy": measure_spiffy(vocab or LLADA_VOCAB, block, nodes, spiffy_budget, repeats),
        # one round's stages take milliseconds: three times the repeats, so a few land between other jobs' slices
        "ddtree": measure_ddtree(vocab or QWEN3_VOCAB, depth, budgets, 3 * repeats),
        "syncs": {"spiffy": spiffy_sync_counts(vocab or LLADA_VOCAB, block, nodes, spiffy_budget),
                  "ddtree": [ddtree_sync_counts(vocab or QWEN3_VOCAB, depth, b) for b in budgets]},
        "builders": measure_builders([vocab] if vocab else BUILDER_VOCABS, budgets, repeats=3 * repeats),
    }
    if ar_tokens > 0:
        res["ar"] = measure_ar_overhead(ar_tokens, repeats=repeats)
    if memory:
        res["memory"] = measure_memory(spiffy_budget, budgets)
    res["memory_methods"] = MEMORY_METHODS
    res["load_average_after"] = _load_average()
    res["seconds"] = time.time() - started
    atomic_write_json(out_dir / "results.json", res)
    atomic_write_text(out_dir / "results.md", markdown_overheads(res))
    if plots:
        res["plot"] = _plot(res, out_dir / "overheads.png")
    return res
