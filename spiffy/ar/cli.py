"""CLI glue for AR mode: ``spiffy generate --target DIR [--drafter DIR] --method ar|dflash|ddtree ...``.

``spiffy/cli/generate.py`` (owned elsewhere) defines the flags shared with the dLLM mode (``--prompt``, ``--chat``,
``--json``, ``--dtype``, ``--budget``, ``--temperature``, ``--top-p``, ``--top-k``, ``--seed``) and calls
:func:`add_ar_arguments` for the AR-only ones; when ``--target`` is given it delegates to :func:`run_generate`.
:func:`add_ar_arguments` with ``shared=True`` adds any shared flag the parser still lacks, so the module also works
stand-alone (:func:`main`, ``python -m spiffy.ar.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from spiffy.errors import CheckpointError, ConfigError
from spiffy.models.hub import checkpoint_dir

__all__ = ["add_ar_arguments", "run_generate", "main", "load_target"]

_AR_ONLY: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--target",), dict(default=None, metavar="DIR|ID",
                        help="AR mode: Qwen3 target checkpoint, a directory or a Hub id ORG/NAME[@REVISION]")),
    (("--drafter",), dict(default=None, metavar="DIR|ID",
                         help="AR mode: DFlash drafter for the target, directory or Hub id (needed by --method dflash/ddtree)")),
    (("--method",), dict(default=None, choices=("ar", "dflash", "ddtree"),
                        help="AR mode decoding method: ddtree (optimal draft tree, default with --drafter), "
                             "dflash (chain of drafter argmaxes), ar (plain autoregressive, default without --drafter)")),
    (("--max-new-tokens",), dict(type=int, default=128, metavar="N",
                                help="AR mode: maximum number of generated tokens (default 128)")),
]

_SHARED: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--prompt",), dict(default="", help="prompt text (tokenized as is unless --chat)")),
    (("--chat",), dict(action="store_true", help="wrap the prompt in the tokenizer's chat template")),
    (("--json",), dict(action="store_true", help="print one JSON object with tokens, text and statistics")),
    (("--dtype",), dict(default=None, help="model dtype: float32 (CPU default), bfloat16, float16, float64 or auto")),
    (("--budget",), dict(type=int, default=None, metavar="B",
                        help="AR mode: DDTree node budget per round (default 64; 0 = no drafts)")),
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


def _parse_dtype(name: str | None, config_dtype: Any = None) -> torch.dtype:
    table = {
        "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
    }
    if name is None:
        return torch.float32
    if name == "auto":
        if isinstance(config_dtype, torch.dtype):
            return config_dtype
        return table.get(str(config_dtype).replace("torch.", ""), torch.float32)
    if name not in table:
        raise ConfigError(f"unknown --dtype {name!r}; fix: use one of {', '.join(sorted(table))} or auto")
    return table[name]


def load_target(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """Load a Qwen3 target checkpoint directory or Hub id (sdpa attention, eval mode)."""
    root = checkpoint_dir(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"no config.json in {root}; fix: --target must be a Qwen3 checkpoint directory")
    raw = json.loads((root / "config.json").read_text())
    if raw.get("model_type") != "qwen3":
        raise ConfigError(
            f"--target {root} has model_type {raw.get('model_type')!r}; AR mode needs a Qwen3 target "
            "(model_type 'qwen3'); fix: pass a Qwen3 checkpoint, or use --model for diffusion LMs"
        )
    from transformers import Qwen3ForCausalLM

    try:
        model = Qwen3ForCausalLM.from_pretrained(str(root), dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    except OSError as exc:
        raise CheckpointError(f"cannot load the target from {root}: {exc}") from exc
    return model.to(device).eval()


def _stop_ids(tokenizer: Any, target: Any, chat: bool) -> list[int]:
    """EOS ids of the target (+ end-of-turn when ``chat``); see :func:`spiffy.bench.ar.stop_token_ids`."""
    from spiffy.bench.ar import stop_token_ids

    return stop_token_ids(target, tokenizer, chat)


def run_generate(args: argparse.Namespace) -> int:
    """Run AR-mode generation for ``spiffy generate --target DIR ...``; prints text or one JSON object."""
    from transformers import AutoTokenizer

    from spiffy.ar.drafter import load_drafter
    from spiffy.ar.generate import ddtree_generate

    target_dir = getattr(args, "target", None)
    if not target_dir:
        raise ConfigError("AR mode needs --target DIR (a Qwen3 checkpoint directory)")
    drafter_dir = getattr(args, "drafter", None)
    method = getattr(args, "method", None) or ("ddtree" if drafter_dir else "ar")
    if method != "ar" and not drafter_dir:
        raise ConfigError(f"--method {method} needs --drafter DIR (a DFlash drafter); fix: add it or use --method ar")
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    target_dir = checkpoint_dir(target_dir)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    raw = json.loads((Path(target_dir) / "config.json").read_text()) if (Path(target_dir) / "config.json").is_file() else {}
    dtype = _parse_dtype(getattr(args, "dtype", None), raw.get("dtype") or raw.get("torch_dtype"))
    target = load_target(target_dir, dtype, device)
    drafter = load_drafter(drafter_dir, dtype=dtype, device=device) if method != "ar" else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"no tokenizer in {target_dir} ({exc}); fix: save the tokenizer next to the target") from exc
    prompt = getattr(args, "prompt", "") or ""
    chat = bool(getattr(args, "chat", False))
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ConfigError("the prompt is empty and the tokenizer has no BOS/EOS token; fix: pass --prompt TEXT")
        ids = [int(bos)]
    as_json = bool(getattr(args, "json", False))
    res = ddtree_generate(
        target,
        drafter,
        ids,
        method=method,
        budget=getattr(args, "budget", None),
        max_new_tokens=int(getattr(args, "max_new_tokens", 128)),
        temperature=float(getattr(args, "temperature", 0.0) or 0.0),
        top_p=float(getattr(args, "top_p", 1.0) or 1.0),
        top_k=int(getattr(args, "top_k", 0) or 0),
        seed=int(getattr(args, "seed", 0) or 0),
        stop_token_ids=_stop_ids(tokenizer, target, chat),
        progress=not bool(getattr(args, "no_progress", False)),
    )
    text_out = tokenizer.decode(res.tokens, skip_special_tokens=True)
    if as_json:
        payload = res.to_dict()
        payload.update(
            text=text_out,
            prompt=prompt,
            prompt_tokens=len(ids),
            target=str(target_dir),
            drafter=str(drafter_dir) if drafter_dir else None,
            temperature=float(getattr(args, "temperature", 0.0) or 0.0),
            top_p=float(getattr(args, "top_p", 1.0) or 1.0),
            top_k=int(getattr(args, "top_k", 0) or 0),
            seed=int(getattr(args, "seed", 0) or 0),
            dtype=str(dtype).replace("torch.", ""),
            device=str(device),
            tokens_per_second=(len(res.tokens) / res.seconds) if res.seconds > 0 else None,
        )
        print(json.dumps(payload))
    else:
        print(text_out)
        print(
            f"[{method}] {len(res.tokens)} tokens in {res.rounds} rounds, tau {res.tau:.2f}, "
            f"{res.seconds:.2f}s (prefill {res.prefill_seconds:.2f}s)",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m spiffy.ar.cli --target DIR ...``)."""
    from spiffy.errors import SpiffyError

    parser = argparse.ArgumentParser(prog="spiffy-ar", description="AR-mode generation with DDTree / DFlash / AR")
    add_ar_arguments(parser, shared=True)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    try:
        return run_generate(args)
    except SpiffyError as exc:
        print(f"spiffy generate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
