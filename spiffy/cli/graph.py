"""``spiffy graph``: inspect, validate and draw calibrated draft-graph files.

Actions::

    spiffy graph show FILE [--json]      # summary: calibrated for, levels, nodes, counts, projected reduction
    spiffy graph validate FILE           # schema + structure check (exit 0 if valid, 2 with the problem if not)
    spiffy graph render FILE [--out PNG] # layered drawing of the DAG (needs matplotlib)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from spiffy.selfspec.graph import load_graph


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``graph`` subparser."""
    parser = subparsers.add_parser(
        "graph",
        help="inspect, validate or render a calibrated draft-graph file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("show", "validate", "render"),
                        help="show: text summary; validate: check schema and structure; render: draw to PNG")
    parser.add_argument("file", metavar="FILE", help="graph file written by `spiffy calibrate`")
    parser.add_argument("--out", default=None, metavar="PNG", help="render: output image (default: FILE with .png)")
    parser.add_argument("--json", action="store_true", help="show: print the normalised file content as JSON")
    parser.add_argument("--dpi", type=int, default=120, help="render: image resolution (default 120)")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy graph``; returns the exit status (GraphError propagates to the CLI's error handler)."""
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
