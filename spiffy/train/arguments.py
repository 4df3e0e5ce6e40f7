"""The command-line options of the trainers, built without importing torch (``spiffy train-drafter --help`` is
instant). The trainers (:mod:`spiffy.train.drafter`, :mod:`spiffy.train.d2a`, ...) read what these define."""

from __future__ import annotations

import argparse
from typing import Any

#: dLLM-drafter training recipes (besides ``dflash``)
RECIPES: tuple[str, ...] = ("d2a-stage1", "d2a-stage2", "streak")

__all__ = ["RECIPES", "add_corpus_arguments", "add_d2a_arguments", "add_drafter_arguments", "add_eval_arguments",
           "add_optim_arguments", "add_output_arguments", "add_run_arguments"]


def add_corpus_arguments(p: Any) -> None:
    """``--corpus``, ``--max-files``, ``--heldout-percent`` (shared by every trainer)."""
    p.add_argument("--corpus", default=None,
                   help="corpus directory (built from the Python standard library if missing, about 8 MB; default "
                        "$SPIFFY_CACHE/corpus or ~/.cache/spiffy/corpus, announced when built)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (tests)")
    p.add_argument("--heldout-percent", type=int, default=5, help="percent of corpus files held out (path hash)")


def add_optim_arguments(p: Any, steps: int) -> None:
    """``--batch-size``, ``--steps``, ``--lr``, ``--warmup``, ``--weight-decay`` of the from-scratch LM trainers."""
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--steps", type=int, default=steps, help="total optimizer steps (cosine schedule length)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")


def add_eval_arguments(p: Any, eval_windows: int = 32) -> None:
    """The held-out evaluation and logging cadence options every trainer shares."""
    p.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (0: only at the end)")
    p.add_argument("--eval-windows", type=int, default=eval_windows, help="held-out windows evaluated")
    p.add_argument("--log-every", type=int, default=10, help="log a line to OUT/train_log.jsonl every N steps")


def add_run_arguments(p: Any, max_minutes: float, ckpt_every: int) -> None:
    """``--max-minutes``, ``--schedule``, ``--stop-after``, ``--resume``, ``--ckpt-every`` (shared run control)."""
    p.add_argument("--max-minutes", type=float, default=max_minutes, help="wall-clock budget of this invocation")
    p.add_argument("--schedule", choices=["steps", "time"], default="steps",
                   help="cosine over --steps (deterministic) or over the --max-minutes budget (always ends annealed; "
                        "the budget then counts total training time across resumes)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop this invocation after N steps (the run can be resumed later with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt if present")
    p.add_argument("--ckpt-every", type=int, default=ckpt_every, help="save the training state every N steps")
    p.add_argument("--keep-every", type=int, default=0, metavar="N",
                   help="also keep the weights of every N-th step as OUT/snapshots/step-N.pt (for checkpoint "
                        "selection on validation prompts; loadable by --start-from; default 0: none)")


def add_output_arguments(p: Any, dtype_help: str = "dtype of the exported weights") -> None:
    """``--threads`` and ``--save-dtype``."""
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads torch may use (default 1: the setting the shipped tiny models were trained with; "
                        "a run reproduces bit for bit only at the same thread count)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help=dtype_help)


def add_drafter_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the drafter-training options to ``p`` (shared by ``python -m`` and ``spiffy train-drafter``)."""
    p.add_argument("--target", required=True, help="frozen AR target checkpoint dir (weights + tokenizer): Qwen3, Qwen3-MoE, "
                   "Qwen2, Llama, Mistral")
    p.add_argument("--out", required=True, help="run dir (train_state.pt, logs); the drafter goes to OUT/model")
    add_corpus_arguments(p)
    p.add_argument("--data", choices=["target", "corpus"], default="target",
                   help="train on target-generated continuations (default) or raw corpus windows")
    p.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--intermediate", type=int, default=None, help="drafter MLP size (default: the target's)")
    p.add_argument("--block-size", type=int, default=16, help="block length B (bonus + B-1 masks)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="target layers to read features from (default: spread evenly over the target's layers, "
                        "as DFlash does)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask id (default: the tokenizer's <|MASK|>)")
    p.add_argument("--seq-len", type=int, default=160, help="sequence length (prompt + continuation)")
    p.add_argument("--prompt-len", type=int, default=32, help="corpus prompt tokens before the target continues")
    p.add_argument("--num-anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--greedy-frac", type=float, default=0.5, help="fraction of rows continued greedily")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled rows")
    p.add_argument("--gamma", type=float, default=7.0, help="slot loss decay exp(-(k-1)/gamma); <= 0: uniform")
    p.add_argument("--init-norm-gain", type=float, default=0.1, help="initial gain of the drafter's final norm")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (cosine schedule length)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    add_run_arguments(p, max_minutes=20.0, ckpt_every=20)
    p.add_argument("--log-every", type=int, default=5, help="log to OUT/train_log.jsonl every N steps")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the final metrics")
    add_output_arguments(p, "dtype of the saved drafter weights")
    return p


def add_d2a_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the dLLM-recipe options that the DFlash trainer's parser lacks (``--init``, ``--alpha``, ...)."""
    p.add_argument("--init", default=None, metavar="DIR|target",
                   help="dLLM recipes: initial weights: an SDAR checkpoint sharing the target's vocabulary, or "
                        "'target' (an SDAR copy of the target's own weights)")
    p.add_argument("--init-layers", type=int, default=None,
                   help="with --init target: keep only the first N target layers (a smaller, cheaper drafter)")
    p.add_argument("--alpha", type=float, default=1.01,
                   help="d2a-stage2: position weight base, slot i of R masked gets alpha^(R-i) (the paper saw 1.05 diverge)")
    p.add_argument("--max-masked", type=int, default=96, help="d2a-stage2: R ~ U(1, max) masked tokens per step")
    p.add_argument("--streak-ce", type=float, default=0.1, help="streak: weight of the auxiliary cross entropy")
    p.add_argument("--eval-prompts", type=int, default=8, help="dLLM recipes: held-out prompts for the model card")
    p.add_argument("--eval-new-tokens", type=int, default=48, help="dLLM recipes: tokens generated per held-out prompt")
    return p
