"""``spiffy graph``: inspect, validate and draw calibrated draft-graph files.

Actions::

    spiffy graph show FILE [--json]      # summary: calibrated for, levels, nodes, counts, projected reduction
    spiffy graph validate FILE           # schema + structure check (exit 0 if valid, 2 with the problem if not)
    spiffy graph render FILE [--out PNG] # layered drawing of the DAG (needs matplotlib)
    spiffy graph chain --depth K [--model DIR] [decoding flags] --out FILE
                                         # the uncalibrated top-k chain (level l = the l most confident positions,
                                         # argmax tokens); FreeDave with K+1 draft steps = this chain at --budget K
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from spiffy.cli.generate import add_decoding_arguments, config_from_args
from spiffy.embedded import embedded_model_path
from spiffy.errors import ConfigError
from spiffy.models import load_model
from spiffy.models.hub import checkpoint_dir
from spiffy.selfspec.freedave import chain_graph_for
from spiffy.selfspec.graph import load_graph


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``graph`` subparser."""
    parser = subparsers.add_parser(
        "graph",
        help="inspect, validate or render a calibrated draft-graph file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("show", "validate", "render", "chain"),
                        help="show: text summary; validate: check schema and structure; render: draw to PNG; "
                             "chain: write the top-k chain graph (FreeDave's drafts) for a model and decoding flags")
    parser.add_argument("file", metavar="FILE", nargs="?", default=None,
                        help="graph file written by `spiffy calibrate` (show / validate / render)")
    parser.add_argument("--out", default=None, metavar="PNG|FILE",
                        help="render: output image (default: FILE with .png); chain: the graph file to write")
    parser.add_argument("--depth", type=int, default=None, metavar="K", help="chain: number of levels (draft states)")
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="chain: the dLLM the graph is for (default: the embedded demo dLLM)")
    parser.add_argument("--json", action="store_true", help="show: print the normalised file content as JSON")
    parser.add_argument("--dpi", type=int, default=120, help="render: image resolution (default 120)")
    add_decoding_arguments(parser)  # chain: the decoding configuration the graph is compatible with
    parser.set_defaults(handler=run)
    return parser


def write_chain(args: argparse.Namespace) -> int:
    """``spiffy graph chain``: build the top-k chain for the model and decoding flags and write it to ``--out``."""
    if args.depth is None or not args.out:
        raise ConfigError("spiffy graph chain needs --depth K and --out FILE; fix: e.g. "
                          "`spiffy graph chain --depth 3 --gen-length 64 --block-length 32 --steps 64 --out chain.json`")
    model_dir = checkpoint_dir(args.model) if args.model else embedded_model_path("dllm")
    cfg, extra = config_from_args(args)
    graph = chain_graph_for(load_model(model_dir, dtype="float32", device="cpu"), cfg, args.depth, **extra)
    graph.save(args.out)
    print(f"wrote {args.out}: top-k chain of depth {args.depth} (FreeDave with {args.depth + 1} draft steps at "
          f"--budget {args.depth})", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy graph``; returns the exit status (GraphError propagates to the CLI's error handler)."""
    if args.action == "chain":
        return write_chain(args)
    if args.file is None:
        raise ConfigError(f"spiffy graph {args.action} needs a graph FILE; fix: spiffy graph {args.action} FILE")
    graph = load_graph(args.file)
    if args.action == "show":
        print(graph.to_json() if args.json else graph.summary(), end="" if args.json else "\n")
    elif args.action == "validate":
        per_level = ", ".join(f"L{lvl}: {len(ns)}" for lvl, ns in graph.levels().items()) or "empty"
        print(f"{args.file}: valid spiffy draft graph (format version 1), {len(graph)} node(s) ({per_level})")
    else:
        out = Path(args.out) if args.out else Path(args.file).with_suffix(".png")
        graph.render(out, dpi=args.dpi)
        print(f"wrote {out}", file=sys.stderr)
    return 0
