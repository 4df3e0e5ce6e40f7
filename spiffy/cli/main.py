"""Entry point of the ``spiffy`` command: dispatches to one module per subcommand.

Each subcommand module in :mod:`spiffy.cli` defines ``add_parser(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from spiffy._version import __version__
from spiffy.errors import SpiffyError

# subcommand name -> module, in the order `spiffy --help` lists them
SUBCOMMANDS: dict[str, str] = {
    "demo": "spiffy.cli.demo",
    "generate": "spiffy.cli.generate",
    "calibrate": "spiffy.cli.calibrate",
    "graph": "spiffy.cli.graph",
    "bench": "spiffy.cli.bench",
    "tiny": "spiffy.cli.tiny",
    "train-drafter": "spiffy.cli.train_drafter",
}

DESCRIPTION = """\
spiffy: lossless speculative decoding.

  Diffusion LLMs (LLaDA, Dream, SDAR): Spiffy self-speculation with calibrated draft graphs.
  Qwen3 targets: DDTree tree decoding with a DFlash block-diffusion drafter.

Every speculative path reproduces its baseline token for token; only the number of model calls changes.
"""

EPILOG = """\
examples:
  spiffy demo                                       # end-to-end tour on the embedded tiny models
  spiffy tiny llada /tmp/tiny-llada                 # write a tiny random LLaDA checkpoint
  spiffy generate --model /tmp/tiny-llada --prompt "def f(x):" --json
  spiffy calibrate --model /tmp/tiny-llada --prompts default --out graph.json
  spiffy generate --model /tmp/tiny-llada --prompt "def f(x):" --graph graph.json --budget 3
  spiffy graph show graph.json
  spiffy tiny qwen3 /tmp/q && spiffy tiny dflash /tmp/d --target /tmp/q
  spiffy generate --target /tmp/q --drafter /tmp/d --method ddtree --budget 64 --prompt "def f(x):" --json

Run `spiffy COMMAND --help` for the options of a command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spiffy", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"spiffy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not part of this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"subcommand {args.command!r} has no handler")
    try:
        return int(handler(args) or 0)
    except SpiffyError as exc:
        print(f"spiffy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`spiffy graph show F | head`): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not raise again
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
