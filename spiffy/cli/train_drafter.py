"""``spiffy train-drafter``: train a drafter for a frozen Qwen3 target: a DFlash block-diffusion drafter (default)
or a dLLM drafter (``--recipe d2a-stage1|d2a-stage2|streak``, DEER / SpecDiff-2).

Example::

    spiffy train-drafter --target /path/to/qwen3 --out runs/drafter --steps 400 --block-size 16 --num-layers 2
    spiffy train-drafter --recipe d2a-stage1 --init target --target /path/to/qwen3 --out runs/d2a1 --steps 200
    spiffy train-drafter --recipe d2a-stage2 --init runs/d2a1/model --target /path/to/qwen3 --out runs/d2a2
"""

from __future__ import annotations

import argparse

from spiffy.train.arguments import RECIPES, add_d2a_arguments, add_drafter_arguments

HELP = "train a drafter (DFlash block diffusion, or a dLLM via D2A / streak distillation) for a frozen Qwen3 target"

EPILOG = """\
The drafter is trained on continuations the target generates from Python standard-library prompts. The prompt
corpus (about 8 MB) is built once from this Python's standard library into $SPIFFY_CACHE/corpus or
~/.cache/spiffy/corpus (the command says which, and whether it reuses it) unless --corpus DIR is given. Re-run with
--resume to continue an interrupted run.

--recipe dflash (default): random anchors, blocks of --block-size, same-position targets and position-decayed
loss weights; the DFlash drafter is written to OUT/model (config.json with dflash_config + safetensors) and loads
with spiffy.models.load_drafter.

--recipe d2a-stage1 | d2a-stage2 | streak: an SDAR-layout dLLM drafter initialised from --init (a dLLM checkpoint
sharing the target's vocabulary, or 'target' for a copy of the target's weights), trained with DEER's
continuation distillation (stage 1), scribe refinement (stage 2: the last R ~ U(1, --max-masked) tokens masked,
weights alpha^(R-i)) or SpecDiff-2's streak distillation; written to OUT/model (SDAR config with drafter_config),
with MODEL_CARD.md reporting the held-out DEER acceptance length.
"""

RECIPE_CHOICES: tuple[str, ...] = ("dflash",) + RECIPES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Create the ``train-drafter`` subparser (no torch import; training runs in :mod:`spiffy.cli.train_drafter_run`)."""
    parser = subparsers.add_parser("train-drafter", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=RECIPE_CHOICES, default="dflash",
                        help="dflash (DFlash drafter, default), or a dLLM-drafter recipe: d2a-stage1, d2a-stage2, streak")
    add_drafter_arguments(parser)
    add_d2a_arguments(parser)
    parser.set_defaults(run="train_drafter_run", command_parser=parser)
    return parser
