"""AR mode of ``spiffy generate`` at run time: ``spiffy generate --method ddtree|dflash|deer|specdiff|ar
[--target DIR --drafter DIR] [--tree-budget N | --chain-length N | --drafts K] [--accept coupled|rejection] ...``.

The flags are defined once, in :mod:`spiffy.cli.flags` (AR-only) and :mod:`spiffy.cli.generate` (shared with dLLM
mode); this module only runs. ``--method`` without ``--target`` runs on the embedded pair: the tiny Qwen3 target
with its DFlash drafter (ddtree, dflash) or its diffusion drafter (deer, specdiff). The drafter may be a DFlash
drafter or a dLLM (the kind is read from its config.json).

Each method reads its own draft-size flag (:data:`METHOD_FLAGS`); a flag the chosen method does not read is refused.
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

from spiffy.arspec import ARGenerationResult, ARSpecConfig, as_drafter, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.cli.flags import refuse
from spiffy.cli.placement import placement_kwargs
from spiffy.cli.runtime import default_device, quiet_loading, set_threads
from spiffy.embedded import embedded_model_path
from spiffy.errors import CheckpointError, ConfigError
from spiffy.models.ar_drafters import load_ar_drafter
from spiffy.models.hub import checkpoint_dir
from spiffy.models.loading import load_target, read_config_dict
from spiffy.models.prompting import stop_token_ids
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import model_device, resolve_dtype

__all__ = ["METHOD_FLAGS", "ar_config_from_args", "run_generate"]

#: the method-specific flags (dest names) each method reads; the others are refused for it
#: (to come from the method registry of spiffy.arspec once it holds them)
METHOD_FLAGS: dict[str, frozenset[str]] = {
    "ddtree": frozenset({"tree_budget", "accept"}),
    "dflash": frozenset({"chain_length", "accept"}),
    "deer": frozenset({"chain_length", "accept"}),
    "specdiff": frozenset({"chain_length", "drafts", "accept"}),
    "ar": frozenset(),
}
#: which embedded drafter each method runs with when --target is not given
EMBEDDED_DRAFTER: dict[str, str | None] = {
    "ddtree": "ar-drafter", "dflash": "ar-drafter", "deer": "ar-dllm-drafter", "specdiff": "ar-dllm-drafter",
    "ar": None,
}


def ar_config_from_args(args: argparse.Namespace, method: str, stops: Sequence[int]) -> ARSpecConfig:
    """The :class:`~spiffy.arspec.ARSpecConfig` of parsed AR flags (unset flags keep ARSpecConfig's defaults)."""
    sampling = SamplingConfig.from_loose(
        getattr(args, "temperature", 0.0), getattr(args, "top_p", None), getattr(args, "top_k", None),
        int(getattr(args, "seed", 0) or 0),
    )
    flags = {"tree_budget": "tree_budget", "chain_length": "chain_length", "drafts": "drafts", "accept": "accept",
             "max_new_tokens": "max_new_tokens"}
    given = {field: getattr(args, dest) for field, dest in flags.items() if getattr(args, dest, None) is not None}
    if method == "specdiff":  # the command line's SpecDiff-2 default: 4 drafts (the library's default is 1)
        given.setdefault("drafts", 4)
    return ARSpecConfig(method=method, stop_token_ids=tuple(stops), sampling=sampling, **given)


def _resolve_pair(args: argparse.Namespace, method: str) -> tuple[str, str | None]:
    """``(target, drafter)`` directories: as given, or the embedded pair for ``method`` when --target is not given."""
    target_dir = getattr(args, "target", None)
    drafter_dir = getattr(args, "drafter", None)
    if not target_dir:
        if drafter_dir:
            raise ConfigError("--drafter needs --target (a drafter is made for one target); fix: add --target DIR, "
                              "or drop --drafter to run on the embedded target and drafter")
        target_dir = str(embedded_model_path("ar-target"))
        kind = EMBEDDED_DRAFTER[method]
        drafter_dir = str(embedded_model_path(kind)) if kind else None
    if method != "ar" and not drafter_dir:
        raise ConfigError(
            f"--method {method} needs --drafter DIR (a DFlash or dLLM drafter); fix: add it or use --method ar"
        )
    if method == "ar" and drafter_dir:
        raise ConfigError("--method ar decodes without a drafter; fix: drop --drafter, or pick a speculative method "
                          "(--method ddtree)")
    return target_dir, drafter_dir


def _encode(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
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
    return list(ids)


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
    """Run AR-mode generation (``spiffy generate --method METHOD [--target DIR --drafter DIR] ...``); prints text or
    one JSON object per prompt."""
    method = getattr(args, "method", None) or ("ddtree" if getattr(args, "drafter", None) else "ar")
    asked = set(getattr(args, "given", set())) - {"method", "target", "drafter"}
    method_specific = {"tree_budget", "chain_length", "drafts", "accept"}
    refuse(asked & method_specific - METHOD_FLAGS[method], f"not read by --method {method}",
           "drop them (--tree-budget: ddtree; --chain-length: dflash, deer, specdiff; --drafts: specdiff; "
           "--accept: every method but ar)", getattr(args, "command_parser", None))
    target_dir, drafter_dir = _resolve_pair(args, method)
    config = ar_config_from_args(args, method, ())  # bad flags fail before any model is loaded
    device = default_device(getattr(args, "device", None))
    target_dir = checkpoint_dir(target_dir)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    config_file = Path(target_dir) / "config.json"
    raw = read_config_dict(target_dir) if config_file.is_file() else {}
    dtype = resolve_dtype(getattr(args, "dtype", None) or "float32", raw)
    placement = placement_kwargs(args)
    quiet_loading()
    target = load_target(target_dir, dtype, device, **placement)
    if placement:  # the drafter and the inputs go where the target's embedding computes
        device = str(model_device(target))
    drafter = None
    if drafter_dir is not None:
        drafter = as_drafter(load_ar_drafter(drafter_dir, dtype=dtype, device=device))
        drafter.check(target)  # type: ignore[attr-defined]
    set_threads(getattr(args, "threads", None), target, getattr(drafter, "model", None))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"no tokenizer in {target_dir} ({exc}); fix: save the tokenizer next to the target") from exc
    prompts = getattr(args, "prompt", "") or ""
    prompts = prompts if isinstance(prompts, list) else [prompts]
    chat = bool(getattr(args, "chat", False))
    config = replace(config, stop_token_ids=tuple(stop_token_ids(target, tokenizer, chat)))
    batch = [_encode(tokenizer, p, chat) for p in prompts]
    if len(batch) == 1:
        results = [speculative_generate(target, drafter, batch[0], config, progress=not bool(getattr(args, "no_progress", False)))]
    else:  # one batched run: per-row trees in one verification forward; row r equals prompt r decoded alone
        drafters = None if drafter is None else [drafter] + [as_drafter(drafter.model) for _ in batch[1:]]
        results = speculative_generate_batch(target, drafters, batch, config)
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
