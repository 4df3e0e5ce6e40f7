"""Measure how batched rows compare with their prompts decoded alone, per dtype and path (README, *Guarantee per
dtype*): for every row of every batch, identical or not, and for each differing row the near-tie proof of
:mod:`spiffy.bench.batch_fidelity`.

    PYTHONPATH=$PWD python scripts/batch_near_ties.py --batches 12 --out results/batch-near-ties.json
    PYTHONPATH=$PWD python scripts/batch_near_ties.py --batches 30 --dtypes bfloat16,float16 --batch-invariant

Tiny random checkpoints (seed 0: LLaDA, Dream, SDAR; a 3-layer Qwen3 target with a 2-layer DFlash drafter, block
8), ragged batches of 3 prompts (1-8 tokens, left padded), gen 8 / block 4 (dLLM, 4 steps per block or threshold
0.05, every cache mode in turn, T = 0 and 1) and 24 new tokens (AR: DFlash and DDTree@8, coupled at T = 0 and 0.7,
rejection at 0.7). Prints one line per (path, dtype) and writes the counts as JSON, with ``decode_s``: the seconds
spent decoding (batched and alone, proofs excluded). ``--batch-invariant`` runs everything in
:func:`spiffy.batch_invariant` (every row must then be identical; compare ``decode_s`` for the mode's cost).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, speculative_generate, speculative_generate_batch
from spiffy.batch_invariance import batch_invariant
from spiffy.bench.batch_fidelity import explain_dllm_batch_row
from spiffy.bench.batch_fidelity_ar import explain_ar_batch_row
from spiffy.io import atomic_write_json
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.loading import load_model
from spiffy.models.tiny import make_tiny


def _prompts(g: torch.Generator, low: int = 1) -> list[list[int]]:
    lengths = torch.randint(low, 9, (3,), generator=g).tolist()
    return [torch.randint(5, 250, (n,), generator=g).tolist() for n in lengths]


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


def dllm_counts(root: Path, family: str, dtype: torch.dtype, batches: int) -> Counter:
    model = load_model(make_tiny(family, root / family, seed=0), dtype=dtype)
    g = torch.Generator().manual_seed(0)
    out: Counter = Counter()
    for k in range(batches):
        prompts = _prompts(g)
        kw = dict(gen_length=8, block_length=4, temperature=(0.0, 1.0)[k % 2])
        kw.update(steps=4) if (k // 2) % 2 == 0 else kw.update(threshold=0.05)
        if family != "sdar":
            kw["cache"] = ("none", "prefix", "dual")[(k // 4) % 3]
        ids, mask = _left_pad(prompts)
        t0 = time.perf_counter()
        batched = generate(model, ids, attention_mask=mask, **kw).tokens
        alone = [generate(model, torch.tensor([p]), **kw).tokens[0] for p in prompts]
        out["decode_s"] += time.perf_counter() - t0
        for r, p in enumerate(prompts):
            out["rows"] += 1
            if alone[r] == batched[r]:
                out["identical"] += 1
                continue
            div = explain_dllm_batch_row(model, prompts, r, None, overrides=kw)
            out["near_tie" if div is not None and div.near_tie else "unproven"] += 1
            if div is not None:
                out[f"kind:{div.kind}"] += 1
                out["max_deviation_ulps"] = max(out["max_deviation_ulps"], div.deviation_ulps or 0)
    return out


def ar_counts(root: Path, dtype: torch.dtype, batches: int) -> Counter:
    t = make_tiny_target(root / "target", seed=3, num_layers=3, with_tokenizer=False)
    d = make_tiny_dflash(root / "drafter", t, seed=4, num_layers=2, block_size=8)
    target, drafter = load_target(t, dtype, "cpu"), load_drafter(d, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    out: Counter = Counter()
    for k in range(batches):
        prompts = _prompts(g, low=2)
        accept, temp = (("coupled", 0.0), ("coupled", 0.7), ("rejection", 0.7))[k % 3]
        cfg = ARSpecConfig(method=("dflash", "ddtree")[(k // 3) % 2], budget=8, accept=accept, max_new_tokens=24,
                           sampling=SamplingConfig(temperature=temp, seed=k))
        t0 = time.perf_counter()
        batched = speculative_generate_batch(target, [DFlashDrafter(drafter) for _ in prompts], prompts, cfg)
        alone = [speculative_generate(target, DFlashDrafter(drafter), p, cfg).tokens for p in prompts]
        out["decode_s"] += time.perf_counter() - t0
        for r, p in enumerate(prompts):
            out["rows"] += 1
            if alone[r] == batched[r].tokens:
                out["identical"] += 1
                continue
            div = explain_ar_batch_row(target, lambda: DFlashDrafter(drafter), prompts, r, cfg)
            out["near_tie" if div is not None and div.near_tie else "unproven"] += 1
            if div is not None:
                out[f"kind:{div.kind}"] += 1
                out["max_deviation_ulps"] = max(out["max_deviation_ulps"], div.deviation_ulps or 0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=12, help="batches of 3 prompts per path and dtype")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="run in batch-invariant mode (spiffy.batch_invariant): every row must be identical")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            for path in ("llada", "dream", "sdar", "ar"):
                root = Path(tmp) / f"{path}-{name}"
                with batch_invariant(args.batch_invariant):
                    counts = (ar_counts(root, dtype, args.batches) if path == "ar"
                              else dllm_counts(root, path, dtype, args.batches))
                counts["decode_s"] = round(counts["decode_s"], 2)
                results[f"{path}/{name}"] = dict(counts)
                print(f"{path:6s} {name:9s} {dict(counts)}", flush=True)
    if args.out is not None:
        atomic_write_json(args.out, results)
    # an unproven divergence is a bug; in batch-invariant mode so is any divergence
    bad = [k for k, c in results.items() if c.get("unproven") or (args.batch_invariant and c["identical"] != c["rows"])]
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
