"""The names and defaults the command line offers in ``--help``, without importing torch.

``spiffy --help`` and ``spiffy COMMAND --help`` build every parser; importing the library modules that define these
names would import torch and transformers (seconds of start-up). Each value here mirrors its home in the library
(named beside it); ``tests/test_cli_startup.py`` checks that every one still equals its home, so they cannot drift.
"""

from __future__ import annotations

#: Spiffy's pruning scores (home: ``spiffy.selfspec.pruning.SCORES``)
SCORES: tuple[str, ...] = ("gm", "product", "local", "count", "reach")
#: what each pruning score means, for --score help texts
SCORE_HELP = (
    "how the D drafts of a step are picked from the graph, by the current model probabilities of the tokens each "
    "draft fills in: gm (their geometric mean, smoothed with the drafts that extend it; the usual default), product "
    "(their product: the draft's probability), local (the geometric mean alone), count (how often calibration saw "
    "the draft, ignoring the probabilities), reach (the product weighted by that frequency: the chance the decoder "
    "passes through the draft; suits graphs with branches). Default: the score the graph was calibrated with, else gm"
)
#: Spiffy drafts kept per step when neither the user nor the graph says (``spiffy.selfspec.pruning.DEFAULT_BUDGET``)
DEFAULT_SPIFFY_BUDGET = 3

#: AR-side methods in registry order (home: ``spiffy.arspec.methods.METHODS``)
AR_METHODS: tuple[str, ...] = ("ar", "dflash", "ddtree", "dflash2", "ddtree-dflash2", "ddtree-dllm", "deer", "specdiff")
#: acceptance rules of the AR side (home: ``spiffy.arspec.methods.ACCEPT_RULES``)
ACCEPT_RULES: tuple[str, ...] = ("coupled", "rejection")
#: DDTree nodes per round when none is given (home: ``spiffy.arspec.config.DEFAULT_BUDGET``)
DEFAULT_TREE_BUDGET = 64

#: families ``spiffy tiny`` writes (home: ``spiffy.models.tiny.TINY_FAMILIES``)
TINY_FAMILIES: tuple[str, ...] = ("llada", "llada_moe", "dream", "sdar", "llada2", "sdar_moe", "qwen3", "qwen3_moe",
                                  "qwen2", "llama", "mistral", "qwen3_5", "qwen3_next", "fast_dllm_v2", "dflash", "dflash2")
#: dLLM-drafter training recipes (home: ``spiffy.train.d2a.RECIPES``)
D2A_RECIPES: tuple[str, ...] = ("d2a-stage1", "d2a-stage2", "streak")
#: DDTree budgets of ``spiffy bench overheads`` (home: ``spiffy.bench.overheads.DEFAULT_BUDGETS``)
OVERHEAD_BUDGETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)

#: --quantize names (home: ``spiffy.models.quantize.QUANTIZATIONS``; int4 also takes :G, its group size)
QUANTIZE_NAMES: tuple[str, ...] = ("int8", "int4", "fp8", "bnb-int8", "bnb-nf4", "bnb-fp4")

__all__ = [
    "ACCEPT_RULES",
    "AR_METHODS",
    "D2A_RECIPES",
    "DEFAULT_SPIFFY_BUDGET",
    "DEFAULT_TREE_BUDGET",
    "OVERHEAD_BUDGETS",
    "QUANTIZE_NAMES",
    "SCORES",
    "SCORE_HELP",
    "TINY_FAMILIES",
]
