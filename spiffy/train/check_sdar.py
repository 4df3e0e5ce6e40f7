"""Decode check of a (possibly still training) tiny SDAR model on held-out prompts.

``python -m spiffy.train.check_sdar (--model DIR | --state RUN/train_state.pt) [--heldout RUN/data/heldout_ids.npy]``

Reports, for HumanEval prompts (the ``code`` calibration prompts are calibration data, so they are not used here):
the NFE of the baseline SDAR decoder with one token per step and with threshold-0.9 dynamic unmasking (greedy,
``spiffy.generate``), generated tokens per NFE, and the degenerate-output checks of ``spiffy.bench``
(distinct-token ratio, whitespace share); with ``--heldout``, the held-out masked-token accuracy per block length
and mask ratio (:func:`spiffy.train.sdar.evaluate`). ``--state`` reads an intermediate training state
(architecture from ``--init``), so a running job can be checked without stopping it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from spiffy.bench.common import degenerate_stats
from spiffy.bench.datasets import load_benchmark_prompts
from spiffy.api import generate
from spiffy.embedded import embedded_models_dir
from spiffy.io import atomic_write_json
from spiffy.models.loading import load_model, load_tokenizer
from spiffy.train import common, sdar


def load_for_check(model_dir: str | None, state: str | None, init: str) -> tuple[torch.nn.Module, Any, int | None]:
    """``(model float32 eval, tokenizer, training step or None)`` from a checkpoint dir or a training state."""
    if model_dir:
        return load_model(model_dir, dtype="float32").eval(), load_tokenizer(model_dir), None
    model, tok = sdar.init_from_qwen3(init)
    saved = torch.load(state, map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"])
    return model.eval(), tok, int(saved["step"])


def decode_check(model: torch.nn.Module, tok: Any, prompts: list[str], gen_length: int, block: int,
                 threshold: float) -> dict[str, Any]:
    """NFE and output-quality figures of one-token-per-step and threshold decoding over ``prompts``."""
    out: dict[str, Any] = {}
    specials = [t for t in (tok.eos_token_id, tok.pad_token_id, model.config.mask_token_id) if t is not None]
    for name, extra in (("s1", {"steps": gen_length}), (f"t{threshold:g}", {"threshold": threshold})):
        nfe, texts, toks, t0 = [], [], [], time.time()
        for p in prompts:
            ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
            r = generate(model, ids, gen_length=gen_length, block_length=block, temperature=0.0, tokenizer=tok, **extra)
            nfe.append(r.nfe)
            toks.append(r.tokens[0])
            texts.append(r.text[0] if r.text else tok.decode(r.tokens[0]))
        deg = degenerate_stats(texts, toks, exclude_ids=specials)
        out[name] = {"nfe_mean": round(sum(nfe) / len(nfe), 2), "tokens_per_nfe": round(gen_length * len(nfe) / sum(nfe), 3),
                     "distinct_token_ratio": round(deg["distinct_token_ratio"], 3),
                     "whitespace_share": round(deg["whitespace_share"], 3), "seconds": round(time.time() - t0, 1),
                     "sample": texts[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Decode check of a tiny SDAR model (NFE, output quality, held-out accuracy).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", default=None, help="SDAR checkpoint dir")
    src.add_argument("--state", default=None, help="training state (train_state.pt) of spiffy.train.sdar")
    p.add_argument("--init", default=str(embedded_models_dir() / "tiny-qwen3"), help="architecture source for --state")
    p.add_argument("--heldout", default=None, help="held-out token ids (.npy of the run's data/) for masked accuracy")
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows of 256 tokens")
    p.add_argument("--dataset", default="humaneval", help="prompt set (spiffy bench datasets)")
    p.add_argument("--max-prompts", type=int, default=10, help="first N prompts")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--blocks", default="16,32", help="block lengths to check (comma-separated)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, step = load_for_check(a.model, a.state, a.init)
    blocks = tuple(int(b) for b in a.blocks.split(","))
    res: dict[str, Any] = {"step": step}
    if a.heldout:
        ids = torch.from_numpy(np.load(a.heldout).astype(np.int64))
        windows = common.eval_windows(common.TokenStream(ids, [0]), 256, a.eval_windows)
        res["heldout_masked"] = sdar.evaluate(model, windows, int(model.config.mask_token_id), blocks)
    prompts = [bp.prompt for bp in load_benchmark_prompts(a.dataset, max_prompts=a.max_prompts)]
    for b in blocks:
        res[f"block{b}"] = decode_check(model, tok, prompts, a.gen_length, b, a.threshold)
    print(json.dumps(res, indent=1))
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
