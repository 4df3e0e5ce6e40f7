"""``spiffy train-drafter``: train a DFlash block-diffusion drafter for a frozen Qwen3 target.

Example::

    spiffy train-drafter --target /path/to/qwen3 --out runs/drafter --steps 400 --block-size 16 --num-layers 2
"""

from __future__ import annotations

import argparse

HELP = "train a DFlash drafter (block diffusion) on a frozen Qwen3 target"

EPILOG = """\
The drafter is trained on continuations the target generates from Python standard-library prompts (built offline
into ~/.cache/spiffy/corpus unless --corpus is given), with random anchors, blocks of --block-size, same-position
targets and position-decayed loss weights. Re-run with --resume to continue an interrupted run. The drafter is
written to OUT/model (config.json with dflash_config + safetensors) and loads with spiffy.models.load_drafter.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``train-drafter`` subparser."""
    from spiffy.train.drafter import add_arguments

    parser = subparsers.add_parser("train-drafter", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run drafter training; returns 0 on success."""
    from spiffy.train.drafter import train

    train(args)
    return 0
