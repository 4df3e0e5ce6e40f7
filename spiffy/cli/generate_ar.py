"""AR mode of ``spiffy generate`` at run time: ``spiffy generate --method ddtree|dflash|deer|specdiff|ar
[--target DIR --drafter DIR] [--tree-budget N | --chain-length N | --drafts K] [--accept coupled|rejection] ...``.

The flags are defined once, in :mod:`spiffy.cli.flags` (AR-only) and :mod:`spiffy.cli.generate` (shared with dLLM
mode); this module only runs. ``--method`` without ``--target`` runs on the embedded pair: the tiny Qwen3 target
with its DFlash drafter (ddtree, dflash) or its diffusion drafter (deer, specdiff). The drafter may be a DFlash
drafter or a dLLM (the kind is read from its config.json).

Each method reads its own draft-size flag (:func:`method_flags`, from the method registry); a flag the chosen method does not read is refused.
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

from spiffy.arspec import ARGenerationResult, ARSpecConfig, as_drafter
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.methods import AR, DEFAULT_METHOD, Chain, Method, get_method
from spiffy.cli.flags import refuse
from spiffy.cli.placement import placement_kwargs, quantization_kwargs
from spiffy.cli.runtime import default_device, quiet_loading, set_threads
from spiffy.embedded import embedded_model_path
from spiffy.errors import CheckpointError, ConfigError
from spiffy.models.ar_drafters import load_ar_drafter
from spiffy.models.hub import checkpoint_dir
from spiffy.models.loading import load_target, read_config_dict
from spiffy.models.prompting import prompt_token_ids, stop_token_ids
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import model_device, resolve_dtype

__all__ = ["ar_config_from_args", "method_flags", "run_generate"]

def method_flags(method: Method) -> frozenset[str]:
    """The method-specific flags (dest names) ``method`` reads; the others are refused for it. From the registry:
    its sizing knob (``--tree-budget`` for a tree budget, ``--drafts``), ``--chain-length`` for a method whose drafts
    follow the drafter's block (chains and sampled drafts), ``--accept`` for every method that drafts."""
    flags = set()
    if method.size_knob == "budget":
        flags.add("tree_budget")
    if method.size_knob == "drafts":
        flags.add("drafts")
    if isinstance(method, Chain):
        flags.add("chain_length")
    if method.needs_drafter:
        flags.add("accept")
    return frozenset(flags)


def ar_config_from_args(args: argparse.Namespace, method: str, stops: Sequence[int]) -> ARSpecConfig:
    """The :class:`~spiffy.arspec.ARSpecConfig` of parsed AR flags (unset flags keep ARSpecConfig's defaults)."""
    sampling = SamplingConfig.from_loose(
        getattr(args, "temperature", 0.0), getattr(args, "top_p", None), getattr(args, "top_k", None),
        int(getattr(args, "seed", 0) or 0),
    )
    # config field <- flag (dest): the tree budget is ARSpecConfig.budget; --budget is Spiffy's (dLLM mode)
    flags = {"budget": "tree_budget", "chain_length": "chain_length", "drafts": "drafts", "accept": "accept",
             "max_new_tokens": "max_new_tokens"}
    given = {field: getattr(args, dest) for field, dest in flags.items() if getattr(args, dest, None) is not None}
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
        kind = get_method(method).drafter
        drafter_dir = str(embedded_model_path(kind.embedded)) if kind else None
    if get_method(method).needs_drafter and not drafter_dir:
        raise ConfigError(
            f"--method {method} needs --drafter DIR (a DFlash or dLLM drafter); fix: add it or use --method ar"
        )
    if not get_method(method).needs_drafter and drafter_dir:
        raise ConfigError("--method ar decodes without a drafter; fix: drop --drafter, or pick a speculative method "
                          "(--method ddtree)")
    return target_dir, drafter_dir


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
    method = getattr(args, "method", None) or (DEFAULT_METHOD.name if getattr(args, "drafter", None) else AR.name)
    asked = set(getattr(args, "given", set())) - {"method", "target", "drafter"}
    method_specific = {"tree_budget", "chain_length", "drafts", "accept"}
    refuse(asked & method_specific - method_flags(get_method(method)), f"not read by --method {method}",
           "drop them (--tree-budget: ddtree; --chain-length: dflash, deer, specdiff; --drafts: specdiff; "
           "--accept: every method but ar)", getattr(args, "command_parser", None))
    target_dir, drafter_dir = _resolve_pair(args, method)
    config = ar_config_from_args(args, method, ())  # bad flags fail before any model is loaded
    device = default_device(getattr(args, "device", None))
    target_dir = checkpoint_dir(target_dir)  # a directory, or a Hub id such as Qwen/Qwen3-8B
    config_file = Path(target_dir) / "config.json"
    raw = read_config_dict(target_dir) if config_file.is_file() else {}
    # load_model's rule, as `spiffy bench ar` (float32 on CPU, the checkpoint's on an accelerator): one default
    dtype = resolve_dtype(getattr(args, "dtype", None), raw, device)
    placement = placement_kwargs(args)
    quiet_loading()
    target = load_target(target_dir, dtype, device, **placement, **quantization_kwargs(args))
    if placement:  # the drafter and the inputs go where the target's embedding computes
        device = str(model_device(target))
    drafter_model = None
    if drafter_dir is not None:
        drafter_model = load_ar_drafter(drafter_dir, dtype=dtype, device=device,
                                        **quantization_kwargs(args, drafter=True))
        as_drafter(drafter_model).check(target)  # a mismatched pair fails before any prompt is encoded
    set_threads(getattr(args, "threads", None), target, drafter_model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"no tokenizer in {target_dir} ({exc}); fix: save the tokenizer next to the target") from exc
    prompts = getattr(args, "prompt", "") or ""
    prompts = prompts if isinstance(prompts, list) else [prompts]
    explicit_chat = getattr(args, "chat", None)
    # one default everywhere (bench ar, calibrate, the Python API): the chat template when the tokenizer has one
    chat = True if explicit_chat is None else bool(explicit_chat)
    config = replace(config, stop_token_ids=tuple(stop_token_ids(target, tokenizer, chat)))
    batch = [prompt_token_ids(tokenizer, p, chat=chat, require_template=bool(explicit_chat)) for p in prompts]
    # one batched run (one prompt is a batch of one): per-row trees in one verification forward; row r equals
    # prompt r decoded alone; each row its own drafter wrapper (the core checks it against the target)
    drafters = None if drafter_model is None else [as_drafter(drafter_model) for _ in batch]
    results = speculative_generate_batch(target, drafters, batch, config,
                                         progress=not bool(getattr(args, "no_progress", False)),
                                         compile=getattr(args, "compile", "auto"))
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
