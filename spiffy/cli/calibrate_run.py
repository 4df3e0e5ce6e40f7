"""``spiffy calibrate`` at run time (the parser, and what the flags mean: :mod:`spiffy.cli.calibrate`)."""

from __future__ import annotations

import argparse
import shlex
import sys

from spiffy.cli.flags import DLLM_DECODING_FLAGS
from spiffy.cli.graph_defaults import card_note, settle_settings
from spiffy.cli.runtime import check_output_path, default_device, set_threads
from spiffy.decoding import DecodeConfig
from spiffy.distributed import join_data_parallel
from spiffy.embedded import default_dllm_path
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.prompts import load_prompts

#: flags left out of the command recorded in the graph (they change what is printed, not the graph)
_NOT_RECORDED: tuple[str, ...] = ("help", "no_progress", "json", "threads")


def canonical_command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> str:
    """``spiffy calibrate ...`` with every option spelled out (reproduces the run even if defaults change)."""
    parser = parser or getattr(args, "command_parser", None)
    parts = ["spiffy", "calibrate"]
    if parser is None:
        return shlex.join(parts)
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public listing
        if not action.option_strings or action.dest in _NOT_RECORDED:
            continue
        value = getattr(args, action.dest, None)
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value:
                parts.append(flag)
        elif value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """Run ``spiffy calibrate``; returns the exit status."""
    check_output_path(args.out)  # before hours of calibration, not after
    if not args.model:  # default: the embedded tiny dLLM shipped with the package
        args.model = default_dllm_path()
    prompts = load_prompts(args.prompts)  # fail fast on a bad prompt set, before loading the model
    tokenizer = load_tokenizer(args.model)
    # one default per model: the settings `spiffy generate` and `spiffy bench dllm` run with, flag for flag
    settings = settle_settings(args, args.model, chat=False if args.no_chat else None,
                               has_template=bool(getattr(tokenizer, "chat_template", None)),
                               device=default_device(args.device))
    note = card_note("spiffy calibrate", args.model, settings)
    if note:
        print(note, file=sys.stderr)
    args.dtype, args.no_chat, cfg, extra = settings.dtype, not settings.chat, settings.config, settings.extra
    for name in DLLM_DECODING_FLAGS:  # the recorded command spells out every value, defaults included
        if getattr(args, name, None) is None and name in DecodeConfig.__dataclass_fields__:
            setattr(args, name, getattr(cfg, name))
    dp = join_data_parallel(args.device)  # under torchrun: prompts shared by rank; alone: one process
    model = load_model(args.model, dtype=args.dtype, device=str(dp.device))
    set_threads(args.threads, model)
    count = len(prompts) if args.max_prompts is None else min(len(prompts), int(args.max_prompts))
    print(f"spiffy calibrate: {count} prompt(s) x 1 configuration (the baseline decoder, {cfg.gen_length} positions "
          "each, recording every step's lookahead) = "
          f"{count} decodes; the progress bar shows the ETA", file=sys.stderr)
    graph = calibrate(
        model,
        tokenizer,
        prompts,
        cfg,
        nodes=args.nodes,
        max_level=args.max_level,
        i_max=args.i_max,
        j_max=args.j_max,
        objective=args.objective,
        score=args.score,
        budget=args.budget,
        max_prompts=args.max_prompts,
        seed=int(args.seed or 0),
        chat=not args.no_chat,
        progress=not args.no_progress,
        dataset=str(args.prompts),
        model_name=getattr(model, "name_or_path", None) or str(args.model),  # Hub snapshots: ORG/NAME@COMMIT
        command=canonical_command(args),
        config_overrides=extra or None,
        parallel=dp,
    )
    if not dp.is_main:  # every rank holds the same graph; rank 0 writes and prints it
        return 0
    graph.save(args.out)
    if args.json:
        print(graph.to_json(), end="")
    else:
        print(graph.summary())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
