#!/usr/bin/env python3
"""Is FreeDave's single draft the best single draft? Bin the baseline's next state by the ranking's confidences.

With one draft per forward (2 states: Spiffy at D* = 1, FreeDave with 2 draft steps) the best a drafter can do is
to draft, at every step, the state the baseline most often goes to given what it can see: the ranking's
probabilities. This script decodes prompts with the baseline, records every step's next state as an (i, j) formula
(``spiffy.selfspec.chains``) together with its ranking probabilities, bins the steps on a grid of the four largest
confidences (p_11 and p_21 in tenths, p_12 and p_31 in fifths), and reports in how many cells the top-ranked position
with its top token, (1, 1), is not the most frequent next state, and what drafting the most frequent one there
instead would gain on the very steps it was read from.

Usage: python scripts/first_draft_cells.py [--model DIR] [--dataset humaneval] [--first 40] [--count 50]
       [--dtype bfloat16] (decoding: gen 64, block 32, 64 steps, greedy, as the shipped tiny-sdar graph)
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch
from tqdm.auto import tqdm

from spiffy.bench.datasets import load_benchmark_prompts
from spiffy.decoding import DecodeConfig, make_session
from spiffy.embedded import embedded_model_path
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.chains import record_chains
from spiffy.selfspec.prompts import prompt_token_ids

TOP = ((1, 1),)


def cell(probs: torch.Tensor) -> tuple[int, int, int, int]:
    """Grid cell of one step from its ranking probabilities ``[I, J]``."""
    def p(i: int, j: int) -> float:
        return float(probs[i, j]) if probs.shape[0] > i and probs.shape[1] > j else 0.0
    return (min(int(p(0, 0) * 10), 9), min(int(p(1, 0) * 10), 9), min(int(p(0, 1) * 5), 4), min(int(p(2, 0) * 5), 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="dLLM checkpoint (default: the embedded tiny-sdar)")
    ap.add_argument("--dataset", default="humaneval", help="benchmark prompt set (default humaneval)")
    ap.add_argument("--first", type=int, default=40, help="index of the first prompt (default 40: HumanEval 41)")
    ap.add_argument("--count", type=int, default=50, help="number of prompts (default 50)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model or str(embedded_model_path("dllm"))
    model, tok = load_model(model_dir, dtype=args.dtype), load_tokenizer(model_dir)
    prompts = load_benchmark_prompts(args.dataset)[args.first : args.first + args.count]
    cfg = DecodeConfig(gen_length=64, block_length=32, steps=64)
    cells: defaultdict[tuple[int, int, int, int], Counter] = defaultdict(Counter)
    for k, prompt in enumerate(tqdm(prompts, desc="baseline", unit="prompt")):
        session = make_session(model, torch.tensor([prompt_token_ids(tok, prompt.prompt, chat=False)]), cfg, seed=k)
        traj = record_chains(session, int(session.block_length), 4, max_level=1, prompt=k)
        for n, chain in traj.chains.items():
            cells[cell(traj.probs[n])][chain.formulas[0] if chain.formulas else None] += 1
    steps = sum(sum(c.values()) for c in cells.values())
    top = sum(c[TOP] for c in cells.values())
    others = {key: c for key, c in cells.items() if max((v for f, v in c.items() if f is not None), default=0) > c[TOP]}
    gain = sum(max(v for f, v in c.items() if f is not None) - c[TOP] for c in others.values())
    print(f"{len(prompts)} prompts, {steps} steps that can carry drafts; the next state is (1, 1) in {top} "
          f"({100.0 * top / max(steps, 1):.1f}%)")
    print(f"{len(cells)} occupied cells; (1, 1) is not the most frequent next state in {len(others)}, which hold "
          f"{sum(sum(c.values()) for c in others.values())} steps; drafting their most frequent state instead would "
          f"accept {gain} more drafts on these same steps ({100.0 * gain / max(steps, 1):.1f}%)")


if __name__ == "__main__":
    main()
