"""``spiffy tiny FAMILY OUTDIR``: write a tiny random checkpoint in the real file layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from spiffy.cli.flags import add_threads_argument
from spiffy.cli.names import TINY_FAMILIES

#: AR drafters written for a --target (besides the model families)
DRAFTER_CHOICES: tuple[str, ...] = ("dllm-drafter",)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``tiny`` subcommand parser (no torch import; the work is in :mod:`spiffy.cli.tiny_run`)."""
    parser = subparsers.add_parser(
        "tiny",
        help="write a tiny random checkpoint (LLaDA, Dream, SDAR, Qwen3, DFlash, DFlash2, dLLM drafter) for tests and demos",
        description=(
            "Write a tiny random checkpoint in the real layout: config.json (official auto_map), sharded "
            "safetensors + index, generation_config.json and an offline byte-level BPE tokenizer with the "
            "family's special tokens. The same --seed gives byte-identical weights."
        ),
    )
    parser.add_argument("family", choices=TINY_FAMILIES + DRAFTER_CHOICES,
                        help="model family to build (dllm-drafter: a tiny SDAR drafter sharing --target's tokenizer)")
    parser.add_argument("outdir", type=Path, help="directory to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed (default: 0)")
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="for dflash, dflash2 and dllm-drafter: the Qwen3 target checkpoint the drafter is made for (e.g. from "
             "`spiffy tiny qwen3`)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (VALUE parsed as JSON when possible), e.g. --set num_hidden_layers=3; repeatable",
    )
    add_threads_argument(parser, "CPU threads torch may use while writing (default 1: the checkpoints are tiny; 0 = "
                                 "torch's default); the weights do not depend on it")
    parser.set_defaults(run="tiny_run", command_parser=parser)
    return parser
