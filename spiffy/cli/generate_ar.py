"""AR mode of ``spiffy generate``: ``spiffy generate --target DIR [--drafter DIR] --method ar|dflash|ddtree|deer|specdiff
[--drafts K] [--accept coupled|rejection] ...``.

The drafter may be a DFlash drafter or a dLLM (the kind is read from its config.json). ``--method deer|specdiff``
without ``--target`` / ``--drafter`` uses the embedded tiny Qwen3 target and the embedded tiny dLLM drafter.

``spiffy/cli/generate.py`` defines the flags shared with the dLLM mode (``--prompt``, ``--chat``, ``--json``,
``--dtype``, ``--budget``, ``--temperature``, ``--top-p``, ``--top-k``, ``--seed``) and calls
:func:`add_ar_arguments` for the AR-only ones; when ``--target`` is given it delegates to :func:`run_generate`.
:func:`add_ar_arguments` with ``shared=True`` adds any shared flag the parser still lacks, so the module also works
stand-alone (:func:`main`, ``python -m spiffy.cli.generate_ar``).

Method names, their help texts and which drafter kind (and embedded checkpoint) each one uses come from the
registry, :mod:`spiffy.arspec.methods`. Draft sizes: ``--budget N`` (tree nodes per round of ``ddtree`` /
``ddtree-dllm``; the knob ``ARSpecConfig.budget``), ``--chain-length N`` (drafted tokens per round of a chain),
``--drafts K`` (SpecDiff-2); a flag left out takes :class:`~spiffy.arspec.ARSpecConfig`'s default.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoTokenizer

from spiffy.arspec import ARGenerationResult, ARSpecConfig, as_drafter, speculative_generate_batch
from spiffy.arspec.config import DEFAULT_BUDGET, DEFAULT_DRAFTS, DEFAULT_MAX_NEW_TOKENS
from spiffy.arspec.methods import (
    ACCEPT_RULES,
    AR,
    DEFAULT_ACCEPT,
    DEFAULT_METHOD,
    DLLM_DRAFTER,
    METHODS,
    REGISTRY,
    get_method,
    methods_help,
)
from spiffy.cli.placement import add_placement_arguments, placement_kwargs
from spiffy.embedded import embedded_model_path
from spiffy.errors import CheckpointError, ConfigError, SpiffyError
from spiffy.models.ar_drafters import load_ar_drafter
from spiffy.models.hub import checkpoint_dir
from spiffy.models.loading import load_target, read_config_dict
from spiffy.models.prompting import prompt_token_ids, stop_token_ids
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import model_device, resolve_dtype

__all__ = ["add_ar_arguments", "ar_config_from_args", "run_generate", "main", "load_target"]

_AR_ONLY: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--target",), dict(default=None, metavar="DIR|ID",
                        help="AR mode: Qwen3 target checkpoint, a directory or a Hub id ORG/NAME[@REVISION]")),
    (("--drafter",), dict(default=None, metavar="DIR|ID",
                         help="AR mode: drafter for the target, directory or Hub id: DFlash or a dLLM sharing its "
                              "tokenizer (the kind is read from its config.json; needed by every method but ar)")),
    (("--method",), dict(default=None, choices=METHODS,
                        help=f"AR mode decoding method (default {DEFAULT_METHOD.name} with --drafter, {AR.name} without): "
                             f"{methods_help()}; the dLLM-drafter methods without --target/--drafter use the "
                             "embedded models")),
    (("--drafts",), dict(type=int, default=None, metavar="K",
                        help=f"AR mode, specdiff: joint drafts sampled per round and verified together (default "
                             f"{DEFAULT_DRAFTS})")),
    (("--accept",), dict(default=None, choices=tuple(ACCEPT_RULES),
                        help=f"AR mode acceptance rule (default {DEFAULT_ACCEPT}): "
                             + "; ".join(f"{a.name}: {a.help}" for a in ACCEPT_RULES.values()))),
    (("--max-new-tokens",), dict(type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                                help=f"AR mode: maximum number of generated tokens (default {DEFAULT_MAX_NEW_TOKENS})")),
    (("--chain-length",), dict(type=int, default=None, metavar="N",
                              help="AR mode, chain methods: drafted tokens per round (default: the drafter's block "
                                   "size - 1)")),
]

#: methods that fall back to the embedded target and their drafter kind's embedded drafter when neither --target nor
#: --drafter is given
EMBEDDED_DLLM_METHODS: tuple[str, ...] = tuple(m.name for m in REGISTRY.values() if m.drafter is DLLM_DRAFTER)

_SHARED: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--prompt",), dict(default="", help="prompt text (tokenized as is unless --chat)")),
    (("--chat",), dict(action="store_true", help="wrap the prompt in the tokenizer's chat template")),
    (("--json",), dict(action="store_true", help="print one JSON object with tokens, text and statistics")),
    (("--dtype",), dict(default=None, help="model dtype: float32 (CPU default), bfloat16, float16, float64 or auto")),
    (("--budget",), dict(type=int, default=None, metavar="B",
                        help=f"AR mode: tree nodes per round (default {DEFAULT_BUDGET}; 0 = no drafts)")),
    (("--temperature",), dict(type=float, default=0.0, help="sampling temperature (0 = greedy)")),
    (("--top-p",), dict(type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")),
    (("--top-k",), dict(type=int, default=0, help="top-k sampling (0 = off)")),
    (("--seed",), dict(type=int, default=0, help="sampling seed")),
]


def _has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in getattr(parser, "_option_string_actions", {})


def add_ar_arguments(parser: argparse.ArgumentParser, shared: bool = False) -> argparse.ArgumentParser:
    """Add the AR-mode flags (``--target --drafter --method --max-new-tokens``) to ``parser``.

    Flags the parser already defines are skipped. With ``shared=True`` also add the flags shared with the dLLM
    mode (``--prompt --chat --json --dtype --budget --temperature --top-p --top-k --seed``) where missing.
    """
    specs = _AR_ONLY + (_SHARED if shared else [])
    for flags, kwargs in specs:
        if not any(_has_option(parser, f) for f in flags):
            parser.add_argument(*flags, **kwargs)
    return parser


def ar_config_from_args(args: argparse.Namespace, method: str, stops: Sequence[int]) -> ARSpecConfig:
    """The :class:`~spiffy.arspec.ARSpecConfig` of parsed AR flags (``None`` flags take the config's defaults)."""
    given = {knob: getattr(args, knob, None) for knob in ("budget", "drafts", "accept", "max_new_tokens")}
    sampling = SamplingConfig.from_loose(
        getattr(args, "temperature", 0.0), getattr(args, "top_p", None), getattr(args, "top_k", None),
        int(getattr(args, "seed", 0) or 0),
    )
    return ARSpecConfig(
        method=method,
        chain_length=getattr(args, "chain_length", None),
        **{k: v for k, v in given.items() if v is not None},
        stop_token_ids=tuple(stops),
        sampling=sampling,
    )


def _print_result(res: ARGenerationResult, args: argparse.Namespace, text_out: str, extra: dict[str, Any]) -> None:
    if bool(getattr(args, "json", False)):
        payload = res.to_dict()
        payload.update(text=text_out, **extra)
        print(json.dumps(payload))
        return
    print(text_out)
    print(
        f"[{res.method}] {len(res.tokens)} tokens in {res.rounds} rounds, tau {res.tau:.2f}, "
        f"{res.seconds:.2f}s (prefill {res.prefill_seconds:.2f}s)",
        file=sys.stderr,
    )


def run_generate(args: argparse.Namespace) -> int:
    """Run AR-mode generation for ``spiffy generate --target DIR ...``; prints text or one JSON object."""
    target_dir = getattr(args, "target", None)
    drafter_dir = getattr(args, "drafter", None)
    spec = get_method(getattr(args, "method", None) or (DEFAULT_METHOD if drafter_dir else AR))
    method = spec.name
    if not target_dir and not drafter_dir and method in EMBEDDED_DLLM_METHODS:
        target_dir = str(embedded_model_path("ar-target"))
        drafter_dir = str(embedded_model_path(spec.drafter.embedded))  # type: ignore[union-attr]
    if not target_dir:
        raise ConfigError("AR mode needs --target DIR (a Qwen3 checkpoint directory)")
    if spec.needs_drafter and not drafter_dir:
        raise ConfigError(
            f"--method {method} needs --drafter DIR (a DFlash or dLLM drafter); fix: add it or use --method ar"
        )
    config = ar_config_from_args(args, method, ())  # bad flags fail before any model is loaded
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    target_dir = checkpoint_dir(target_dir)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    config_file = Path(target_dir) / "config.json"
    raw = read_config_dict(target_dir) if config_file.is_file() else {}
    dtype = resolve_dtype(getattr(args, "dtype", None) or "float32", raw)
    placement = placement_kwargs(args)
    target = load_target(target_dir, dtype, device, **placement)
    if placement:  # the drafter and the inputs go where the target's embedding computes
        device = str(model_device(target))
    drafter_model = load_ar_drafter(drafter_dir, dtype=dtype, device=device) if spec.needs_drafter else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"no tokenizer in {target_dir} ({exc}); fix: save the tokenizer next to the target") from exc
    prompts = getattr(args, "prompt", "") or ""
    prompts = prompts if isinstance(prompts, list) else [prompts]
    chat = bool(getattr(args, "chat", False))
    config = replace(config, stop_token_ids=tuple(stop_token_ids(target, tokenizer, chat)))
    batch = [prompt_token_ids(tokenizer, p, chat=chat, require_template=True) for p in prompts]
    # one batched run (one prompt is a batch of one): per-row trees in one verification forward; row r equals
    # prompt r decoded alone; each row its own drafter wrapper (the core checks it against the target)
    drafters = None if drafter_model is None else [as_drafter(drafter_model) for _ in batch]
    results = speculative_generate_batch(target, drafters, batch, config,
                                         progress=not bool(getattr(args, "no_progress", False)))
    for prompt, ids, res in zip(prompts, batch, results):
        _print_row(res, args, tokenizer, prompt, ids, config, target_dir, drafter_dir, dtype, device)
    return 0


def _print_row(
    res: ARGenerationResult, args: argparse.Namespace, tokenizer: Any, prompt: str, ids: list[int],
    config: ARSpecConfig, target_dir: Any, drafter_dir: Any, dtype: torch.dtype, device: str,
) -> None:
    sampling = config.sampling
    extra = dict(
        prompt=prompt,
        prompt_tokens=len(ids),
        target=str(target_dir),
        drafter=str(drafter_dir) if drafter_dir else None,
        accept=config.accept,
        drafts=int(config.drafts),
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        seed=int(sampling.seed or 0),
        dtype=str(dtype).replace("torch.", ""),
        device=str(device),
        tokens_per_second=(len(res.tokens) / res.seconds) if res.seconds > 0 else None,
    )
    _print_result(res, args, tokenizer.decode(res.tokens, skip_special_tokens=True), extra)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m spiffy.cli.generate_ar --target DIR ...``)."""
    parser = argparse.ArgumentParser(prog="spiffy-ar", description="AR-mode generation with DDTree / DFlash / AR")
    add_ar_arguments(parser, shared=True)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_placement_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_generate(args)
    except SpiffyError as exc:
        print(f"spiffy generate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
