"""``spiffy generate``: decode one prompt (or a batch: ``--prompt`` repeated) with a diffusion LM (baseline or
Spiffy) or with a Qwen3 target and a drafter (DDTree, DFlash, DEER, SpecDiff-2, plain AR).

This module only builds the parser (no torch import: ``--help`` is instant); the work is in
:mod:`spiffy.cli.generate_run` (dLLM mode and the mode choice) and :mod:`spiffy.cli.generate_ar` (AR mode).
"""

from __future__ import annotations

import argparse
from typing import Any

from spiffy.cli.flags import (
    add_ar_arguments,
    add_batch_invariant_argument,
    add_decoding_arguments,
    add_threads_argument,
)
from spiffy.cli.names import DEFAULT_SPIFFY_BUDGET, SCORE_HELP, SCORES
from spiffy.cli.placement import add_placement_arguments

DESCRIPTION = """\
Decode one prompt, or several as one batch (repeat --prompt; with --json one JSON object per prompt, in order).

  dLLM mode (default):  spiffy generate --prompt TEXT [--model DIR] [--graph FILE|NAME] [decoding flags]
  AR mode:              spiffy generate --prompt TEXT --method ddtree|dflash|deer|specdiff|ar
                                        [--target DIR --drafter DIR] [--tree-budget N] [--max-new-tokens N]

dLLM mode decodes with a diffusion LM: without --model the small model embedded in the package (a 4M-parameter
SDAR code model), with the configuration of its shipped draft graph (64 positions, blocks of 32, one token per
step) and Spiffy self-speculation: the same tokens as the baseline decoder, fewer model calls.

AR mode starts with --target, --drafter or --method: a Qwen3 target decodes token by token and a drafter proposes
continuations the target verifies in one forward. --method without --target uses the embedded target and its
drafter. Every speculative output equals plain AR's (with --accept rejection: in distribution).

A flag that does not apply to the chosen mode or method is refused (exit 2), never ignored.
--json prints one JSON object (tokens, text, model calls, seconds, configuration) on stdout; the progress bar
goes to stderr.
"""

#: dest names of the flags that only dLLM mode reads (besides the decoding flags)
DLLM_ONLY: tuple[str, ...] = ("model", "graph", "budget", "score")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``generate`` subparser."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a diffusion LM (baseline or Spiffy) or a Qwen3 target with a drafter (DDTree, ...)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text, tokenized as is (see --chat); must not be empty. Repeat it to decode several "
                             "prompts as one batch (with --json: one JSON object per prompt, in order)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the prompt in the tokenizer's chat template (default: on when the tokenizer has one, "
                             "except where the model card, the graphs shipped with a dLLM, records raw prompts; "
                             "--graph never changes it)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (tokens, text, nfe = model calls, seconds, steps, config) "
                             "instead of the text")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32, float64, bfloat16, float16 or auto (the checkpoint's). Default: a "
                             "dLLM's model card dtype (its shipped graphs), else float32 on CPU and the checkpoint's on "
                             "an accelerator; --graph never changes it")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_argument(parser)
    add_batch_invariant_argument(parser)
    d = parser.add_argument_group("dLLM mode (diffusion LMs: LLaDA, Dream, SDAR)")
    d.add_argument("--model", default=None, metavar="DIR|ID",
                   help="diffusion LM checkpoint (LLaDA, Dream or SDAR): a directory or a Hub id ORG/NAME[@REVISION] "
                        "(default: the small SDAR model embedded in the package)")
    d.add_argument("--graph", default=None, metavar="FILE|NAME|auto|freedave:K|ssd:K|none",
                   help="draft graph for Spiffy (made by `spiffy calibrate`): a file, the name of a graph shipped with "
                        "the model (e.g. tiny-sdar-s1), auto (the shipped graph calibrated for these decoding flags), "
                        "freedave:K (FreeDave: the K most confident next states as a chain, no calibration), ssd:K (SSD's "
                        "self-drafted path, K states per forward), or none "
                        "(the baseline decoder). Default: auto when the model ships graphs (the embedded one does), "
                        "else none. The graph changes speed, never tokens: unset decoding flags, --dtype and --chat take "
                        "the model card's values (a shipped graph's configuration) with or without it; a graph "
                        "calibrated for other decoding flags is refused with the flags it needs")
    d.add_argument("--budget", type=int, default=None, metavar="D",
                   help="drafts per step: how many draft states of the graph are verified in each model call "
                        f"(the call's batch is 1 + D rows; default: the D the graph was tuned for, else "
                        f"{DEFAULT_SPIFFY_BUDGET}; at most the graph's node count)")
    d.add_argument("--score", default=None, choices=SCORES,
                   help=SCORE_HELP)
    add_placement_arguments(parser)
    add_decoding_arguments(parser, defaults="the model card's (the configuration of a graph shipped with the model, "
                                            "whatever --graph names), else the defaults below")
    add_ar_arguments(parser)
    parser.set_defaults(run="generate_run", command_parser=parser)
    return parser
