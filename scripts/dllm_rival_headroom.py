"""How far can a draft graph get ahead of FreeDave's and SSD's chain at each width, on prompts it never saw?

FreeDave and SSD draft the same thing at ``K`` states per forward: the chain of the ``K - 1`` most confident next
states. A Spiffy graph spends the same ``K - 1`` drafts per forward where calibration says the baseline's trajectory
goes, branches included. This script decodes held-out prompts with the baseline once, records every step's ranking
and the formula chain its future followed (:func:`~spiffy.selfspec.chains.record_chains`, what calibration
records), and replays the runtime's walk on those trajectories (:func:`~spiffy.selfspec.tune.replay_walks`) for
each ``D* = K - 1``:

* **chain**: FreeDave's / SSD's drafts (:func:`~spiffy.selfspec.freedave.chain_formulas`);
* **graph**: the shipped graph, pruned per step by its own score, as ``spiffy bench dllm`` runs it;
* **bound**: perfect foresight, a drafter that knows the baseline's next ``D*`` steps (every walk accepts as many
  drafts as the recorded future allows, ``min(D*, chain length)``): no draft selection can do better.

It also reports how often the chain's next level holds once the previous one did (the continuation rate) and which
formula the baseline followed instead when the chain's first draft missed. A branch only pays where its chance of
being reached beats that of the chain's deepest node; the continuation rate says how rarely that happens at small
widths. Replays, not runs: the suite checks them against real runs forward for forward
(``tests/test_tune.py``).

    python scripts/dllm_rival_headroom.py                # HumanEval/90-139, about 1 minute with 1 thread
    python scripts/dllm_rival_headroom.py --self-check   # 2 prompts, 16 positions, nothing written
    python scripts/dllm_rival_headroom.py --model DIR --graph FILE --out my.json   # your own dLLM and graph

Writes ``docs/figures/dllm-rival-headroom.json`` and the Markdown table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spiffy.bench.datasets import held_out_from, load_benchmark_prompts  # noqa: E402
from spiffy.decoding import DecodeConfig, make_session  # noqa: E402
from spiffy.embedded import embedded_graph_path, embedded_model_path  # noqa: E402
from spiffy.errors import PromptTooLongError  # noqa: E402
from spiffy.io import atomic_write_json, atomic_write_text  # noqa: E402
from spiffy.models.loading import load_model, load_tokenizer  # noqa: E402
from spiffy.selfspec.chains import Trajectory, record_chains  # noqa: E402
from spiffy.selfspec.freedave import chain_formulas  # noqa: E402
from spiffy.selfspec.graph import DraftGraph, load_graph  # noqa: E402
from spiffy.selfspec.prompts import prompt_token_ids  # noqa: E402
from spiffy.selfspec.pruning import resolve_score  # noqa: E402
from spiffy.selfspec.tune import paired_p_value, project_at_budget, replay_walks  # noqa: E402

OUT = ROOT / "docs" / "figures" / "dllm-rival-headroom.json"


def record(model: Any, prompts: Sequence[list[int]], config: DecodeConfig, j_max: int) -> list[Trajectory]:
    """One baseline decode per prompt, its chains and rankings recorded (every position ranked, ``j_max`` tokens);
    a prompt that does not fit the model's context is left out, as the bench leaves it out."""
    out = []
    for k, ids in enumerate(prompts):
        try:
            session = make_session(model, torch.tensor([ids]), config, seed=k)
        except PromptTooLongError:
            continue
        out.append(record_chains(session, int(session.block_length), j_max, prompt=k))
    return out


def first_misses(trajectories: Sequence[Trajectory], top: int = 4) -> dict[str, Any]:
    """Of the recorded steps with a future, the share whose first step is the chain's ``(1, 1)`` and the formulas
    the others followed (the ``top`` most frequent, as ``"i,j"``)."""
    firsts = Counter(c.formulas[0] for t in trajectories for c in t.chains.values() if c.formulas)
    total = sum(firsts.values())
    misses = {",".join(f"{i}.{j}" for i, j in f): n / total for f, n in firsts.most_common() if f != ((1, 1),)}
    return {"steps": total, "chain_share": firsts[((1, 1),)] / total if total else 0.0,
            "instead": dict(list(misses.items())[:top])}


def compare(trajectories: Sequence[Trajectory], graph: DraftGraph, budgets: Sequence[int]) -> list[dict[str, Any]]:
    """Per ``D*``: the chain's, the graph's and the bound's replayed reductions, the paired p-value of the graph's
    per-prompt savings over the chain's, and the chain's continuation rate (level ``l`` accepted over level ``l - 1``
    accepted, ``l >= 2``)."""
    rows = []
    score = resolve_score(None, graph)  # the graph's recorded score, as the runtime picks it
    for d in budgets:
        chain = project_at_budget(trajectories, DraftGraph.from_formulas(chain_formulas(d)), d, "gm")
        spiffy = project_at_budget(trajectories, graph, d, score)
        bound = replay_walks(trajectories, lambda t, n, c, d=d: min(d, len(c.formulas)))
        levels = chain["accepted_per_level"]
        rows.append({
            "budget": d, "states_per_forward": d + 1, "score": score,
            "chain": chain["reduction"], "graph": spiffy["reduction"], "bound": bound["reduction"],
            "graph_vs_chain": chain["projected_nfe"] / spiffy["projected_nfe"],
            "bound_vs_chain": chain["projected_nfe"] / bound["projected_nfe"],
            "p_value": paired_p_value(spiffy["saved_per_prompt"], chain["saved_per_prompt"]),
            "chain_continuation": [b / a if a else 0.0 for a, b in zip(levels, levels[1:])],
            "forwards": {"baseline": chain["baseline_nfe"], "chain": chain["projected_nfe"],
                         "graph": spiffy["projected_nfe"], "bound": bound["projected_nfe"]},
        })
    return rows


def markdown(res: dict[str, Any]) -> str:
    """The comparison as a Markdown table, then the chain's first-step misses in one line."""
    lines = ["| D* | states per forward | chain (FreeDave, SSD) | Spiffy graph | graph / chain (p) | perfect-foresight "
             "bound | bound / chain | chain continuation, levels 2.. |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        cont = " / ".join(f"{c:.2f}" for c in r["chain_continuation"]) or "-"
        lines.append(f"| {r['budget']} | {r['states_per_forward']} | {r['chain']:.2f}x | {r['graph']:.2f}x | "
                     f"{r['graph_vs_chain']:.3f}x (p = {r['p_value']:.3g}) | {r['bound']:.2f}x | "
                     f"{r['bound_vs_chain']:.2f}x | {cont} |")
    fm = res["first_misses"]
    instead = ", ".join(f"({k.replace('.', ', ')}) {v:.1%}" for k, v in fm["instead"].items())
    lines.append("")
    lines.append(f"First step of the {fm['steps']} recorded steps: the chain's (1, 1) {fm['chain_share']:.1%}; "
                 f"otherwise most often {instead} (position rank, token rank).")
    return "\n".join(lines) + "\n"


def graph_config(graph: DraftGraph, gen_length: int | None = None) -> DecodeConfig:
    """The decoding configuration ``graph`` was calibrated for (``gen_length``: a shorter generation, two blocks)."""
    config = DecodeConfig.from_dict(dict(graph.meta["calibration"]["decode_config"]))
    if gen_length is not None:
        config = config.replace(gen_length=gen_length, steps=gen_length, block_length=gen_length // 2)
    return config


def run(model_dir: Path, graph_path: Path, skip: int, max_prompts: int, budgets: Sequence[int],
        gen_length: int | None = None) -> dict[str, Any]:
    """Record the held-out prompts under the graph's own calibrated configuration (dtype and prompt format
    included) and compare (see the module docstring)."""
    graph = load_graph(graph_path)
    cal = graph.meta.get("calibration", {})
    config = graph_config(graph, gen_length)
    model = load_model(model_dir, dtype=cal.get("dtype", "bfloat16"))
    tokenizer = load_tokenizer(model_dir)
    prompts = load_benchmark_prompts("humaneval", skip=skip, max_prompts=max_prompts)
    encoded = [prompt_token_ids(tokenizer, p.prompt, chat=bool(cal.get("chat"))) for p in prompts]
    trajectories = record(model, encoded, config, int(cal.get("j_max", 4)))
    return {"model": str(model_dir.name), "graph": graph_path.name, "dataset": "humaneval", "skip": skip,
            "prompts": len(trajectories), "decode_config": config.to_dict(), "dtype": cal.get("dtype"),
            "rows": compare(trajectories, graph, budgets), "first_misses": first_misses(trajectories)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="dLLM checkpoint directory (default: the embedded tiny-sdar)")
    p.add_argument("--graph", default=None, help="draft graph file (default: the first graph shipped with --model)")
    p.add_argument("--skip", type=int, default=None,
                   help="HumanEval prompts left out first (default 90: the ones the embedded models never saw)")
    p.add_argument("--self-check", action="store_true", help="2 prompts, 16 positions, D* 1-2 (nothing written)")
    p.add_argument("--max-prompts", type=int, default=50, help="held-out HumanEval prompts (default 50)")
    p.add_argument("--budgets", default="1,2,3,4,5", help="D* values (default 1,2,3,4,5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=str(OUT), help=f"results JSON (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else embedded_model_path("dllm")
    graph_path = Path(args.graph) if args.graph else embedded_graph_path(model_dir)
    if graph_path is None or not graph_path.is_file():
        p.error(f"no draft graph {'at ' + str(graph_path) if graph_path else 'is shipped with ' + str(model_dir)}; "
                "fix: pass --graph FILE (written by `spiffy calibrate`)")
    small = args.self_check
    skip = held_out_from("humaneval") if args.skip is None else args.skip
    res = run(model_dir, graph_path, skip, 2 if small else args.max_prompts,
              (1, 2) if small else [int(b) for b in args.budgets.split(",")], gen_length=16 if small else None)
    table = markdown(res)
    print(table, end="")
    if not small:
        atomic_write_json(Path(args.out), res)
        atomic_write_text(Path(args.out).with_suffix(".md"), table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
