"""``spiffy tiny FAMILY OUTDIR``: write a tiny random checkpoint in the real file layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spiffy.errors import ConfigError
from spiffy.models.ar_drafters import make_tiny_dllm_drafter
from spiffy.models.registry import family_spec
from spiffy.models.tiny import TINY_FAMILIES, make_tiny

#: AR drafters written for a --target (besides the model families)
DRAFTER_CHOICES: tuple[str, ...] = ("dllm-drafter",)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``tiny`` subcommand parser."""
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
    if args.family == "dllm-drafter":
        if args.target is None:
            raise ConfigError("dllm-drafter needs --target DIR (a Qwen3 checkpoint, e.g. from `spiffy tiny qwen3 DIR`)")
        path = make_tiny_dllm_drafter(args.outdir, args.target, seed=args.seed, **overrides)
        return _report(args, path)
    if family_spec(args.family).drafter:
        if args.target is None:
            raise ConfigError(f"family {args.family} needs --target DIR (a Qwen3 checkpoint, e.g. from `spiffy tiny "
                              "qwen3 DIR`)")
        overrides["target"] = args.target
    elif args.target is not None:
        raise ConfigError("--target is only used with the drafters (dflash, dflash2, dllm-drafter)")
    return _report(args, make_tiny(args.family, args.outdir, seed=args.seed, **overrides))


def _report(args: argparse.Namespace, path: Path) -> int:
    """Print what was written."""
    print(f"wrote tiny {args.family} checkpoint (seed {args.seed}) to {path}")
    total = 0
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            size = f.stat().st_size
            total += size
            print(f"  {f.name:<40} {size:>10,d} bytes")
    print(f"  {'total':<40} {total:>10,d} bytes")
    return 0
