"""``spiffy calibrate``: calibrate a Spiffy draft graph for a diffusion LM and a decoding configuration.

Runs the baseline decoder on a prompt set (default: 25 MATH-500 + 25 MBPP prompts), records which (i, j) draft
formulas the real trajectory followed, selects ``--nodes`` graph nodes maximising the saved forwards, prints the
graph summary with the projected NFE reduction, and writes the graph file atomically (the exact command is
embedded in it). Same seed, same file (apart from the date).

Example::

    spiffy calibrate --model /tmp/tiny-llada --prompts default --out graph.json \\
        --gen-length 64 --block-length 32 --nodes 10

Use the same decoding flags with ``spiffy generate --graph graph.json``: a graph calibrated for another block
length, step count, threshold, remasking rule or cache mode is refused at load time.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from spiffy.cli.generate import add_decoding_arguments, config_from_args
from spiffy.distributed import join_data_parallel
from spiffy.embedded import default_dllm_path
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.prompts import load_prompts
from spiffy.selfspec.pruning import SCORES


_PARSER: argparse.ArgumentParser | None = None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``calibrate`` subparser."""
    global _PARSER
    parser = subparsers.add_parser(
        "calibrate",
        help="calibrate a Spiffy draft graph for a diffusion LM and decoding configuration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="diffusion LM checkpoint (LLaDA, Dream or SDAR): a directory or a Hub id ORG/NAME[@REVISION]")
    parser.add_argument("--prompts", default="default", metavar="FILE|NAME",
                        help="calibration prompts: a JSONL file with a 'prompt' field per line, or a named set "
                             "(default, default-math, default-code; default: %(default)s)")
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the graph (JSON; written atomically)")
    parser.add_argument("--nodes", type=int, default=10, metavar="D", help="graph nodes to select (default 10)")
    parser.add_argument("--max-prompts", type=int, default=None, metavar="N", help="use only the first N prompts")
    parser.add_argument("--objective", default="greedy", choices=("greedy", "cumfreq", "degree1", "exact"),
                        help="node selection: greedy expected saved forwards (default), the paper's cumulative-frequency "
                             "subgraph (cumfreq) or its degree-1 accumulation (degree1), or the exact optimum (exact, "
                             "integer programming; small calibrations)")
    parser.add_argument("--max-level", type=int, default=None, metavar="L",
                        help="deepest lookahead recorded (default: up to the block end). A small L (around the budget "
                             "D* you run) leaves nodes for branches instead of an ever deeper chain; pair it with "
                             "--score reach")
    parser.add_argument("--budget", type=int, default=None, metavar="D*",
                        help="tune the graph for D* drafts per step: build the default graph, one capped at "
                             "lookahead D* and FreeDave's chain, replay the runtime's pruning on the calibration "
                             "prompts with each score, keep the one that saves most at D* if it saves clearly more "
                             "than the chain, else the chain (records D*, shape and score; prints what each "
                             "candidate saved). Use the D* you will run")
    parser.add_argument("--score", default=None, choices=SCORES,
                        help="pruning score recorded in the graph, which generate/bench then run it with unless told "
                             "otherwise (default: none recorded, the runtime uses gm). reach suits graphs with branches")
    parser.add_argument("--i-max", type=int, default=None, metavar="I",
                        help="position-rank cap of the formulas (default: the block length)")
    parser.add_argument("--j-max", type=int, default=4, metavar="J", help="token-rank cap of the formulas (default 4)")
    parser.add_argument("--no-chat", action="store_true",
                        help="tokenize prompts as plain text (default: the tokenizer's chat template when it has one)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype: float32 (CPU default), float64, bfloat16, float16 or auto (config)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--json", action="store_true", help="print the graph file content instead of the text summary")
    add_decoding_arguments(parser)
    parser.set_defaults(handler=run)
    _PARSER = parser
    return parser


def canonical_command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> str:
    """``spiffy calibrate ...`` with every option spelled out (reproduces the run even if defaults change)."""
    parser = parser or _PARSER
    parts = ["spiffy", "calibrate"]
    if parser is None:
        return shlex.join(parts)
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public listing
        if not action.option_strings or action.dest in ("help", "handler", "no_progress", "json"):
            continue
        value = getattr(args, action.dest, None)
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value:
                parts.append(flag)
        elif value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy calibrate``; returns the exit status."""
    if not args.model:  # default: the embedded tiny dLLM shipped with the package
        args.model = default_dllm_path()
    prompts = load_prompts(args.prompts)  # fail fast on a bad prompt set, before loading the model
    cfg, extra = config_from_args(args)
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    model = load_model(args.model, dtype=args.dtype, device=str(dp.device))
    tokenizer = load_tokenizer(args.model)
    count = len(prompts) if args.max_prompts is None else min(len(prompts), int(args.max_prompts))
    print(f"spiffy calibrate: {count} prompt(s) x 1 configuration (the baseline decoder, {cfg.gen_length} positions "
          "each, recording every step's lookahead) = "
          f"{count} decodes; the progress bar shows the ETA", file=sys.stderr)
    graph = calibrate(
        model,
        tokenizer,
        prompts,
        cfg,
        nodes=args.nodes,
        max_level=args.max_level,
        i_max=args.i_max,
        j_max=args.j_max,
        objective=args.objective,
        score=args.score,
        budget=args.budget,
        max_prompts=args.max_prompts,
        seed=int(args.seed or 0),
        chat=not args.no_chat,
        progress=not args.no_progress,
        dataset=str(args.prompts),
        model_name=getattr(model, "name_or_path", None) or str(args.model),  # Hub snapshots: ORG/NAME@COMMIT
        command=canonical_command(args),
        config_overrides=extra or None,
        parallel=dp,
    )
    if not dp.is_main:  # every rank holds the same graph; rank 0 writes and prints it
        return 0
    graph.save(args.out)
    if args.json:
        print(graph.to_json(), end="")
    else:
        print(graph.summary())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
