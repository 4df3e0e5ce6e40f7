"""Check trained tiny checkpoints through the library's own loaders and decoders, and print sample completions.

``python -m spiffy.train.check --qwen3 DIR [--drafter DIR] [--llada DIR] [--json OUT]``

* Qwen3 target: ``spiffy.models.loading.load_model``; greedy AR completions of a few code prompts.
* DFlash drafter: ``spiffy.models.dflash.load_drafter``; ``ddtree_generate`` with methods ``ar``, ``dflash`` and
  ``ddtree`` on held-out-style prompts: tokens must be identical (lossless), tau (mean acceptance length incl. the
  bonus token, macro-averaged over prompts) is reported.
* LLaDA: ``load_model`` + ``spiffy.api.generate`` (baseline, low-confidence remasking, greedy).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from spiffy.api import generate
from spiffy.arspec import ddtree_generate
from spiffy.io import atomic_write_json
from spiffy.models.dflash import load_drafter
from spiffy.models.loading import load_model, load_tokenizer

PROMPTS = [
    "def ",
    "import os\n\n\ndef get_",
    "class Foo:\n    def __init__(self",
    "    for i in range(",
    "    if not isinstance(value, str):\n        raise ",
    "def __repr__(self):\n    return ",
]


def check_qwen3(path: str, drafter_path: str | None = None, max_new_tokens: int = 48,
                budget: int = 32) -> dict[str, Any]:
    """Load the target (and drafter) with the library and return samples and acceptance statistics."""
    target = load_model(path, dtype="float32")
    tok = load_tokenizer(path)
    out: dict[str, Any] = {"samples": {}}
    drafter = None
    if drafter_path:
        drafter = load_drafter(drafter_path, dtype="float32")
        out["acceptance"] = {}
    stop = [tok.eos_token_id]
    taus: dict[str, list[float]] = {"dflash": [], "ddtree": []}
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        ar = ddtree_generate(target, None, ids, method="ar", max_new_tokens=max_new_tokens, stop_token_ids=stop)
        out["samples"][p] = tok.decode(ar.tokens)
        if drafter is not None:
            row = {}
            for method in ("dflash", "ddtree"):
                r = ddtree_generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=max_new_tokens,
                                    stop_token_ids=stop)
                row[method] = {"tau": round(r.tau, 3), "rounds": r.rounds, "identical_to_ar": r.tokens == ar.tokens}
                taus[method].append(r.tau)
            out["acceptance"][p] = row
    if drafter is not None:
        out["tau_macro"] = {m: round(sum(v) / len(v), 3) for m, v in taus.items() if v}
        out["all_identical"] = all(r[m]["identical_to_ar"] for r in out["acceptance"].values() for m in r)
        out["ddtree_budget"] = budget
    return out


def check_llada(path: str, gen_length: int = 48, block_length: int = 16) -> dict[str, Any]:
    """Load the dLLM with the library and decode a few prompts with the baseline decoder."""
    model = load_model(path, dtype="float32")
    tok = load_tokenizer(path)
    out: dict[str, Any] = {"samples": {}}
    for p in PROMPTS:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        r = generate(model, ids, tokenizer=tok, gen_length=gen_length, block_length=block_length,
                     steps=gen_length)
        out["samples"][p] = r.text[0] if r.text else tok.decode(r.tokens[0])
        out.setdefault("nfe", []).append(r.nfe)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Load trained tiny checkpoints with spiffy and print samples.")
    p.add_argument("--qwen3", default=None, help="Qwen3 target checkpoint dir")
    p.add_argument("--drafter", default=None, help="DFlash drafter dir (needs --qwen3)")
    p.add_argument("--llada", default=None, help="LLaDA checkpoint dir")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per completion")
    p.add_argument("--budget", type=int, default=32, help="DDTree node budget")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    if a.qwen3:
        res["qwen3"] = check_qwen3(a.qwen3, a.drafter, a.max_new_tokens, a.budget)
    if a.llada:
        res["llada"] = check_llada(a.llada, a.max_new_tokens)
    for name, r in res.items():
        for prompt, text in r["samples"].items():
            print(f"=== {name} | {prompt!r}\n{prompt}{text}\n")
        for k in ("tau_macro", "all_identical", "ddtree_budget", "nfe"):
            if k in r:
                print(f"{name} {k}: {r[k]}")
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
