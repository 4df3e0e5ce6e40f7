"""``spiffy graph``: inspect, validate and draw calibrated draft-graph files.

Actions::

    spiffy graph show FILE [--json]      # summary: calibrated for, levels, nodes, counts, projected reduction
    spiffy graph validate FILE           # schema + structure check (exit 0 if valid, 2 with the problem if not)
    spiffy graph render FILE [--out PNG] # layered drawing of the DAG (needs matplotlib)
    spiffy graph chain --depth K [--model DIR] [decoding flags] --out FILE
                                         # the uncalibrated chain of the K most confident next states (level l:
                                         # the l most confident masked positions take their most likely tokens);
                                         # FreeDave with K+1 draft steps = this chain run at --budget K
"""

from __future__ import annotations

import argparse
from typing import Any

from spiffy.cli.flags import DLLM_DECODING_FLAGS, add_decoding_arguments, add_threads_argument, plain_text

#: the flags each action reads (dest names); any other flag set by the user is refused
ACTION_FLAGS: dict[str, frozenset[str]] = {
    "show": frozenset({"json"}),
    "validate": frozenset(),
    "render": frozenset({"out", "dpi"}),
    "chain": frozenset({"out", "depth", "model", "threads", "temperature", "top_p", "top_k", "seed",
                        *DLLM_DECODING_FLAGS}),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``graph`` subparser (no torch import; the work is in :mod:`spiffy.cli.graph_run`)."""
    parser = subparsers.add_parser(
        "graph",
        help="inspect, validate or render a calibrated draft-graph file",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("show", "validate", "render", "chain"),
                        help="show: text summary; validate: check schema and structure; render: draw to PNG; "
                             "chain: write the chain graph (FreeDave's drafts) for a model and decoding flags")
    parser.add_argument("file", metavar="FILE", nargs="?", default=None,
                        help="graph file written by `spiffy calibrate` (show / validate / render)")
    parser.add_argument("--out", default=None, metavar="PNG|FILE",
                        help="render: output image (default: FILE with .png); chain: the graph file to write")
    parser.add_argument("--depth", type=int, default=None, metavar="K", help="chain: number of levels (draft states)")
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="chain: the dLLM the graph is for (default: the embedded demo dLLM)")
    parser.add_argument("--json", action="store_true", help="show: print the normalised file content as JSON")
    parser.add_argument("--dpi", type=int, default=120, help="render: image resolution (default 120)")
    add_threads_argument(parser)
    add_decoding_arguments(parser)  # chain: the decoding configuration the graph is compatible with
    parser.set_defaults(run="graph_run", command_parser=parser)
    return parser
