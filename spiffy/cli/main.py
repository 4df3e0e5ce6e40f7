"""Entry point of the ``spiffy`` command: dispatches to one module per subcommand.

Each subcommand has a parser module in :mod:`spiffy.cli` that defines ``add_parser(subparsers)`` and imports
neither torch nor transformers, so ``spiffy --help``, ``spiffy --version`` and ``spiffy COMMAND --help`` start in
a fraction of a second. The parser records, with ``set_defaults(run=NAME, command_parser=PARSER)``, the module of
:mod:`spiffy.cli` that does the work; :func:`main` imports it only when the command runs and calls its
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from spiffy._version import __version__
from spiffy.cli.flags import given
from spiffy.errors import SpiffyError

#: the package of the run modules (``run=NAME`` names ``spiffy.cli.NAME``)
CLI_PACKAGE = "spiffy.cli"
#: attributes main() adds to the parsed arguments (not flags; a command that records its flags leaves them out)
CLI_INTERNAL: tuple[str, ...] = ("command", "run", "command_parser", "given", "bench_parser")

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

  Diffusion LLMs (LLaDA, Dream, SDAR): Spiffy self-speculation. A draft graph, calibrated offline, predicts the
    states the decoder will reach next; each model call verifies the real state and a few drafts as one batch.
  Qwen3 targets with a drafter: DDTree (a tree of drafted continuations verified in one forward), DFlash (the
    drafter's best chain), DEER and SpecDiff-2 (diffusion drafters), plain AR.

Every speculative path reproduces its baseline token for token; only the number of model calls changes.
Without --model / --target the small models embedded in the package are used.
"""

EPILOG = """\
examples:
  spiffy demo                                       # end-to-end tour on the embedded tiny models
  spiffy generate --prompt "def add(a, b):"         # the embedded diffusion LM with Spiffy and its shipped graph
  spiffy generate --method ddtree --prompt "def add(a, b):"   # the embedded Qwen3 target + DFlash drafter
  spiffy generate --method deer --prompt "def add(a, b):"     # ... + its diffusion drafter (also: specdiff)
  spiffy tiny llada /tmp/tiny-llada                 # write a tiny random LLaDA checkpoint
  spiffy calibrate --model /tmp/tiny-llada --prompts default --out graph.json
  spiffy generate --model /tmp/tiny-llada --prompt "def f(x):" --graph graph.json --budget 3
  spiffy graph show graph.json
  spiffy tiny qwen3 /tmp/q && spiffy tiny dflash /tmp/d --target /tmp/q
  spiffy generate --target /tmp/q --drafter /tmp/d --method ddtree --tree-budget 64 --prompt "def f(x):" --json

Run `spiffy COMMAND --help` for the options of a command.
"""


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``spiffy generate: error: <problem>; see `spiffy generate --help` `` (exit 2)
    instead of the whole usage block. Subcommand parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
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
    run_module = getattr(args, "run", None)
    if run_module is None:
        parser.error(f"subcommand {args.command!r} has no run module")
    args.given = given(args, args.command_parser)  # before a command fills in defaults
    try:
        return int(importlib.import_module(f"{CLI_PACKAGE}.{run_module}").run(args) or 0)
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
