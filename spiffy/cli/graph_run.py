"""``spiffy graph`` at run time (the parser and the actions: :mod:`spiffy.cli.graph`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spiffy.cli.flags import refuse
from spiffy.cli.graph import ACTION_FLAGS
from spiffy.cli.runtime import check_output_path, decode_config, set_threads
from spiffy.embedded import embedded_model_path
from spiffy.errors import ConfigError
from spiffy.models import load_model
from spiffy.models.hub import checkpoint_dir
from spiffy.selfspec.freedave import chain_graph_for
from spiffy.selfspec.graph import load_graph


def write_chain(args: argparse.Namespace) -> int:
    """``spiffy graph chain``: build the top-k chain for the model and decoding flags and write it to ``--out``."""
    if args.depth is None or not args.out:
        raise ConfigError("spiffy graph chain needs --depth K and --out FILE; fix: e.g. "
                          "`spiffy graph chain --depth 3 --gen-length 64 --block-length 32 --steps 64 --out chain.json`")
    if args.file is not None:
        raise ConfigError(f"spiffy graph chain takes no FILE (got {args.file}); fix: name the output with --out FILE")
    check_output_path(args.out)
    model_dir = checkpoint_dir(args.model) if args.model else embedded_model_path("dllm")
    cfg, extra = decode_config(args)
    model = load_model(model_dir, dtype="float32", device="cpu")
    set_threads(args.threads, model)
    graph = chain_graph_for(model, cfg, args.depth, **extra)
    graph.save(args.out)
    print(f"wrote {args.out}: top-k chain of depth {args.depth} (FreeDave with {args.depth + 1} draft steps at "
          f"--budget {args.depth})", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy graph``; returns the exit status (GraphError propagates to the CLI's error handler)."""
    refuse(set(getattr(args, "given", set())) - ACTION_FLAGS[args.action], f"not read by `spiffy graph {args.action}`",
           "drop them (show: --json; render: --out, --dpi; chain: --out, --depth, --model, --threads and the "
           "decoding flags)", getattr(args, "command_parser", None))
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
        check_output_path(out)
        graph.render(out, dpi=args.dpi)
        print(f"wrote {out}", file=sys.stderr)
    return 0
