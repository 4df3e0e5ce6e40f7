"""Single-prompt AR speculative generation: thin wrappers over the batched loop (:mod:`spiffy.arspec.batch`).

:func:`speculative_generate` runs one prompt with any :class:`~spiffy.arspec.Drafter` and
:class:`~spiffy.arspec.AcceptanceRule` under one :class:`~spiffy.arspec.ARSpecConfig`; :func:`ddtree_generate` is
the keyword-argument entry point for a drafter model. Every method (:mod:`spiffy.arspec.methods`) shares the loop's
kernels, caches, sampling and timing; with the coupled rule all of them produce the AR output token for token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from spiffy.arspec.batch import GenerateKeywords, ddtree_generate_batch, prompt_lists, speculative_generate_batch
from spiffy.arspec.config import ARSpecConfig
from spiffy.arspec.drafter import Drafter
from spiffy.arspec.result import ARGenerationResult
from spiffy.arspec.rules import AcceptanceRule
from spiffy.capture import CompileSetting
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
    compile: CompileSetting = None,
) -> ARGenerationResult:
    """Generate one prompt with a Qwen3 target under ``config``: the drafter proposes, the target verifies in one
    forward per round, the acceptance rule decides (:func:`~spiffy.arspec.speculative_generate_batch` of one row).

    Args:
        drafter: a :class:`~spiffy.arspec.Drafter` (ignored, may be ``None``, for a method without a drafter).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
        rule: the acceptance rule (default: the one ``config.accept`` names, :func:`~spiffy.arspec.make_rule`).
        progress: show a tqdm bar over generated tokens on stderr.
        compile: the captured path (see :func:`~spiffy.arspec.speculative_generate_batch`).
    Raises:
        ConfigError: missing drafter, batch > 1, bad target; DrafterMismatchError; PromptTooLongError.
    """
    rules = None if rule is None else [rule]
    return speculative_generate_batch(target, [drafter], [one_prompt(input_ids)], config, rules=rules,
                                      progress=progress, compile=compile)[0]


def ddtree_generate(target: nn.Module, drafter: Any, input_ids: Any, **keywords: Unpack[GenerateKeywords]
                    ) -> ARGenerationResult:
    """Generate one prompt with a Qwen3 target by ``method`` (DDTree trees by default) with the coupled rule:
    :func:`~spiffy.arspec.ddtree_generate_batch` of one row, with the same keyword arguments and defaults
    (``method``, ``budget``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ``stop_token_ids``, ``block_size``, ``progress``).

    Args:
        drafter: a :class:`~spiffy.models.dflash.DFlashDraftModel`, a dLLM drafter model or any
            :class:`~spiffy.arspec.Drafter` (ignored, may be ``None``, for ``method="ar"``).
        input_ids: the prompt, ``[P]`` or ``[1, P]`` token ids (list or tensor).
    Raises:
        ConfigError: unknown method, ``budget < 0``, bad sampling, missing drafter, batch > 1;
        DrafterMismatchError: drafter and target do not fit; PromptTooLongError.
    """
    return ddtree_generate_batch(target, drafter, [one_prompt(input_ids)], **keywords)[0]
