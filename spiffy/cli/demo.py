"""``spiffy demo``: a small end-to-end tour on the embedded tiny models (or checkpoints given by path).

Decodes a few short code prompts with a diffusion LM (the baseline decoder vs Spiffy self-speculation) and with a
Qwen3 target (plain AR vs DFlash and DDTree with its DFlash drafter; with a diffusion drafter also DEER, SpecDiff-2
and DDTree over the diffusion drafter's per-position distributions). It prints the generated text and two tables:
for the diffusion LM the model calls (NFE), their reduction, tokens/s, speedup and whether every output equals the
baseline's; for the AR target tau (tokens per target forward), speedup and the same check; then a legend of the
columns and a note on CPU versus GPU wall-clock. Without arguments it uses the models shipped inside the package;
``--model --graph --target --drafter --dllm-drafter`` replace them. When no calibrated graph is available for the
diffusion LM, one is calibrated on the fly on a few built-in code prompts (the output says so; --random-tiny
checkpoints always are). Takes about 20 s of CPU time on the embedded models (the wall-clock grows with the load
of the machine).
"""

from __future__ import annotations

import argparse
from typing import Any

from spiffy.cli.flags import add_threads_argument, plain_text

#: the flags (dest names) only the diffusion part reads, and only the AR part reads (refused with the other --only)
DLLM_PART_FLAGS: frozenset[str] = frozenset({"model", "graph", "gen_length", "block_length", "budget"})
AR_PART_FLAGS: frozenset[str] = frozenset({"target", "drafter", "dllm_drafter", "drafts", "max_new_tokens",
                                           "tree_budget"})

#: short code prompts (raw text: the embedded models are code-completion models)
DEMO_PROMPTS: tuple[str, ...] = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
)
#: prompts for an on-the-fly calibration (distinct from the demo prompts)
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "import os\n\n\ndef list_files(path):\n",
    "def read_lines(filename):\n",
    "class Counter:\n    def __init__(self):\n",
    "def merge(a, b):\n",
    "for i in range(10):\n",
    "def parse_args(argv):\n",
)



def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Create the ``demo`` subparser (no torch import; the tour is in :mod:`spiffy.cli.demo_run`)."""
    parser = subparsers.add_parser(
        "demo", help="run a short demo on the embedded tiny models (Spiffy and DDTree, with speedups)",
        description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="DIR|ID", help="diffusion LM checkpoint, directory or Hub id (default: the embedded one)")
    parser.add_argument("--graph", default=None, metavar="FILE",
                        help="calibrated draft graph for --model (default: the shipped one; else calibrated on the fly)")
    parser.add_argument("--target", default=None, metavar="DIR|ID", help="Qwen3 target checkpoint, directory or Hub id (default: the embedded one)")
    parser.add_argument("--drafter", default=None, metavar="DIR|ID", help="DFlash or DFlash2 drafter for --target, directory or Hub id (default: the embedded one)")
    parser.add_argument("--dllm-drafter", default=None, metavar="DIR|ID",
                        help="diffusion drafter for --target (DEER, SpecDiff-2, DDTree over its marginals; default: the "
                             "embedded one when shipped, else those rows are skipped)")
    parser.add_argument("--drafts", type=int, default=4, metavar="K",
                        help="SpecDiff-2 joint drafts sampled per round (default 4)")
    parser.add_argument("--only", choices=("dllm", "ar"), default=None, help="run only the diffusion or only the AR part")
    parser.add_argument("--gen-length", type=int, default=32, metavar="N", help="dLLM generated positions (default 32)")
    parser.add_argument("--block-length", type=int, default=None, metavar="B",
                        help="dLLM block length (default: the graph's, else 16)")
    parser.add_argument("--budget", type=int, default=3, metavar="D",
                        help="Spiffy drafts verified per model call (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="AR generated tokens (default 32)")
    parser.add_argument("--tree-budget", type=int, default=32, metavar="N",
                        help="DDTree draft-tree nodes verified per target forward (default 32)")
    parser.add_argument("--max-prompts", type=int, default=len(DEMO_PROMPTS), metavar="N",
                        help=f"number of demo prompts (1..{len(DEMO_PROMPTS)}, default {len(DEMO_PROMPTS)})")
    parser.add_argument("--dtype", default=None, help="model dtype (default float32 on CPU)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument(
        "--random-tiny",
        action="store_true",
        help="use freshly written tiny RANDOM checkpoints (spiffy tiny) for every part not given by path: shows the "
        "machinery and the identical-output check anywhere; acceptance numbers of random weights mean nothing",
    )
    parser.set_defaults(run="demo_run", command_parser=parser)
    return parser
