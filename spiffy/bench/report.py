"""Benchmark reports: ``results.json``, ``results.md`` (Markdown tables) and PNG plots, all written atomically.

Every ratio in a table carries its 95% interval over prompts in brackets, followed by ``n.s.`` when the interval
includes 1.0 (the run cannot tell the two sides apart).

Plots (matplotlib, Agg backend): ``tradeoff.png`` (dLLM: NFE reduction and speedup vs budget, FreeDave's and SSD's NFE
reduction at the same states per forward; AR: τ and speedup vs DDTree budget, with DFlash as a reference line; error
bars and bands: the 95% intervals over prompts of :mod:`spiffy.bench.stats`) and ``acceptance_histogram.png``
(dLLM: accepted drafts per verification forward per budget; AR: acceptance length per round per method).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from spiffy.arspec.methods import DEFAULT_ACCEPT, DFLASH_DRAFTER, REGISTRY, get_method
from spiffy.errors import ConfigError
from spiffy.io import atomic_write_with
from spiffy.selfspec.rivals import RIVALS


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    p = Path(path)

    def _w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    atomic_write_with(p, _w)  # spiffy.io: the file gets the umask's mode, not the temporary file's 0600
    return p


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """JSON-serialise ``obj`` (indent 2) to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


#: appended to a ratio whose interval includes 1.0
NOT_CLEAR = "n.s."


def _ratio(value: Any, interval: dict[str, Any] | None, digits: int = 2, unit: str = "x", flag: bool = True) -> str:
    """``2.19x [2.05, 2.31]`` (the figure and its 95% interval), ``n.s.`` appended when the interval includes 1.0
    (``flag``); the figure alone when there is no interval (one prompt, or a results file without intervals)."""
    if value is None:
        return "n/a"
    text = f"{_f(value, digits)}{unit}"
    if interval:
        text += f" [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"
        if flag and interval.get("includes_one"):
            text += f" {NOT_CLEAR}"
    return text


def _interval(entry: dict[str, Any], name: str) -> dict[str, Any] | None:
    return (entry.get("intervals") or {}).get(name)


def _interval_legend(res: dict[str, Any]) -> list[str]:
    """The line under a table saying what the brackets are (nothing for results without intervals)."""
    if not res.get("intervals"):
        return []
    return ["", f"Brackets: {res['intervals']}. {NOT_CLEAR}: the interval includes 1.0, so this run cannot tell "
                "the two sides apart."]


def _error_bars(entries: list[dict[str, Any]], name: str) -> list[list[float]]:
    """``[[below...], [above...]]`` of figure ``name`` for matplotlib's ``yerr`` (0 where there is no interval)."""
    below, above = [], []
    for e in entries:
        iv, v = _interval(e, name), e.get(name) or 0.0
        below.append(max(0.0, v - iv["low"]) if iv else 0.0)
        above.append(max(0.0, iv["high"] - v) if iv else 0.0)
    return [below, above]


def _hist_str(h: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in h.items() if v) or "-"


def _env_lines(env: dict[str, Any]) -> list[str]:
    return [
        f"- spiffy {env.get('spiffy_version')}, torch {env.get('torch_version')}, transformers "
        f"{env.get('transformers_version')}, Python {env.get('python_version')}",
        f"- device: {env.get('device_name') or env.get('device')}, dtype: {env.get('dtype')}, "
        f"torch threads: {env.get('torch_threads')}",
        *_memory_lines(env),
    ]


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _memory_lines(env: dict[str, Any]) -> list[str]:
    """The quantization and memory line of a report header (absent from reports written before they were recorded)."""
    if "quantization" not in env:
        return []
    drafter = f" (drafter: {env['drafter_quantization']})" if env.get("drafter_quantization") else ""
    return [f"- quantization: {env.get('quantization')}{drafter}; weights {_mib(env.get('weight_bytes'))} as "
            f"stored; peak memory {_mib(env.get('peak_memory_bytes'))} ({env.get('peak_memory_method')})"]


def divergence_verdict(entry: dict[str, Any]) -> str:
    """``""`` when every output of a method row equals its baseline; ``"near tie"`` when each divergence was proven
    a rounding-level near tie (:mod:`spiffy.bench.fidelity`); ``"MISMATCH"`` otherwise."""
    if entry["identical_fraction"] >= 1.0:
        return ""
    mism = entry.get("mismatches") or []
    return "near tie" if mism and all(m.get("near_tie") is True for m in mism) else "MISMATCH"


def _identical_cell(entry: dict[str, Any], num_prompts: Any) -> str:
    ident = f"{entry['identical']}/{num_prompts} ({100 * entry['identical_fraction']:.0f}%)"
    verdict = divergence_verdict(entry)
    return f"**{verdict}** {ident}" if verdict == "MISMATCH" else (f"{ident}, {verdict}" if verdict else ident)


def _gap_note(m: dict[str, Any]) -> str:
    """What the near-tie proof (:mod:`spiffy.bench.fidelity`) found about a mismatch: the flipped choice's margin
    against its rounding bound, how far apart the two runs' logits were, and the verdict (with the reason when the
    divergence is not proven); ``""`` for a mismatch without a proof."""
    if "near_tie" not in m:
        return ""
    parts = []
    if m.get("gap") is not None:
        kind = f"{m['kind']} " if m.get("kind") else ""
        parts.append(f"{kind}margin {m['gap']:.4g} (rounding bound {m['bound']:.4g} in {m.get('dtype')})")
    if m.get("deviation_ulps") is not None:
        parts.append(f"logits {m['deviation_ulps']:.3g} ulps apart")
    verdict = "near tie (numerics)" if m.get("near_tie") else f"NOT a near tie (a bug): {m.get('reason') or 'unproven'}"
    return ", " + ", ".join(parts + [verdict])


def _tail_sections(
    lines: list[str], entries: list[dict[str, Any]], res: dict[str, Any], header: str, key: str,
    mismatch_title: str, mismatch_label: Callable[[dict[str, Any]], str],
) -> str:
    """Append the per-stage times (column ``header``, rows ``entry[key]``), the mismatch list and the skipped
    prompts to ``lines``; return the finished Markdown text."""
    stages = sorted({k for e in entries for k in e["stage_times"]})
    if stages:
        lines += ["", "## Per-stage times (seconds, all prompts)", "",
                  f"| {header} | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
        for e in entries:
            lines.append(f"| {e[key]} | " + " | ".join(_f(e["stage_times"].get(s, 0.0), 3) for s in stages) + " |")
    mism = [(mismatch_label(e), m) for e in entries for m in e["mismatches"]]
    if mism:
        lines += ["", f"## {mismatch_title}", ""]
        lines += [f"- {n}: prompt {m['id']}, first differing position {m['first_mismatch']}{_gap_note(m)}" for n, m in mism]
        if res.get("near_tie_rule"):
            lines += ["", f"Near-tie rule ({res.get('dtype')}): {res['near_tie_rule']}."]
    if res.get("skipped_prompts"):
        lines += ["", f"Skipped prompts (too long): {', '.join(s['id'] for s in res['skipped_prompts'])}"]
    return "\n".join(lines) + "\n"


def markdown_dllm(res: dict[str, Any]) -> str:
    """Markdown report of a ``bench dllm`` results dict."""
    dec = res.get("decoding", {})
    b = res["baseline"]
    g = res.get("graph", {})
    lines = [
        "# spiffy bench dllm",
        "",
        f"- model: `{res.get('model')}` ({res.get('family')})",
        f"- dataset: {res.get('dataset')}, prompts: {res.get('num_prompts')}, chat template: {res.get('chat')}",
        f"- decoding: gen_length {dec.get('gen_length')}, block_length {dec.get('block_length_resolved', dec.get('block_length'))}, "
        f"steps {dec.get('steps_resolved', dec.get('steps'))}, threshold {dec.get('threshold')}, remasking {dec.get('remasking')}, cache "
        f"{dec.get('cache')}, temperature {dec.get('temperature')}",
        f"- graph: `{g.get('path')}` ({g.get('nodes')} nodes, calibrated on {g.get('calibration_dataset')}; "
        f"projected NFE reduction {_f(g.get('projected', {}).get('reduction'))}x)",
        f"- tokens = {res.get('token_unit')}",
        f"- timing: {res.get('timing')}",
        *_env_lines(res.get("environment", {})),
        "",
        "| method | budget | NFE/token | NFE reduction | tokens/s | speedup "
        + "".join(f"| vs {rival.label} at equal states (NFE; speedup) " for rival in RIVALS.values())
        + "| accepted/forward | identical | distinct-token ratio | whitespace share |",
        "|---|---|---|---|---|---|" + "---|" * len(RIVALS) + "---|---|---|---|",
        f"| baseline | - | {_f(b['nfe_per_token'], 3)} | 1.00x | {_f(b['tokens_per_s'])} | 1.00x | "
        + "- | " * len(RIVALS) + "- | - | "
        f"{_f(b['degenerate']['distinct_token_ratio'], 3)} | {_f(b['degenerate']['whitespace_share'], 3)} |",
    ]
    for r in res["runs"]:
        ident = _identical_cell(r, res["num_prompts"])
        rivals = " | ".join(_versus(r, name) for name in RIVALS)
        lines.append(
            f"| {_method_label(r)} | {r['budget']} | {_f(r['nfe_per_token'], 3)} | "
            f"{_ratio(r['nfe_reduction'], _interval(r, 'nfe_reduction'))} | {_f(r['tokens_per_s'])} | "
            f"{_ratio(r['speedup'], _interval(r, 'speedup'))} | {rivals} | {_f(r['mean_accepted_per_forward'])} | "
            f"{ident} | {_f(r['degenerate']['distinct_token_ratio'], 3)} | "
            f"{_f(r['degenerate']['whitespace_share'], 3)} |"
        )
    lines += _interval_legend(res)
    lines += ["", "## Acceptance", "", "| run | accepted drafts per forward (histogram) | accepted per level | per-level rate |",
              "|---|---|---|---|"]
    for r in res["runs"]:
        rates = " ".join(f"{k}:{v:.2f}" for k, v in r["acceptance_rate_per_level"].items()) or "-"
        lines.append(f"| {_run_label(r)} | {_hist_str(r['acceptance_histogram'])} | {_hist_str(r['accepted_per_level'])} | {rates} |")
    text = _tail_sections(
        lines, [dict(r, run=_run_label(r)) for r in res["runs"]], res, "run", "run",
        "Mismatches (speculative output differs from the baseline)", lambda r: r["run"],
    )
    companion = res.get("companion")
    if companion:  # the second regime (``--also-threshold``): its own report, one heading level down
        body = markdown_dllm(companion).split("\n", 1)[1]
        threshold = companion.get("decoding", {}).get("threshold")
        text += (f"\n## Spiffy on top of threshold {threshold} decoding (same prompts, its own baseline)\n"
                 + body.replace("\n## ", "\n### "))
    return text


def _versus(run: dict[str, Any], rival: str) -> str:
    """``NFE ratio [interval]; speedup ratio [interval]`` of a Spiffy row against ``rival``'s row of its width."""
    if not (run.get("rivals") or {}).get(rival) and not (rival == "freedave" and run.get("rival")):  # older files
        return "-"
    nfe, speed = f"nfe_reduction_vs_{rival}", f"speedup_vs_{rival}"
    return f"{_ratio(run.get(nfe), _interval(run, nfe))}; {_ratio(run.get(speed), _interval(run, speed))}"


def _method_label(run: dict[str, Any]) -> str:
    """``spiffy``, or ``freedave K`` / ``ssd K`` (K states per forward) for a rival's comparison row."""
    method = str(run.get("method", "spiffy"))
    if method != "spiffy":
        return f"{method} {run.get('states_per_forward', run['budget'] + 1)}"
    return method


def _run_label(run: dict[str, Any]) -> str:
    """``D*=3`` for a Spiffy row, ``freedave 4 (D*=3)`` / ``ssd 4 (D*=3)`` for a rival's."""
    if run.get("method", "spiffy") != "spiffy":
        return f"{_method_label(run)} (D*={run['budget']})"
    return f"D*={run['budget']}"


def markdown_ar(res: dict[str, Any]) -> str:
    """Markdown report of a ``bench ar`` results dict."""
    dec = res.get("decoding", {})
    lines = [
        "# spiffy bench ar",
        "",
        f"- target: `{res.get('target')}`, drafter: `{res.get('drafter')}`",
        f"- dataset: {res.get('dataset')}, prompts: {res.get('num_prompts')}, chat template: {res.get('chat')}",
        f"- decoding: max_new_tokens {dec.get('max_new_tokens')}, temperature {dec.get('temperature')}, top_p "
        f"{dec.get('top_p')}, top_k {dec.get('top_k')}, seed {dec.get('seed')}",
        f"- {res.get('tau_definition')}",
        f"- timing: {res.get('timing')}",
        *_env_lines(res.get("environment", {})),
        "",
        "| method | budget | tau | tau vs DFlash | TPOT (ms) | tokens/s | speedup vs AR | speedup vs DFlash "
        "| identical | distinct-token ratio | whitespace share | drafter | rule | K | target NFE/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in res["methods"]:
        ident = _identical_cell(m, res["num_prompts"])
        if not m.get("identical_expected", True):  # rejection rule at T > 0: equal to AR in distribution only
            ident = f"{m['identical']}/{res['num_prompts']} (in distribution)"
        tau_vs_dflash = "-"
        if m.get("tau_vs_dflash") is not None:
            tau_vs_dflash = _ratio(m["tau_vs_dflash"], _interval(m, "tau_vs_dflash"))
        lines.append(
            f"| {m['method']} | {m['budget']} | {_ratio(m['tau'], _interval(m, 'tau'), unit='', flag=False)} | "
            f"{tau_vs_dflash} | {_f(1000 * m['tpot_s'])} | {_f(m['tokens_per_s'])} | "
            f"{_ratio(m['speedup_vs_ar'], _interval(m, 'speedup_vs_ar'))} | "
            f"{_ratio(m['speedup_vs_dflash'], _interval(m, 'speedup_vs_dflash'))} | {ident} | "
            f"{_f(m['degenerate']['distinct_token_ratio'], 3)} | {_f(m['degenerate']['whitespace_share'], 3)} | "
            f"{m.get('drafter_kind', '')} | {m.get('accept', DEFAULT_ACCEPT)} | {m.get('drafts', '') if get_method(m['method']).size_knob == 'drafts' else ''} | "
            f"{_f(m.get('nfe_per_token'))} |"
        )
    lines += _interval_legend(res)
    lines += ["", "## Acceptance length per round (histogram, bonus included)", "", "| method | histogram |", "|---|---|"]
    for m in res["methods"]:
        lines.append(f"| {m['name']} | {_hist_str(m['acceptance_histogram'])} |")
    return _tail_sections(
        lines, res["methods"], res, "method", "name", "Mismatches (output differs from AR)", lambda m: str(m["name"])
    )


def markdown_report(res: dict[str, Any]) -> str:
    """The Markdown report of a results dict of either kind."""
    if res.get("kind") == "dllm":
        return markdown_dllm(res)
    if res.get("kind") == "ar":
        return markdown_ar(res)
    raise ConfigError(f"unknown results kind {res.get('kind')!r}; expected 'dllm' or 'ar'")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(f"PNG plots need matplotlib ({exc}); fix: pip install matplotlib (extra 'plot')") from exc
    return plt


def _save_fig(fig: Any, path: Path) -> Path:
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    return path


def plot_dllm(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """``tradeoff.png`` and ``acceptance_histogram.png`` of a dLLM results dict."""
    plt = _pyplot()
    runs = [r for r in res["runs"] if r.get("method", "spiffy") == "spiffy"]  # rival rows: their own series
    # rivals with K states per forward verify K - 1 drafts per call: plotted at Spiffy's D = K - 1
    rivals = {m: sorted((r for r in res["runs"] if r.get("method") == m), key=lambda r: r["budget"]) for m in RIVALS}
    budgets = [r["budget"] for r in runs]
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(6, 4))
    # error bars: the 95% intervals over prompts (none in results written before they were reported)
    ax.errorbar(budgets, [r["nfe_reduction"] or 0 for r in runs], yerr=_error_bars(runs, "nfe_reduction"),
                fmt="o-", capsize=3, label="Spiffy NFE reduction")
    ax.errorbar(budgets, [r["speedup"] or 0 for r in runs], yerr=_error_bars(runs, "speedup"), fmt="s--",
                capsize=3, label="Spiffy wall-clock speedup")
    for (name, rows), marks, shift in zip(rivals.items(), (("^-", "v--"), ("<-", ">--")), (0.08, 0.16)):
        if rows:
            xs = [r["budget"] + shift for r in rows]  # beside Spiffy's point at the same states per forward
            label = RIVALS[name].label
            ax.errorbar(xs, [r["nfe_reduction"] or 0 for r in rows], yerr=_error_bars(rows, "nfe_reduction"),
                        fmt=marks[0], capsize=3, label=f"{label} NFE reduction")
            ax.errorbar(xs, [r["speedup"] or 0 for r in rows], yerr=_error_bars(rows, "speedup"), fmt=marks[1],
                        capsize=3, label=f"{label} wall-clock speedup")
    ax.axhline(1.0, color="grey", lw=0.8, label="baseline")
    _integer_ticks(ax, sorted({int(r["budget"]) for r in res["runs"]}))
    ax.set_xlabel("draft budget D (drafts verified per model call)")
    ax.set_ylabel("x over baseline (bars: 95% interval over prompts)")
    ax.set_title(f"Spiffy budget trade-off ({res.get('dataset')}, {res.get('num_prompts')} prompts)")
    ax.legend()
    try:
        paths.append(_save_fig(fig, out_dir / "tradeoff.png"))
    finally:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({int(k) for r in runs for k in r["acceptance_histogram"]} | {0})
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        total = sum(r["acceptance_histogram"].values()) or 1
        ax.bar([k + i * width for k in keys], [r["acceptance_histogram"].get(str(k), 0) / total for k in keys],
               width=width, label=f"D*={r['budget']}")
    _integer_ticks(ax, keys, offset=(len(runs) - 1) * width / 2)
    ax.set_xlabel("accepted drafts per verification forward")
    ax.set_ylabel("fraction of forwards")
    ax.set_title("Spiffy acceptance histogram")
    ax.legend()
    try:
        paths.append(_save_fig(fig, out_dir / "acceptance_histogram.png"))
    finally:
        plt.close(fig)
    return paths


def _integer_ticks(ax: Any, values: list[int], offset: float = 0.0) -> None:
    """Ticks at the integer ``values`` only (shifted by ``offset``: the centre of a group of side-by-side bars),
    labelled as integers (no 0.5 / 1.25 ticks, no 2^4 labels)."""
    if ax.get_xscale() == "log":  # keep labels apart: on a log axis 15 and 16 would print on top of each other
        kept: list[int] = []
        for v in sorted(values):
            if not kept or v >= kept[-1] * 1.25:
                kept.append(v)
        values = kept
    ax.set_xticks([v + offset for v in values])
    ax.set_xticklabels([str(int(v)) for v in values])
    ax.minorticks_off()


def _series_label(m: dict[str, Any]) -> str:
    """How a method row is named in a plot: method, drafter kind, and the rule when it is not the coupled one."""
    spec = get_method(m["method"])
    label = spec.label
    shared = sum(other.label == spec.label for other in REGISTRY.values()) > 1  # DDTree over either drafter kind
    if shared and spec.drafter is not None and spec.drafter is not DFLASH_DRAFTER:
        label += f" ({spec.drafter.label} drafter)"
    if m.get("accept", DEFAULT_ACCEPT) != DEFAULT_ACCEPT:
        label += f", {m['accept']}"
    return label


def tradeoff_series(methods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The series of the AR trade-off plot: one per method, drafter kind and acceptance rule (every row of the table
    but plain AR, which is the reference line), its points the budgets measured, in budget order."""
    series: dict[str, list[dict[str, Any]]] = {}
    for m in methods:
        if get_method(m["method"]).needs_drafter:  # plain AR is the reference line
            series.setdefault(_series_label(m), []).append(m)
    return {label: sorted(rows, key=lambda m: m["budget"]) for label, rows in series.items()}


def plot_ar(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """``tradeoff.png`` and ``acceptance_histogram.png`` of an AR results dict."""
    plt = _pyplot()
    methods = res["methods"]
    paths: list[Path] = []
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (label, rows) in enumerate(tradeoff_series(methods).items()):
        style = dict(marker="os^vDP*Xhp<>"[k % 12], ls="-" if len(rows) > 1 else "none", label=label)
        xs = [m["budget"] for m in rows]
        ax_tau.errorbar(xs, [m["tau"] for m in rows], yerr=_error_bars(rows, "tau"), capsize=3, **style)
        ax_speed.errorbar(xs, [m["speedup_vs_ar"] or 0 for m in rows], yerr=_error_bars(rows, "speedup_vs_ar"),
                          capsize=3, **style)
    ax_tau.axhline(1.0, color="grey", lw=0.8, label="AR (tau 1)")
    ax_speed.axhline(1.0, color="grey", lw=0.8, label="AR (1x)")
    budgets = sorted({int(m["budget"]) for m in methods if get_method(m["method"]).needs_drafter and m["budget"] > 0})
    for ax, ylabel in ((ax_tau, "tau (tokens per target forward)"), (ax_speed, "speedup vs AR")):
        ax.set_xscale("log", base=2)
        if budgets:
            _integer_ticks(ax, budgets)
        ax.set_xlabel("draft nodes verified per round (tree budget; chain length x drafts)")
        ax.set_ylabel(ylabel + " (bars: 95% intervals)")
    ax_speed.legend(fontsize=7, loc="best")
    fig.suptitle(f"Speculative methods vs plain AR ({res.get('dataset')}, {res.get('num_prompts')} prompts)")
    try:
        paths.append(_save_fig(fig, out_dir / "tradeoff.png"))
    finally:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    shown = [m for m in methods if get_method(m["method"]).needs_drafter]
    keys = sorted({int(k) for m in shown for k in m["acceptance_histogram"]} | {1})
    width = 0.8 / max(1, len(shown))
    for i, m in enumerate(shown):
        total = sum(m["acceptance_histogram"].values()) or 1
        ax.bar([k + i * width for k in keys], [m["acceptance_histogram"].get(str(k), 0) / total for k in keys],
               width=width, label=m["name"])
    _integer_ticks(ax, keys, offset=(len(shown) - 1) * width / 2)
    ax.set_xlabel("acceptance length per round (bonus included)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance-length histogram")
    ax.legend(fontsize=8)
    try:
        paths.append(_save_fig(fig, out_dir / "acceptance_histogram.png"))
    finally:
        plt.close(fig)
    return paths


def write_report(res: dict[str, Any], out_dir: str | os.PathLike[str], *, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and (``plots``) the PNGs into ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if plots:
        made = plot_dllm(res, out) if res.get("kind") == "dllm" else plot_ar(res, out)
        res = dict(res, plots=[p.name for p in made])
        written.update({p.stem: p for p in made})
    written["markdown"] = write_text_atomic(out / "results.md", markdown_report(res))
    written["json"] = write_json_atomic(out / "results.json", res)
    return written


__all__ = [
    "divergence_verdict",
    "markdown_ar",
    "markdown_dllm",
    "markdown_report",
    "plot_ar",
    "plot_dllm",
    "tradeoff_series",
    "write_json_atomic",
    "write_report",
    "write_text_atomic",
]
