"""``spiffy calibrate``: calibrate a Spiffy draft graph for a diffusion LM and a decoding configuration.

A draft graph lists the states the decoder tends to reach next. Each node is a draft: "the i-th most confident
masked position takes its j-th most likely token" (and so on for several positions), written (i, j). Calibration
runs the baseline decoder on a prompt set (default: 25 MATH-500 + 25 MBPP prompts), records which drafts the real
trajectory followed, keeps the ``--nodes`` drafts that would have saved the most model calls, prints the graph
summary with the projected reduction in model calls (NFE), and writes the graph file atomically (the exact
command is embedded in it). Same seed, same file (apart from the date).

At run time Spiffy verifies ``--budget D`` of these drafts together with the real state in each model call
(a batch of 1 + D rows) and keeps a draft only when it is exactly the state the baseline produces.

Example::

    spiffy calibrate --model /tmp/tiny-llada --prompts default --out graph.json \\
        --gen-length 64 --block-length 32 --nodes 10

Use the same decoding flags with ``spiffy generate --graph graph.json``: a graph calibrated for another block
length, step count, threshold, remasking rule or cache mode is refused at load time.
"""

from __future__ import annotations

import argparse
from typing import Any

from spiffy.cli.flags import add_decoding_arguments, add_threads_argument, plain_text
from spiffy.cli.names import SCORE_HELP, SCORES


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``calibrate`` subparser (no torch import; the work is in :mod:`spiffy.cli.calibrate_run`)."""
    parser = subparsers.add_parser(
        "calibrate",
        help="calibrate a Spiffy draft graph for a diffusion LM and decoding configuration",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="diffusion LM checkpoint (LLaDA, Dream or SDAR): a directory or a Hub id "
                             "ORG/NAME[@REVISION] (default: the small SDAR model embedded in the package)")
    parser.add_argument("--prompts", default="default", metavar="FILE|NAME",
                        help="calibration prompts: a JSONL file with a 'prompt' field per line, or a named set "
                             "(default, default-math, default-code; default: %(default)s)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="where to write the graph (JSON; written atomically; the location is checked first)")
    parser.add_argument("--nodes", type=int, default=10, metavar="N", help="graph nodes (drafts) to keep (default 10)")
    parser.add_argument("--max-prompts", type=int, default=None, metavar="N", help="use only the first N prompts")
    parser.add_argument("--objective", default="greedy", choices=("greedy", "cumfreq", "degree1", "exact"),
                        help="how the nodes are chosen: greedy (repeatedly add the draft that saves the most model "
                             "calls given those already kept; default), cumfreq (repeatedly add the draft the "
                             "recorded trajectories passed through most often: the paper's cumulative-frequency "
                             "rule), degree1 (as cumfreq, counting also how often the draft's parents were passed "
                             "through: the paper's degree-1 rule), or exact (the best set by integer programming; "
                             "small calibrations)")
    parser.add_argument("--max-level", type=int, default=None, metavar="L",
                        help="longest draft recorded, in steps ahead of the real state (default: up to the block "
                             "end). A small L (around the --budget you run) leaves nodes for alternative drafts "
                             "instead of an ever longer chain; pair it with --score reach")
    parser.add_argument("--budget", type=int, default=None, metavar="D",
                        help="tune the graph for D drafts verified per model call, the --budget you will run "
                             "generate with: three candidate graphs are built from the same trajectories (the "
                             "default one, one limited to drafts at most D steps ahead, and the chain of the D most "
                             "confident next states, FreeDave's drafts), the run-time selection is replayed on the "
                             "calibration prompts with each score, and the candidate that saves the most model calls "
                             "is kept if it saves clearly more than the chain (by more than two standard errors over the "
                             "prompts), else the chain; the graph "
                             "records D, its shape and score, and `spiffy graph show` prints what each candidate saved")
    parser.add_argument("--score", default=None, choices=SCORES,
                        help="the score recorded in the graph for generate/bench to run it with. " + SCORE_HELP)
    parser.add_argument("--i-max", type=int, default=None, metavar="I",
                        help="drafts name at most the I most confident masked positions (default: the block length)")
    parser.add_argument("--j-max", type=int, default=4, metavar="J",
                        help="drafts use at most the J most likely tokens of a position (default 4)")
    parser.add_argument("--no-chat", action="store_true",
                        help="tokenize prompts as plain text (default: the prompt format of the model card, i.e. of the "
                             "graphs shipped with the model, else the tokenizer's chat template when it has one: "
                             "the default of `spiffy generate` and `spiffy bench dllm` too)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32, float64, bfloat16, float16 or auto (the checkpoint's). Default: the "
                             "model card's (the graphs shipped with the model), else float32 on CPU and the "
                             "checkpoint's on an accelerator, as in `spiffy generate`")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--json", action="store_true", help="print the graph file content instead of the text summary")
    add_threads_argument(parser)
    add_decoding_arguments(parser, defaults="the model card's (the configuration of a graph shipped with the model, "
                           "as in `spiffy generate`), else the defaults below")
    parser.set_defaults(run="calibrate_run", command_parser=parser)
    return parser
