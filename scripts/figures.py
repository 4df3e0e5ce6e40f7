#!/usr/bin/env python3
"""Every figure of the README and docs/RESULTS.md, from the commands shown beside it, in one script.

Each figure is one `spiffy bench ...` command (:data:`FIGURES`). Running this script runs the commands (one after the
other, in this process's environment), keeps each command's ``results.json`` as ``docs/figures/<id>.json`` (with the
command, the date and the machine's load average before and after), and rewrites every marked block of the documents
from those files:

    <!-- figure: ID[:TABLE] -->          the TABLE-th Markdown table (0-based) of the command's own report
    | ... |                              (`spiffy.bench.report.markdown_report` / `markdown_overheads`)
    <!-- /figure -->

    <!-- figure: headline -->            the README's headline table, built by :func:`headline_table`
    <!-- /figure -->

`tests/test_figures.py` renders every block again from the committed ``docs/figures/*.json`` with the current report
code and compares it with the documents: a renamed or added column, or a figure edited by hand, fails the suite until
this script is run again. Usage::

    python scripts/figures.py                   # every figure (about 15 minutes on two cores at load 2)
    python scripts/figures.py --only ar,overheads
    python scripts/figures.py --render-only     # rewrite the documents from docs/figures/*.json, run nothing

Run it on a quiet machine: the load average before and after each command is recorded and printed in the docs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
FIGURE_DIR = ROOT / "docs" / "figures"
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "RESULTS.md")
BLOCK = re.compile(r"<!-- figure: (?P<id>[\w.-]+)(?::(?P<table>\d+))? -->\n(?P<body>.*?)<!-- /figure -->", re.S)


@dataclass(frozen=True)
class Figure:
    """One measurement: the ``spiffy`` command line (without ``--out``) and what it reports."""

    id: str
    argv: tuple[str, ...]
    summary: str

    @property
    def command(self) -> str:
        """The command as the documents show it (``--out`` names the run directory)."""
        return " ".join(("spiffy", *self.argv, "--out", f"runs/{self.id}"))


#: every figure the documents show, in the order the script runs them
FIGURES: dict[str, Figure] = {f.id: f for f in (
    Figure("dllm", ("bench", "dllm", "--dataset", "humaneval"),
           "the demo dLLM with every default: its shipped graph's configuration, Spiffy D* = 1..5, FreeDave and SSD, "
           "and Spiffy on top of threshold 0.9 decoding"),
    Figure("dllm-rivals", ("bench", "dllm", "--dataset", "humaneval", "--max-prompts", "50", "--budgets", "1,2,3,4,5",
                           "--freedave", "2,3,4,5,6", "--ssd", "2,3,4,5,6", "--also-threshold", "none"),
           "Spiffy against FreeDave and SSD at every width from 2 to 6 states per forward, on 50 held-out prompts "
           "(enough to separate a few per cent)"),
    Figure("ar", ("bench", "ar", "--dataset", "humaneval", "--budgets", "16,32,64,128,256", "--max-prompts", "10",
                  "--max-new-tokens", "64", "--no-chat", "--methods", "ar,dflash,ddtree"),
           "plain AR, the DFlash chain and DDTree on the 4M-parameter demo pair"),
    Figure("ar-small", ("bench", "ar", "--target", "small-qwen3", "--drafter", "small-qwen3-dflash-b16", "--dataset",
                        "humaneval", "--budgets", "8,16,32", "--max-prompts", "10", "--max-new-tokens", "128",
                        "--no-chat", "--methods", "ar,dflash,ddtree"),
           "the wall-clock pair: a 12M-parameter target with a drafter a tenth of its size"),
    Figure("ar-small-2t", ("bench", "ar", "--target", "small-qwen3", "--drafter", "small-qwen3-dflash-b16", "--dataset",
                           "humaneval", "--budgets", "8,16,32", "--max-prompts", "10", "--max-new-tokens", "128",
                           "--no-chat", "--methods", "ar,dflash,ddtree", "--threads", "2"),
           "the wall-clock pair with both cores of the machine (the default for a model this small is one thread)"),
    Figure("ar-bf16", ("bench", "ar", "--dtype", "bfloat16", "--budgets", "16,32", "--max-prompts", "20",
                       "--max-new-tokens", "64", "--methods", "ar,dflash,ddtree"),
           "identical outputs in bfloat16 (divergences proven near ties)"),
    Figure("dllm-bf16", ("bench", "dllm", "--dtype", "bfloat16", "--graph", "tiny-sdar-s1", "--no-chat",
                         "--budgets", "1,3,5", "--max-prompts", "8", "--freedave", "none", "--ssd", "none"),
           "Spiffy identical to its baseline in bfloat16"),
    Figure("overheads", ("bench", "overheads", "--repeats", "7", "--threads", "1"),
           "non-forward costs against the reference DDTree builder at V = 4,096 and 151,936"),
)}


def load_figure(fig_id: str, directory: Path = FIGURE_DIR) -> dict[str, Any]:
    """The committed record of one figure: ``{"id", "command", "date", "load_average_before", ..., "results"}``."""
    path = directory / f"{fig_id}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; fix: run `python scripts/figures.py --only {fig_id}`")
    return json.loads(path.read_text())


def report_markdown(results: dict[str, Any]) -> str:
    """The command's own Markdown report of ``results`` (the same function that wrote its ``results.md``)."""
    if results.get("kind") in ("dllm", "ar"):
        from spiffy.bench.report import markdown_report
        return markdown_report(results)
    from spiffy.bench.overheads import markdown_overheads
    return markdown_overheads(results)


def markdown_tables(text: str) -> list[str]:
    """The Markdown tables of ``text`` in order, each as its lines joined (header, rule, rows)."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    if current:
        tables.append("\n".join(current))
    return tables


def _load_note(record: dict[str, Any]) -> str:
    before, after = record.get("load_average_before"), record.get("load_average_after")
    return f"load average {before[0] if before else '?'} -> {after[0] if after else '?'}"


def table_block(record: dict[str, Any], table: int) -> str:
    """A figure block: the command, when and under what load it ran, then table ``table`` of its report."""
    tables = markdown_tables(report_markdown(record["results"]))
    if not 0 <= table < len(tables):
        raise IndexError(f"figure {record['id']!r} has {len(tables)} tables, no table {table}")
    return (f"`{record['command']}` ({record['date']}, {record['machine']}, {_load_note(record)}):\n\n"
            f"{tables[table]}\n")


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    raise KeyError(f"no row with {match}")


def _ratio(row: dict[str, Any], key: str) -> str:
    value = row[key]
    ci = (row.get("intervals") or {}).get(key)
    interval = f" [{ci['low']:.2f}, {ci['high']:.2f}]" if ci else ""
    undecided = " n.s." if ci and ci["low"] <= 1.0 <= ci["high"] else ""  # the run cannot tell the two sides apart
    return f"{value:.2f}x{interval}{undecided}"


def headline_table(records: dict[str, dict[str, Any]]) -> str:
    """The README's headline table, each cell read from a figure's ``results`` (see :data:`HEADLINE_FIGURES`)."""
    dllm, ar = (records[k]["results"] for k in HEADLINE_FIGURES[:2])
    t09 = dllm["companion"]  # the default run's second regime (bench dllm --also-threshold, default 0.9)
    spiffy5 = _find(dllm["runs"], method="spiffy", budget=5)
    rivals = [r for r in dllm["runs"] if r.get("method") != "spiffy" and r["budget"] == 5]
    rival_cells = "; ".join(f"{r['method']} {_ratio(r, 'nfe_reduction')}" for r in rivals) or "-"
    t09_cells = " / ".join(_ratio(r, "nfe_reduction") for r in t09["runs"] if r.get("method", "spiffy") == "spiffy")
    t09_budgets = " / ".join(str(r["budget"]) for r in t09["runs"] if r.get("method", "spiffy") == "spiffy")
    dd = [m for m in ar["methods"] if m["method"] == "ddtree"]
    taus = [m["tau_vs_dflash"] for m in dd]
    best = max(dd, key=lambda m: m["speedup_vs_dflash"])
    rows = [
        ("| what | figure | command |", None),
        ("|---|---|---|", None),
        (f"| Spiffy on {Path(dllm['model']).name}, D* = 5 drafts per step, every default ({dllm['dtype']}, "
         f"prompt format {'chat' if dllm['chat'] else 'raw'}) | **{_ratio(spiffy5, 'nfe_reduction')}** fewer forwards; "
         f"at the same states per forward {rival_cells}; distinct-token ratio "
         f"{spiffy5['degenerate']['distinct_token_ratio']:.3f}; identical {spiffy5['identical']}/{dllm['num_prompts']} |", "dllm"),
        (f"| Spiffy on top of threshold {t09['decoding']['threshold']} decoding (the same command's second table) | "
         f"{t09_cells} fewer forwards at D* = {t09_budgets} |", "dllm"),
        (f"| DDTree vs the DFlash chain (4M demo pair, greedy) | τ {min(taus):.2f}x-{max(taus):.2f}x DFlash's at budgets "
         f"{dd[0]['budget']}-{dd[-1]['budget']}; wall-clock {_ratio(best, 'speedup_vs_dflash')} at budget {best['budget']} |", "ar"),
    ]
    lines = [text if fig is None else f"{text[:-2]} | `{records[fig]['command']}` |" for text, fig in rows]
    pairs = [small_pair_row(records, "ar-small", "1 thread, the default"),
             small_pair_row(records, "ar-small-2t", "both cores")]
    return "\n".join([*lines[:4], rivals_row(records), *lines[4:], *pairs]) + "\n"


def rivals_row(records: dict[str, dict[str, Any]]) -> str:
    """A headline row: Spiffy's forwards against FreeDave's and SSD's at every width of the ``dllm-rivals`` run."""
    res = records["dllm-rivals"]["results"]
    runs = [r for r in res["runs"] if r.get("method") == "spiffy"]
    widths = " / ".join(str(r["states_per_forward"]) for r in runs)
    vs = {rival: " / ".join(_ratio(r, f"nfe_reduction_vs_{rival}") for r in runs) for rival in ("freedave", "ssd")}
    cells = (f"FreeDave and SSD (the same drafts here) {vs['freedave']}" if vs["freedave"] == vs["ssd"]
             else f"FreeDave {vs['freedave']}; SSD {vs['ssd']}")
    return (f"| Spiffy against FreeDave and SSD at equal states per forward ({Path(res['model']).name}, "
            f"{res['num_prompts']} held-out prompts, every other setting the default) | their forwards over Spiffy's at "
            f"{widths} states: {cells} | `{records['dllm-rivals']['command']}` |")


def _speculative_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a results dict that must equal their baseline (every method but plain AR)."""
    rows = res["methods"] if res["kind"] == "ar" else res["runs"]
    return [r for r in rows if r.get("method") != "ar"]


def _fidelity_cell(record: dict[str, Any]) -> str:
    """``I/N identical (...)`` over a run's speculative rows, and how each divergence was judged."""
    res = record["results"]
    rows = _speculative_rows(res)
    n = res["num_prompts"] * len(rows)
    same = sum(r["identical"] for r in rows)
    verdicts = [m.get("near_tie") for r in rows for m in r.get("mismatches") or []]
    what = ", ".join(r.get("name") or f"D*={r['budget']}" for r in rows)
    cell = f"{same}/{n} identical ({res['num_prompts']} prompts x {what})"
    if same < n:
        near = sum(v is True for v in verdicts)
        cell += (f"; all {n - same} divergences are near ties" if near == n - same
                 else f"; **{n - same - near} divergence(s) not explained by a near tie**")
    return cell


def dtype_table(records: dict[str, dict[str, Any]]) -> str:
    """The README's "speculative == baseline" table: float64/32 from the tests, half precision from the figures."""
    return "\n".join([
        "| path | float64 / float32 | bfloat16 (shipped models, HumanEval) |",
        "|---|---|---|",
        f"| Spiffy (LLaDA, Dream: no cache, prefix, dual; SDAR; Fast-dLLM v2; LLaDA2.0) | bitwise identical (tests) | "
        f"{_fidelity_cell(records['dllm-bf16'])} |",
        f"| DFlash / DDTree vs AR (greedy) | bitwise identical (tests) | {_fidelity_cell(records['ar-bf16'])} |",
    ]) + "\n"


def small_pair_row(records: dict[str, dict[str, Any]], fig_id: str, threads: str) -> str:
    """A headline row of the wall-clock pair: DDTree's best budget against AR and against the DFlash chain."""
    res = records[fig_id]["results"]
    dd = [m for m in res["methods"] if m["method"] == "ddtree"]
    best = max(dd, key=lambda m: m["speedup_vs_ar"])
    dflash = _find(res["methods"], method="dflash")
    return (f"| DDTree on the wall-clock pair (12M target, drafter a tenth of it; CPU, {threads}, greedy) | "
            f"{_ratio(best, 'speedup_vs_ar')} plain AR's tokens/s at budget {best['budget']}, "
            f"{_ratio(best, 'speedup_vs_dflash')} the DFlash chain's (DFlash {_ratio(dflash, 'speedup_vs_ar')} AR); "
            f"τ {best['tau']:.2f} | `{records[fig_id]['command']}` |")


#: figures the headline table reads
HEADLINE_FIGURES = ("dllm", "ar", "ar-small", "ar-small-2t", "dllm-rivals")

#: block renderers other than "table k of a figure"
SPECIAL_BLOCKS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, dict[str, Any]]], str]]] = {
    "headline": (HEADLINE_FIGURES, headline_table),
    "dtype": (("dllm-bf16", "ar-bf16"), dtype_table),
}


def render_block(block_id: str, table: int | None, directory: Path = FIGURE_DIR) -> str:
    """The text a marked block must hold, from the committed figure records in ``directory``."""
    if block_id in SPECIAL_BLOCKS:
        needs, render = SPECIAL_BLOCKS[block_id]
        return render({k: load_figure(k, directory) for k in needs})
    return table_block(load_figure(block_id, directory), table or 0)


def render_documents(directory: Path = FIGURE_DIR, documents: tuple[Path, ...] = DOCUMENTS) -> list[Path]:
    """Rewrite every marked block of ``documents`` from the records; returns the files that changed."""
    changed = []
    for doc in documents:
        text = doc.read_text()
        new = BLOCK.sub(lambda m: (f"<!-- figure: {m['id']}{':' + m['table'] if m['table'] else ''} -->\n"
                                   f"{render_block(m['id'], int(m['table']) if m['table'] else None, directory)}"
                                   "<!-- /figure -->"), text)
        if new != text:
            _write_atomic(doc, new)
            changed.append(doc)
    return changed


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _machine() -> str:
    cores = os.cpu_count()
    return f"{cores}-core {os.uname().machine} CPU"


def run_figure(fig: Figure, runs: Path, directory: Path = FIGURE_DIR) -> dict[str, Any]:
    """Run one figure's command (``spiffy`` of this interpreter) and keep its record as ``directory/<id>.json``."""
    out = runs / fig.id
    before = [round(v, 2) for v in os.getloadavg()]
    started = _dt.datetime.now(_dt.timezone.utc)
    proc = subprocess.run([sys.executable, "-m", "spiffy", *fig.argv, "--out", str(out)], cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"figure {fig.id!r}: `{fig.command}` exited {proc.returncode}")
    record = {"id": fig.id, "command": fig.command, "summary": fig.summary, "date": started.strftime("%Y-%m-%d"),
              "machine": _machine(), "load_average_before": before,
              "load_average_after": [round(v, 2) for v in os.getloadavg()],
              "seconds": round((_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(), 1),
              "results": json.loads((out / "results.json").read_text())}
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / f"{fig.id}.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help=f"comma-separated figure ids (default all: {', '.join(FIGURES)})")
    p.add_argument("--runs", default=str(ROOT / "runs" / "figures"), help="where the commands write their outputs")
    p.add_argument("--render-only", action="store_true", help="rewrite the documents from docs/figures, run nothing")
    p.add_argument("--no-render", action="store_true", help="run the commands and keep their records, leave the documents")
    args = p.parse_args(argv)
    ids = [s for s in (args.only or ",".join(FIGURES)).split(",") if s]
    unknown = [i for i in ids if i not in FIGURES]
    if unknown:
        p.error(f"unknown figure ids {unknown}; choose from {', '.join(FIGURES)}")
    if not args.render_only:
        for fig_id in ids:
            record = run_figure(FIGURES[fig_id], Path(args.runs))
            print(f"{fig_id}: {record['seconds']} s, {_load_note(record)}", flush=True)
    if not args.no_render:
        for doc in render_documents():
            print(f"rewrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
