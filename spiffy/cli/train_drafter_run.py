"""``spiffy train-drafter`` at run time (the parser and the recipes: :mod:`spiffy.cli.train_drafter`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spiffy.cli.runtime import check_output_path
from spiffy.train import d2a, drafter
from spiffy.train.corpus import default_cache_dir

#: attributes the command line adds to the parsed flags (left out of the training state, which records the flags)
_CLI_ATTRIBUTES: tuple[str, ...] = ("command", "run", "command_parser", "given")


def announce_corpus(corpus: str | None) -> Path:
    """Say on stderr where the prompt corpus lives and whether it is built now (an 8 MB cache in the user's home
    directory is not written silently)."""
    where = Path(corpus).expanduser() if corpus else default_cache_dir()
    if (where / "manifest.json").is_file():
        print(f"spiffy train-drafter: prompt corpus: {where} (cached)", file=sys.stderr)
    else:
        print(f"spiffy train-drafter: building the prompt corpus from this Python's standard library into {where} "
              "(about 8 MB, reused by later runs; --corpus DIR or $SPIFFY_CACHE puts it elsewhere)", file=sys.stderr)
    return where


def run(args: argparse.Namespace) -> int:
    """Run drafter training; returns 0 on success."""
    check_output_path(args.out, directory=True)
    flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _CLI_ATTRIBUTES})
    announce_corpus(flags.corpus)  # every recipe draws its prompts from it
    if flags.recipe == "dflash":
        drafter.train(flags)
    else:
        d2a.train(flags)
    return 0
