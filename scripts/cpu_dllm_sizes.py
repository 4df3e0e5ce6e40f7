"""At which model size and cache mode do Spiffy's saved forwards become wall-clock on this CPU?

Spiffy verifies ``1 + D`` dLLM states in one forward instead of one state per forward. It saves time when a forward
over ``1 + D`` states costs less than ``NFE reduction`` single-state forwards, so the whole question is how a
forward's cost grows with the states it carries, at each model size and cache mode. This script measures that on
this machine with random weights (the cost of a forward does not depend on the weights): the published SDAR and
LLaDA architectures (``tests/data/real_configs``) scaled to a ladder of widths and depths, every cache mode each
family supports, one to six states per forward (:func:`spiffy.bench.gpu_costs.dllm_state_costs`, exactly the call
Spiffy makes). It projects the wall-clock speedup as the NFE reduction the embedded tiny-sdar measured with every
default (``docs/figures/dllm.json``, the README's headline command) times ``cost(1 state) / cost(1 + D states)``
(:func:`spiffy.bench.gpu_costs.project_dllm`): a projection, labelled so, since a larger model's acceptance is not
the tiny one's.

    python scripts/cpu_dllm_sizes.py                 # about 6 minutes with 1 thread on a quiet machine; writes docs/figures/cpu-dllm-sizes.json
    python scripts/cpu_dllm_sizes.py --self-check    # toy sizes, seconds (the suite runs it)

Prints a Markdown table (also written next to the JSON as ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spiffy.bench import gpu_costs  # noqa: E402  (the repository's spiffy, as the other scripts use it)
from spiffy.io import atomic_write_json, atomic_write_text  # noqa: E402

#: (label, hidden, layers, vocabulary): tiny-sdar's own shape first (its 4,096-token vocabulary), then the real
#: vocabulary of each family at growing width and depth
LADDER: tuple[tuple[str, int, int, int | None], ...] = (
    ("tiny-sdar shape", 128, 4, 4096),
    ("h256 x 4", 256, 4, None),
    ("h512 x 8", 512, 8, None),
    ("h1024 x 12", 1024, 12, None),
)
SELF_CHECK_LADDER: tuple[tuple[str, int, int, int | None], ...] = (("toy", 32, 2, 512),)
FAMILIES = {"SDAR": ("JetLM--SDAR-4B-Chat", ("prefix",)), "LLaDA": ("GSAI-ML--LLaDA-8B-Instruct",
                                                                    ("none", "prefix", "dual"))}
OUT = ROOT / "docs" / "figures" / "cpu-dllm-sizes.json"


def scaled(config: dict[str, Any], hidden: int, layers: int, vocab: int | None) -> dict[str, Any]:
    """``config``'s architecture at ``hidden`` x ``layers`` (heads of 64, a quarter as many K/V heads, MLP 3x)."""
    heads = max(1, hidden // 64)
    out = dict(config)
    sizes = {"hidden_size": hidden, "d_model": hidden, "num_hidden_layers": layers, "n_layers": layers,
             "num_attention_heads": heads, "n_heads": heads, "num_key_value_heads": max(1, heads // 4),
             "n_kv_heads": heads, "head_dim": hidden // heads, "intermediate_size": 3 * hidden,
             "mlp_hidden_size": 3 * hidden}
    for key, value in sizes.items():
        if key in out:
            out[key] = value
    if vocab is not None:
        for key in ("vocab_size", "embedding_size"):
            if key in out:
                out[key] = vocab
        for key in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
            if isinstance(out.get(key), int) and out[key] >= vocab:
                out[key] = vocab - 1 - ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id").index(key)
    # SDAR's <|MASK|> lives in its tokenizer, not its config
    out.setdefault("mask_token_id", vocab - 1 if vocab is not None else 151669)
    return out


def measured_reductions() -> list[dict[str, Any]]:
    """The Spiffy rows of the README's headline run (NFE reduction per budget)."""
    record = json.loads((ROOT / "docs" / "figures" / "dllm.json").read_text())
    return [{"budget": r["budget"], "nfe_reduction": r["nfe_reduction"]} for r in record["results"]["runs"]
            if r.get("method", "spiffy") == "spiffy"]


def run(ladder: tuple[tuple[str, int, int, int | None], ...], states: range, reps: int, prompt: int,
        gen: int) -> dict[str, Any]:
    measured = measured_reductions()
    rows: list[dict[str, Any]] = []
    for family, (fixture, caches) in FAMILIES.items():
        base = gpu_costs.real_config(fixture)
        for label, hidden, layers, vocab in ladder:
            model = gpu_costs.build_random(scaled(base, hidden, layers, vocab), "cpu", torch.float32)
            params = gpu_costs.count_parameters(model)
            # no cache at the largest rung: seconds per state, minutes per row, and the other modes already say it
            modes = [c for c in caches if not (c == "none" and label == ladder[-1][0] and len(ladder) > 1)]
            costs = gpu_costs.dllm_state_costs(model, prompt, gen, 32 if gen >= 32 else gen // 2, modes, states,
                                               reps=reps)
            for proj in gpu_costs.project_dllm(costs, measured):
                one = next(c["ms"] for c in costs if c["cache"] == proj["cache"] and c["states"] == 1)
                rows.append({"family": family, "size": label, "parameters": params, **proj, "ms_one_state": one})
            print(f"{family} {label}: {params / 1e6:.1f}M parameters measured", file=sys.stderr, flush=True)
            del model
    return {"label": "PROJECTION: tiny-sdar's measured NFE reduction x this CPU's measured forward costs",
            "threads": torch.get_num_threads(), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
            "date": time.strftime("%Y-%m-%d"), "prompt_tokens": prompt, "gen_length": gen, "reps": reps,
            "measured": measured, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    budgets = sorted({r["budget"] for r in res["rows"]})
    lines = [f"{res['label']} ({res['machine']}, {res['threads']} thread(s), prompt {res['prompt_tokens']} tokens, "
             f"gen length {res['gen_length']}, block 32, float32, {res['date']}). Each cell: cost of 1 + D states "
             "relative to one state; projected wall-clock speedup.", "",
             "| family | size | parameters | cache | ms, 1 state | "
             + " | ".join(f"D* = {b}: cost; projected" for b in budgets) + " |",
             "|---|---|---|---|---|" + "---|" * len(budgets)]
    keys = []
    for r in res["rows"]:
        key = (r["family"], r["size"], r["cache"])
        if key not in keys:
            keys.append(key)
    for family, size, cache in keys:
        cells = {r["budget"]: r for r in res["rows"] if (r["family"], r["size"], r["cache"]) == (family, size, cache)}
        first = next(iter(cells.values()))
        lines.append(f"| {family} | {size} | {first['parameters'] / 1e6:.1f}M | {cache} | {first['ms_one_state']:.1f} | "
                     + " | ".join(f"{cells[b]['cost_ratio']:.2f}x; **{cells[b]['projected_speedup']:.2f}x**"
                                  if b in cells else "-" for b in budgets) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self-check", action="store_true", help="toy sizes, two states (seconds; nothing written)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default=str(OUT), help=f"results JSON (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.self_check:
        res = run(SELF_CHECK_LADDER, range(1, 3), reps=1, prompt=8, gen=8)
        print(markdown(res))
        return 0
    res = run(LADDER, range(1, 7), reps=3, prompt=64, gen=64)
    out = Path(args.out)
    atomic_write_json(out, res)
    atomic_write_text(out.with_suffix(".md"), markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
