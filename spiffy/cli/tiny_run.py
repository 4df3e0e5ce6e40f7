"""``spiffy tiny`` at run time (the parser: :mod:`spiffy.cli.tiny`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spiffy.cli.runtime import set_threads
from spiffy.errors import ConfigError
from spiffy.models.ar_drafters import make_tiny_dllm_drafter
from spiffy.models.registry import family_spec
from spiffy.models.tiny import make_tiny


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
    set_threads(1 if args.threads is None else args.threads)
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
