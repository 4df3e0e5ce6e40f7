#!/usr/bin/env python
"""Per-step overhead of Spiffy (ranking, pruning, instantiation) as a fraction of the verification forward.

Builds a tiny random checkpoint (or uses ``--model DIR``), calibrates a small draft graph on one baseline
trajectory (greedy parent-closed selection of the most frequent formulas), then decodes a few other prompts with
the baseline and with Spiffy, checks the outputs are identical, and reports:

* per verification forward: mean seconds of the forward and of each Spiffy stage, and each stage as a % of the
  forward;
* NFE of both paths, accepted drafts, drafts evaluated per forward.

Prints one JSON object and a Markdown table (``--json-out`` / ``--md-out`` write them to files as well).
Timings are wall-clock on whatever device runs it; on a 2-core CPU with a tiny model the forward is cheap, so the
overhead fraction is an upper bound of what a real checkpoint would see.

Example::

    python examples/bench_spiffy_overhead.py --family llada --gen-length 32 --block-length 8 --budget 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random one built in a temp dir)")
    p.add_argument("--family", default="llada", choices=("llada", "dream", "sdar"), help="family of the tiny checkpoint")
    p.add_argument("--gen-length", type=int, default=32, help="generated positions per prompt")
    p.add_argument("--block-length", type=int, default=8, help="positions per block")
    p.add_argument("--steps", type=int, default=None, help="total denoising steps (default: gen-length, 1 token/step)")
    p.add_argument("--threshold", type=float, default=None, help="dynamic unmasking threshold (default: static)")
    p.add_argument("--cache", default="none", choices=("none", "prefix", "dual"), help="cache mode (LLaDA/Dream)")
    p.add_argument("--budget", type=int, default=3, help="draft nodes kept per step (D*)")
    p.add_argument("--nodes", type=int, default=10, help="nodes of the calibrated graph (D)")
    p.add_argument("--score", default="gm", help="pruning score (gm, product, local, count)")
    p.add_argument("--prompts", type=int, default=3, help="measured prompts")
    p.add_argument("--prompt-len", type=int, default=8, help="tokens per (random) prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions per prompt (after one warm-up)")
    p.add_argument("--dtype", default="float32", help="model dtype (float32, float64, bfloat16)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and decoding")
    p.add_argument("--json-out", default=None, help="also write the JSON result here")
    p.add_argument("--md-out", default=None, help="also write the Markdown table here")
    return p.parse_args(argv)


def _config(args: argparse.Namespace, family: str) -> Any:
    from spiffy.decoding import DecodeConfig

    kw: dict[str, Any] = dict(
        gen_length=args.gen_length, block_length=args.block_length, steps=args.steps, threshold=args.threshold, seed=args.seed
    )
    if family == "sdar":
        from spiffy.decoding.sdar import SDARDecodeConfig

        return SDARDecodeConfig(**kw)
    return DecodeConfig(cache=args.cache, **kw)


def _graph(model: Any, prompt: torch.Tensor, cfg: Any, nodes: int) -> Any:
    """A small calibrated graph from one baseline trajectory: most frequent formulas, parent-closed, greedy."""
    from spiffy.decoding import make_session
    from spiffy.selfspec.graph import DraftGraph
    from spiffy.selfspec.oracle import record_trajectory, trajectory_formulas
    from spiffy.selfspec.pruning import select_closed

    session = make_session(model, prompt, cfg)
    counts: Counter = trajectory_formulas(record_trajectory(session), session.mask_id, i_max=8, j_max=4, max_level=4)
    formulas = sorted(counts, key=lambda f: (f[0], f[1]))
    full = DraftGraph.from_formulas(formulas, counts=[counts[f] for f in formulas])
    keep = select_closed(full, {n.id: float(n.count) for n in full.nodes}, nodes)
    return full.subgraph(keep)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import spiffy
    from spiffy.decoding import make_session, run_baseline
    from spiffy.models import load_model
    from spiffy.selfspec.runtime import STAGES, speculative_generate

    tmp = None
    path = args.model
    if path is None:
        from spiffy.models.tiny import make_tiny

        tmp = tempfile.TemporaryDirectory(prefix="spiffy-bench-")
        path = str(make_tiny(args.family, Path(tmp.name) / args.family, seed=args.seed))
    dtype = getattr(torch, args.dtype)
    model = load_model(path, dtype=dtype).to(args.device).eval()
    family = spiffy.models.family_of(model)
    cfg = _config(args, family)
    vocab = int(getattr(model.config, "vocab_size", 256))
    gen = torch.Generator().manual_seed(args.seed)
    low = 0
    high = min(vocab, 256)  # ordinary tokens of the tiny tokenizers; avoids special ids (mask, EOS)
    prompts = [torch.randint(low, high, (1, args.prompt_len), generator=gen) for _ in range(args.prompts + 1)]
    graph = _graph(model, prompts[0], cfg, args.nodes)

    totals = {s: 0.0 for s in STAGES}
    forwards = drafts = accepted = reused = nfe_spec = nfe_base = 0
    base_seconds = spec_seconds = 0.0
    identical = 0
    runs = 0
    for prompt in prompts[1:]:
        for rep in range(args.repeats + 1):
            s0 = make_session(model, prompt, cfg)
            t0 = time.perf_counter()
            base = run_baseline(s0)
            t_base = time.perf_counter() - t0
            s1 = make_session(model, prompt, cfg)
            t0 = time.perf_counter()
            st = speculative_generate(s1, graph, args.budget, score=args.score)
            t_spec = time.perf_counter() - t0
            if rep == 0:
                identical += int(torch.equal(s0.x, s1.x))
                continue  # warm-up
            runs += 1
            base_seconds += t_base
            spec_seconds += t_spec
            nfe_base += base.nfe
            nfe_spec += st.nfe
            accepted += st.accepted_total
            reused += st.reused_steps
            forwards += st.forwards
            drafts += st.drafts_evaluated
            for s in STAGES:
                totals[s] += st.stage_times[s]
    per_fwd = {s: totals[s] / max(forwards, 1) for s in STAGES}
    verify = per_fwd["verify"] or float("nan")
    overhead = per_fwd["rank"] + per_fwd["prune"] + per_fwd["instantiate"]
    result = {
        "model": path if args.model else f"tiny-{args.family} (random)",
        "family": family,
        "config": cfg.to_dict(),
        "graph_nodes": len(graph.nodes),
        "budget": args.budget,
        "score": args.score,
        "prompts": args.prompts,
        "timed_runs": runs,
        "identical_outputs": f"{identical}/{args.prompts}",
        "nfe_baseline": nfe_base,
        "nfe_spiffy": nfe_spec,
        "accepted": accepted,
        "reused_noop_steps": reused,
        "nfe_reduction": nfe_base / nfe_spec if nfe_spec else None,
        "verification_forwards": forwards,
        "drafts_per_forward": drafts / max(forwards, 1),
        "seconds_per_forward": per_fwd,
        "overhead_percent_of_forward": {s: 100.0 * per_fwd[s] / verify for s in ("rank", "prune", "instantiate")},
        "overhead_total_percent": 100.0 * overhead / verify,
        "walk_percent_of_forward": 100.0 * per_fwd["walk"] / verify,
        "seconds_baseline": base_seconds,
        "seconds_spiffy": spec_seconds,
        "versions": {
            "spiffy": spiffy.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "device": args.device,
        "dtype": args.dtype,
    }
    try:
        import transformers

        result["versions"]["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    text = json.dumps(result, indent=2, default=str)
    md = _markdown(result)
    print(text)
    print()
    print(md)
    for out, content in ((args.json_out, text), (args.md_out, md)):
        if out:
            _atomic_write(out, content + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if identical == args.prompts else 1


def _markdown(r: dict[str, Any]) -> str:
    spf = r["seconds_per_forward"]
    pct = r["overhead_percent_of_forward"]
    lines = [
        f"Spiffy per-step overhead: {r['model']}, budget {r['budget']} of {r['graph_nodes']} nodes, "
        f"{r['dtype']} on {r['device']}; outputs identical to baseline: {r['identical_outputs']}",
        "",
        "| stage | ms per forward | % of verification forward |",
        "|---|---:|---:|",
        f"| verify (forward) | {1e3 * spf['verify']:.3f} | 100.0 |",
    ]
    for s in ("rank", "prune", "instantiate"):
        lines.append(f"| {s} | {1e3 * spf[s]:.3f} | {pct[s]:.2f} |")
    lines.append(f"| **rank + prune + instantiate** | {1e3 * (spf['rank'] + spf['prune'] + spf['instantiate']):.3f} | "
                 f"**{r['overhead_total_percent']:.2f}** |")
    lines.append(f"| walk (baseline transitions + matching) | {1e3 * spf['walk']:.3f} | {r['walk_percent_of_forward']:.2f} |")
    lines += [
        "",
        f"NFE baseline {r['nfe_baseline']}, Spiffy {r['nfe_spiffy']} (accepted {r['accepted']}, "
        f"reused no-op steps {r['reused_noop_steps']}, "
        f"reduction {r['nfe_reduction']:.2f}x), {r['drafts_per_forward']:.2f} drafts per forward.",
    ]
    return "\n".join(lines)


def _atomic_write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


if __name__ == "__main__":
    sys.exit(main())
