"""The flags several subcommands share, built without importing torch (``--help`` stays fast).

Every flag has one meaning wherever it appears. Flags whose default depends on the model or the graph default to
``None`` here; the command fills them in when it runs (the decoding defaults live in
:class:`~spiffy.decoding.DecodeConfig` and in the graph a command runs with, not here).

:func:`given` tells which flags the user actually set (a value other than the parser's default), so a command can
refuse a flag that does not apply instead of ignoring it (:func:`refuse`).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from typing import Any, Iterable

from spiffy.cli.names import ACCEPT_RULES, AR_METHODS, DEFAULT_TREE_BUDGET
from spiffy.errors import ConfigError

__all__ = [
    "AR_FLAGS",
    "DLLM_DECODING_FLAGS",
    "add_ar_arguments",
    "add_decoding_arguments",
    "add_sampling_arguments",
    "add_batch_invariant_argument",
    "add_threads_argument",
    "flag_of",
    "given",
    "plain_text",
    "probability",
    "refuse",
    "threshold",
]

THREADS_HELP = (
    "CPU threads torch may use (0 = torch's default, all cores). Default: 1 for small models (under 50M parameters, "
    "such as the embedded demo models and `spiffy tiny` checkpoints: a one-row forward gains little from more "
    "threads, and on a machine shared with other jobs extra threads make them several times slower; wide "
    "verification forwards gain more, so on an idle machine try --threads 0 for the speculative methods), torch's "
    "default otherwise. The output does not depend on it"
)


def add_batch_invariant_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--batch-invariant``: decode in :func:`spiffy.batch_invariant` mode."""
    parser.add_argument("--batch-invariant", action="store_true",
                        help="batch-invariant mode: every dot product and sum computed exactly, so speculative and "
                             "batched rows equal the baseline bitwise in every dtype (the baseline decoded in the same "
                             "mode; needs sdpa attention; about 3x the default's time on a CPU)")
    return parser


def add_threads_argument(parser: argparse.ArgumentParser, help_text: str = THREADS_HELP) -> argparse.ArgumentParser:
    """``--threads N`` (``None`` = the command's default, see :data:`THREADS_HELP`)."""
    parser.add_argument("--threads", type=_non_negative_int("--threads"), default=None, metavar="N", help=help_text)
    return parser


def threshold_or_none(text: str) -> float | str:
    """argparse type of ``--also-threshold``: ``"none"`` (skip), else a confidence as :func:`threshold` takes."""
    return "none" if text.strip().lower() == "none" else threshold(text)


def threshold(text: str) -> float:
    """argparse type of ``--threshold``: a number in (0, 1] (a fix that names the flag, not a Python value)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a confidence such as 0.9") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"{text} is outside (0, 1]; pass a confidence such as 0.9, or leave --threshold out for the static "
            "schedule (a fixed number of tokens per step)"
        )
    return value


def probability(text: str) -> float:
    """argparse type of ``--top-p``: a mass in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass e.g. 0.95") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]; pass e.g. 0.95, or leave --top-p out (off)")
    return value


def _non_negative_int(flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {value}")
        return value

    return parse


#: the dLLM decoding flags (dest names), refused in AR mode
DLLM_DECODING_FLAGS: tuple[str, ...] = (
    "gen_length", "block_length", "steps", "threshold", "remasking", "cache", "cfg_scale", "logits_eos_inf",
    "confidence_eos_eot_inf", "alg", "alg_temp", "eps", "strategy", "small_block_size",
)


def add_decoding_arguments(parser: argparse.ArgumentParser, *, sampling: bool = True,
                           defaults: str = "the defaults below") -> argparse.ArgumentParser:
    """Add the dLLM decoding flags (one per :class:`~spiffy.decoding.DecodeConfig` field); unset flags are ``None``.

    ``defaults`` says in the help where unset values come from (``generate``: the model's shipped graph).
    """
    g = parser.add_argument_group("decoding (diffusion LMs)", textwrap.fill(
        f"Unset flags take {defaults}. A draft graph only runs with the decoding rule it was calibrated for "
        "(block length, steps per block, threshold, remasking, cache, temperature); gen length may differ.", 100))
    g.add_argument("--gen-length", type=int, default=None, metavar="N",
                   help="number of generated positions, all masked at the start (default 128)")
    g.add_argument("--block-length", type=int, default=None, metavar="B",
                   help="positions per block, decoded left to right; must divide --gen-length (default: one block "
                        "= gen length; SDAR: 4)")
    g.add_argument("--steps", type=int, default=None, metavar="S",
                   help="total denoising steps (model calls of the baseline), split evenly over the blocks "
                        "(default: gen length, i.e. one token unmasked per step)")
    g.add_argument("--threshold", type=threshold, default=None, metavar="TAU",
                   help="dynamic unmasking (Fast-dLLM): unmask every position whose confidence is >= TAU in a step "
                        "(0 < TAU <= 1; default off: the static schedule)")
    g.add_argument("--remasking", default=None, choices=("low_confidence", "random"),
                   help="which positions to unmask (LLaDA): the most confident, or random ones (default "
                        "low_confidence)")
    g.add_argument("--cache", default=None, choices=("none", "prefix", "dual"),
                   help="K/V cache mode (Fast-dLLM): none, prefix or dual (default none; SDAR always caches)")
    g.add_argument("--cfg-scale", type=float, default=None, metavar="W",
                   help="classifier-free guidance scale (LLaDA; default 0 = off)")
    g.add_argument("--logits-eos-inf", action="store_true", default=None,
                   help="LLaDA: never propose the end-of-text token (its logit set to -inf)")
    g.add_argument("--confidence-eos-eot-inf", action="store_true", default=None,
                   help="LLaDA: rank end-of-text / end-of-turn proposals last (official semantics)")
    g.add_argument("--alg", default=None, choices=("origin", "maskgit_plus", "topk_margin", "entropy"),
                   help="Dream unmasking rule (default: maskgit_plus, or origin with --remasking random)")
    g.add_argument("--alg-temp", type=float, default=None, metavar="T",
                   help="Dream: sample positions with softmax(confidence / T) (default: the most confident)")
    g.add_argument("--eps", type=float, default=None,
                   help="Dream: final timestep of linspace(1, eps, steps + 1) (default 1e-3)")
    g.add_argument("--strategy", default=None,
                   choices=("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded"),
                   help="SDAR remasking strategy (default: dynamic with --threshold, else static)")
    g.add_argument("--small-block-size", type=int, default=None, metavar="S",
                   help="Fast-dLLM v2: sub-block length, a divisor of --block-length (default 8)")
    if sampling:
        add_sampling_arguments(parser)
    return parser


def add_sampling_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--temperature --top-p --top-k --seed`` (the same flags, defaults and meaning in every mode)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0 = greedy)")
    g.add_argument("--top-p", type=probability, default=None, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to mass P, 0 < P <= 1 (default off)")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="top-k sampling: keep the K most likely tokens (default off; 0 = off)")
    g.add_argument("--seed", type=int, default=0, metavar="K", help="seed of every random draw (default 0)")
    return parser


#: the AR-mode flags (dest names), refused in dLLM mode
AR_FLAGS: tuple[str, ...] = ("target", "drafter", "method", "drafts", "accept", "max_new_tokens", "tree_budget",
                             "chain_length")


def add_ar_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The AR-mode flags of ``spiffy generate`` (Qwen3 target, its drafter, the method and its draft sizes)."""
    g = parser.add_argument_group("AR mode (a Qwen3 target with a drafter)", textwrap.fill(
        "--target, --drafter or --method selects AR mode. --method alone runs on the embedded pair: the tiny "
        "Qwen3 target with its DFlash drafter (ddtree, dflash) or its diffusion drafter (deer, specdiff).", 100))
    g.add_argument("--target", default=None, metavar="DIR|ID",
                   help="AR target checkpoint: a directory, a Hub id ORG/NAME[@REVISION], or the name of one the package "
                        "ships (tiny-qwen3, small-qwen3)")
    g.add_argument("--drafter", default=None, metavar="DIR|ID",
                   help="drafter made for --target (directory or Hub id): a DFlash drafter, or a diffusion LM sharing "
                        "the target's tokenizer (the kind is read from its config.json); every method but ar needs one")
    g.add_argument("--method", default=None, choices=AR_METHODS,
                   help="ddtree: a tree of the drafter's most likely continuations verified in one target forward "
                        "(default with --drafter); dflash: the drafter's single best chain; deer: the chain of a "
                        "diffusion drafter; specdiff: SpecDiff-2, --drafts K sampled drafts verified as one tree; ar: "
                        "plain autoregressive decoding (default without --drafter)")
    g.add_argument("--tree-budget", type=_non_negative_int("--tree-budget"), default=None, metavar="N",
                   help=f"ddtree: draft-tree nodes (tokens) verified per target forward (default "
                        f"{DEFAULT_TREE_BUDGET}; 0 = no drafts)")
    g.add_argument("--chain-length", type=int, default=None, metavar="N",
                   help="dflash, deer, specdiff: drafted tokens per draft and round (default: the drafter's "
                        "block size - 1)")
    g.add_argument("--drafts", type=int, default=None, metavar="K",
                   help="specdiff: drafts sampled per round and verified together (default 4)")
    g.add_argument("--accept", default=None, choices=ACCEPT_RULES,
                   help="acceptance rule: coupled (output equal to plain AR token for token; default) or rejection "
                        "(speculative sampling, min(1, p/q): equal to AR in distribution)")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="generated tokens at most (default 128)")
    g.add_argument("--compile", default="auto", choices=("auto", "on", "off", "inductor"),
                   help="the captured path (AR and dLLM mode): static shapes per bucket, forwards captured in CUDA "
                        "graphs on a GPU (AR: a static cache, the drafter's forward too, trees built and walked on the "
                        "device; dLLM: every "
                        "forward_states over its (states, window) bucket); same tokens as eager; inductor: the "
                        "same steps compiled by TorchInductor first (fused kernels; minutes of compilation at real "
                        "size; tokens equal eager's up to near ties); auto: off until a GPU run shows it never "
                        "slower (default auto)")
    return parser


def plain_text(doc: str | None) -> str:
    """A module docstring as ``--help`` text: reStructuredText roles and double backquotes become plain text."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "`").replace("::\n", ":\n")


def given(args: argparse.Namespace, parser: argparse.ArgumentParser) -> set[str]:
    """Dest names of the flags set to something other than their default (what the user asked for)."""
    out = set()
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public listing
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        if getattr(args, action.dest, action.default) != action.default:
            out.add(action.dest)
    return out


def flag_of(dest: str, parser: argparse.ArgumentParser | None = None) -> str:
    """The spelling of ``dest`` on the command line (``gen_length`` -> ``--gen-length``)."""
    if parser is not None:
        for action in parser._actions:  # noqa: SLF001
            if action.dest == dest and action.option_strings:
                return max(action.option_strings, key=len)
    return "--" + dest.replace("_", "-")


def refuse(asked: Iterable[str], why: str, fix: str, parser: argparse.ArgumentParser | None = None) -> None:
    """ConfigError naming every flag in ``asked`` (dest names): ``"--a, --b: <why>; fix: <fix>"``; nothing if
    ``asked`` is empty. A flag that does not apply is refused, never ignored."""
    flags = sorted(flag_of(dest, parser) for dest in asked)
    if flags:
        raise ConfigError(f"{', '.join(flags)}: {why}; fix: {fix}")
