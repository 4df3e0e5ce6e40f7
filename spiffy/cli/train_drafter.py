"""``spiffy train-drafter``: train a drafter for a frozen Qwen3 target: a DFlash block-diffusion drafter (default)
or a dLLM drafter (``--recipe d2a-stage1|d2a-stage2|streak``, DEER / SpecDiff-2).

Example::

    spiffy train-drafter --target /path/to/qwen3 --out runs/drafter --steps 400 --block-size 16 --num-layers 2
    spiffy train-drafter --recipe d2a-stage1 --init target --target /path/to/qwen3 --out runs/d2a1 --steps 200
    spiffy train-drafter --recipe d2a-stage2 --init runs/d2a1/model --target /path/to/qwen3 --out runs/d2a2
"""

from __future__ import annotations

import argparse

from spiffy.train import d2a, drafter

HELP = "train a drafter (DFlash block diffusion, or a dLLM via D2A / streak distillation) for a frozen Qwen3 target"

EPILOG = """\
The drafter is trained on continuations the target generates from Python standard-library prompts (built offline
into ~/.cache/spiffy/corpus unless --corpus is given). Re-run with --resume to continue an interrupted run.

--recipe dflash (default): random anchors, blocks of --block-size, same-position targets and position-decayed
loss weights; the DFlash drafter is written to OUT/model (config.json with dflash_config + safetensors) and loads
with spiffy.models.load_drafter.

--recipe d2a-stage1 | d2a-stage2 | streak: an SDAR-layout dLLM drafter initialised from --init (a dLLM checkpoint
sharing the target's vocabulary, or 'target' for a copy of the target's weights), trained with DEER's
continuation distillation (stage 1), scribe refinement (stage 2: the last R ~ U(1, --max-masked) tokens masked,
weights alpha^(R-i)) or SpecDiff-2's streak distillation; written to OUT/model (SDAR config with drafter_config),
with MODEL_CARD.md reporting the held-out DEER acceptance length.
"""

RECIPE_CHOICES: tuple[str, ...] = ("dflash",) + d2a.RECIPES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``train-drafter`` subparser."""
    parser = subparsers.add_parser("train-drafter", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=RECIPE_CHOICES, default="dflash",
                        help="dflash (DFlash drafter, default), or a dLLM-drafter recipe: d2a-stage1, d2a-stage2, streak")
    drafter.add_arguments(parser)
    d2a.add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run drafter training; returns 0 on success."""
    if getattr(args, "recipe", "dflash") == "dflash":
        drafter.train(args)
    else:
        d2a.train(args)
    return 0
