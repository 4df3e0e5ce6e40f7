"""``spiffy tiny FAMILY OUTDIR``: write a tiny random checkpoint in the real file layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spiffy.errors import ConfigError
from spiffy.models.tiny import TINY_FAMILIES, make_tiny


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``tiny`` subcommand parser."""
    parser = subparsers.add_parser(
        "tiny",
        help="write a tiny random checkpoint (LLaDA, Dream, SDAR, Qwen3, DFlash) for tests and demos",
        description=(
            "Write a tiny random checkpoint in the real layout: config.json (official auto_map), sharded "
            "safetensors + index, generation_config.json and an offline byte-level BPE tokenizer with the "
            "family's special tokens. The same --seed gives byte-identical weights."
        ),
    )
    parser.add_argument("family", choices=TINY_FAMILIES, help="model family to build")
    parser.add_argument("outdir", type=Path, help="directory to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed (default: 0)")
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="for family dflash: the Qwen3 target checkpoint the drafter is sized to (e.g. from `spiffy tiny qwen3`)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (VALUE parsed as JSON when possible), e.g. --set num_hidden_layers=3; repeatable",
    )
    parser.set_defaults(handler=run)
    return parser


def _parse_overrides(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Build the checkpoint and print what was written."""
    overrides = _parse_overrides(args.overrides)
    if args.family == "dflash":
        if args.target is None:
            raise ConfigError("family dflash needs --target DIR (a Qwen3 checkpoint, e.g. from `spiffy tiny qwen3 DIR`)")
        overrides["target"] = args.target
    elif args.target is not None:
        raise ConfigError("--target is only used with family dflash")
    path = make_tiny(args.family, args.outdir, seed=args.seed, **overrides)
    print(f"wrote tiny {args.family} checkpoint (seed {args.seed}) to {path}")
    total = 0
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            size = f.stat().st_size
            total += size
            print(f"  {f.name:<40} {size:>10,d} bytes")
    print(f"  {'total':<40} {total:>10,d} bytes")
    return 0
