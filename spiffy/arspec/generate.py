"""Single-prompt AR speculative generation: thin wrappers over the batched loop (:mod:`spiffy.arspec.batch`).

:func:`speculative_generate` runs one prompt with any :class:`~spiffy.arspec.Drafter` and
:class:`~spiffy.arspec.AcceptanceRule` under one :class:`~spiffy.arspec.ARSpecConfig`; :func:`ddtree_generate` is
the keyword-argument entry point for a drafter model. Every method (:mod:`spiffy.arspec.methods`) shares the loop's
kernels, caches, sampling and timing; with the coupled rule all of them produce the AR output token for token.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from spiffy.arspec.batch import ddtree_generate_batch, prompt_lists, speculative_generate_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.drafter import Drafter
from spiffy.arspec.result import ARGenerationResult
from spiffy.arspec.rules import AcceptanceRule
from spiffy.errors import ConfigError

__all__ = ["speculative_generate", "ddtree_generate", "one_prompt"]


def one_prompt(input_ids: Any) -> list[int]:
    """A ``[P]`` or ``[1, P]`` prompt (list or tensor) as a list of ints; ConfigError for a batch or an empty one."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ConfigError(f"ddtree_generate decodes one sequence at a time, got a batch of {ids.shape[0]}; "
                              "fix: call ddtree_generate_batch (or once per prompt)")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"input_ids must be a non-empty [P] or [1, P] sequence, got shape {tuple(ids.shape)}")
    return prompt_lists([ids])[0]


def speculative_generate(
    target: nn.Module,
    drafter: Drafter | None,
    input_ids: Any,
    config: ARSpecConfig,
    *,
    rule: AcceptanceRule | None = None,
    progress: bool = False,
) -> ARGenerationResult:
    """Generate one prompt with a Qwen3 target under ``config``: the drafter proposes, the target verifies in one
    forward per round, the acceptance rule decides (:func:`~spiffy.arspec.speculative_generate_batch` of one row).

    Args:
        drafter: a :class:`~spiffy.arspec.Drafter` (ignored, may be ``None``, for a method without a drafter).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
        rule: the acceptance rule (default: the one ``config.accept`` names, :func:`~spiffy.arspec.make_rule`).
        progress: show a tqdm bar over generated tokens on stderr.
    Raises:
        ConfigError: missing drafter, batch > 1, bad target; DrafterMismatchError; PromptTooLongError.
    """
    rules = None if rule is None else [rule]
    return speculative_generate_batch(target, [drafter], [one_prompt(input_ids)], config, rules=rules,
                                      progress=progress)[0]


def ddtree_generate(
    target: nn.Module,
    drafter: Any,
    input_ids: Any,
    *,
    method: str = "ddtree",
    budget: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: int | Iterable[int] | None = None,
    block_size: int | None = None,
    progress: bool = False,
) -> ARGenerationResult:
    """Generate one prompt with a Qwen3 target by ``method`` (DDTree trees by default) with the coupled rule:
    :func:`~spiffy.arspec.ddtree_generate_batch` of one row (the same arguments; ``seed`` one integer).

    Args:
        drafter: a :class:`~spiffy.models.dflash.DFlashDraftModel`, a dLLM drafter model or any
            :class:`~spiffy.arspec.Drafter` (ignored, may be ``None``, for ``method="ar"``).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
        method, budget: a name of :data:`spiffy.arspec.methods.METHODS`; tree nodes per round (root excluded;
            default :data:`spiffy.arspec.config.DEFAULT_BUDGET`, 0 = no drafts).
        temperature, top_p, top_k, seed: the target's decoding rule; the token at absolute position ``p`` uses noise
            keyed by ``(seed, p)``, so every method draws the same tokens.
        stop_token_ids: generation ends right after the first generated stop token (kept in the output).
        block_size: drafted block length (default: the drafter's).
    Raises:
        ConfigError: unknown method, ``budget < 0``, bad sampling, missing drafter, batch > 1;
        DrafterMismatchError: drafter and target do not fit; PromptTooLongError.
    """
    return ddtree_generate_batch(
        target, drafter, [one_prompt(input_ids)], method=method, budget=budget, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=int(seed), stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
        block_size=block_size, progress=progress,
    )[0]
