"""Benchmark: DDTree tree-build and compile time per round vs. the verify forward, across node budgets.

Tree build = ``log_softmax`` over the vocabulary + one ``torch.topk`` for all depths + the best-first heap
(:func:`spiffy.arspec.tree.build_ddtree`), on random drafter logits ``[block - 1, vocab]`` (default: Qwen3's vocabulary of
151,936, block 16). Compile = :func:`spiffy.verify.compile_packed` of ``[root, nodes...]`` over a committed context.
Verify = one target forward over the compiled rows on top of a cached context, for a tiny random Qwen3 target
(written to a temp dir by :func:`spiffy.models.make_tiny_target`; ``--target DIR`` uses a real one).

Prints one JSON object and a Markdown table (median milliseconds per round)::

    python examples/bench_tree_build.py --budgets 16,32,64,128,256,512,1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import spiffy
from spiffy.arspec.tree import build_ddtree
from spiffy.models import load_target, make_tiny_target
from spiffy.verify import DraftStructure, compile_packed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _compile(tree, root_pos: int, ctx_len: int, dtype: torch.dtype, device: torch.device):
    n = tree.num_nodes
    structure = DraftStructure(
        tokens=list(tree.tokens.split(1)),
        positions=list((tree.depths + root_pos).split(1)),
        parents=[(p,) if p >= 0 else () for p in tree.parents.tolist()],
        visibility="ancestors",
    )
    return compile_packed(structure, context_len=ctx_len, dtype=dtype, device=device,
                          prefix_rows=(torch.tensor([1]), torch.tensor([root_pos])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024", help="comma-separated node budgets")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size of the random drafter logits")
    ap.add_argument("--block", type=int, default=16, help="drafter block size (tree depth = block - 1)")
    ap.add_argument("--scale", type=float, default=4.0, help="std of the random logits (peakedness)")
    ap.add_argument("--context", type=int, default=256, help="committed context length for compile/verify")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per point (median reported)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--target", default=None, help="Qwen3 target dir for the verify forward (default: tiny random)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    depth = args.block - 1
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(depth, args.vocab, generator=gen, device=device, dtype=torch.float32) * args.scale

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = Path(args.target) if args.target else make_tiny_target(Path(tmp) / "target", seed=0, with_tokenizer=False)
        target = load_target(target_dir, dtype, device)
        tv = int(target.config.vocab_size)
        from transformers import DynamicCache

        rows = []
        for budget in budgets:
            tree_ms = _median_ms(lambda: build_ddtree(torch.log_softmax(logits, dim=-1), budget), args.repeats, device)
            tree = build_ddtree(torch.log_softmax(logits, dim=-1), budget)
            tree.tokens = tree.tokens % tv  # reuse the shape on the target's vocabulary
            compile_ms = _median_ms(lambda: _compile(tree, args.context, args.context, dtype, device), args.repeats, device)
            comp = _compile(tree, args.context, args.context, dtype, device)
            ctx_ids = torch.randint(0, tv, (1, args.context), device=device)

            def verify() -> None:
                cache = DynamicCache(config=target.config)
                with torch.inference_mode():
                    target.model(input_ids=ctx_ids, past_key_values=cache, use_cache=True)
                    _sync(device)
                    t = time.perf_counter()
                    target.model(input_ids=comp.input_ids, position_ids=comp.position_ids,
                                 attention_mask=comp.attention_mask, past_key_values=cache, use_cache=True)
                    _sync(device)
                    verify.last = (time.perf_counter() - t) * 1e3  # type: ignore[attr-defined]

            samples = []
            verify()
            for _ in range(args.repeats):
                verify()
                samples.append(verify.last)  # type: ignore[attr-defined]
            verify_ms = statistics.median(samples)
            rows.append({
                "budget": budget, "nodes": tree.num_nodes, "max_depth": tree.max_depth(),
                "tree_build_ms": tree_ms, "compile_ms": compile_ms, "verify_forward_ms": verify_ms,
                "tree_build_over_verify": tree_ms / verify_ms if verify_ms > 0 else None,
            })
            print(f"budget {budget}: tree {tree_ms:.2f} ms, compile {compile_ms:.2f} ms, verify {verify_ms:.2f} ms",
                  file=sys.stderr)

    result = {
        "benchmark": "ddtree_tree_build",
        "vocab": args.vocab, "block": args.block, "depth": depth, "logit_std": args.scale, "context": args.context,
        "device": str(device), "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
        "target": str(args.target) if args.target else "tiny random Qwen3 (make_tiny_target, hidden 64, 2 layers)",
        "target_vocab": tv,
        "versions": {"spiffy": spiffy.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__, "python": platform.python_version()},
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print()
    print(f"| budget | nodes | max depth | tree build (ms) | compile (ms) | verify forward, tiny target (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['budget']} | {r['nodes']} | {r['max_depth']} | {r['tree_build_ms']:.2f} | {r['compile_ms']:.2f} "
              f"| {r['verify_forward_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
