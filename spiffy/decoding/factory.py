"""The session factory: :func:`make_session` builds the :class:`~spiffy.decoding.session.DecodeSession` of a model.

A model's family comes from the registry (:func:`spiffy.models.loading.family_of`, ``model_type`` ``llada``,
``Dream``, ``sdar``, ...); the family's registry entry names the decoding rule that decodes it
(:attr:`~spiffy.models.registry.FamilySpec.decoder`), and :data:`SESSIONS` maps that name to the session class, which
names its configuration class. Token ids (mask, EOS, end of turn) come from the one resolver of the models layer
(:func:`spiffy.models.loading.special_token_ids`), never from constants. Both the baseline path and Spiffy's
speculative path (:mod:`spiffy.selfspec`) drive the sessions built here; the public front door that dispatches
between them is :mod:`spiffy.api`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.dream import DreamSession
from spiffy.decoding.fast_dllm_v2 import FastDLLMv2Session
from spiffy.decoding.llada import LLaDASession
from spiffy.decoding.llada2 import LLaDA2Session
from spiffy.decoding.sdar import SDARSession
from spiffy.decoding.session import DecodeSession
from spiffy.errors import ConfigError, PromptTooLongError, UnknownModelTypeError
from spiffy.models.loading import family_of, mask_token_id, special_token_ids
from spiffy.models.registry import decoded_families, family_spec

#: every decoding rule, by the name a family's registry entry gives it (``FamilySpec.decoder``)
SESSIONS: dict[str, type[DecodeSession]] = {cls.rule: cls for cls in (LLaDASession, DreamSession, SDARSession,
                                                                       FastDLLMv2Session, LLaDA2Session)}


# ---------------------------------------------------------------------------------------------------- lookups
def session_class(family: str) -> type[DecodeSession]:
    """The session class that decodes ``family`` (UnknownModelTypeError for a family spiffy does not decode as a
    diffusion LM, e.g. a Qwen3 target)."""
    spec = family_spec(family)
    if spec.decoder is None:
        supported = ", ".join(s.model_type for s in decoded_families().values())
        raise UnknownModelTypeError(
            f"cannot decode a model with model_type={spec.model_type!r} as a diffusion LM; supported: {supported}; "
            "fix: load a diffusion LM checkpoint (AR targets use spiffy.ddtree_generate)"
        )
    return SESSIONS[spec.decoder]


def recalibration_flags() -> dict[str, str]:
    """``{calibrated_for field: CLI flag}`` over every decoding rule's configuration class (for graph mismatch
    hints)."""
    flags: dict[str, str] = {}
    for cls in SESSIONS.values():
        flags.update(cls.config_class.CLI_FLAGS)
    return flags


def context_length(model: Any) -> int | None:
    """The model's context window from its config (``max_position_embeddings`` / ``max_sequence_length``)."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "max_sequence_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def as_batch(input_ids: Any) -> torch.Tensor:
    """``[B, P]`` long ids from a tensor, a list, a ``[P]`` row or a tokenizer's BatchEncoding."""
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        input_ids = input_ids["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None, :]
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be [B, P] or [P], got shape {tuple(input_ids.shape)}")
    return input_ids.to(torch.long)


# ---------------------------------------------------------------------------------------------------- sessions
def make_session(
    model: Any,
    input_ids: Any,
    config: DecodeConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    family: str | None = None,
    **config_overrides: Any,
) -> DecodeSession:
    """A prepared :class:`~spiffy.decoding.session.DecodeSession` for ``model``'s family.

    Args:
        model: a loaded diffusion LM (LLaDA, Dream, SDAR, ...: a family with a decoding rule).
        input_ids: ``[B, P]`` (or ``[P]``) prompt ids; ragged batches left padded with ``attention_mask``.
        config: decoding configuration (default: the family's configuration class with its defaults); converted to
            the family's class (:meth:`~spiffy.decoding.config.DecodeConfig.from_config`); ``config_overrides``
            replace fields.
        attention_mask: ``[B, P]`` 0/1 prompt mask (0 = left padding).
        tokenizer: used to find special token ids missing from the config.
        generator: the random generator to consume (default: a new one seeded with ``config.seed``).
        family: force the family instead of reading ``model.config.model_type``.
    Raises:
        ConfigError (bad field), PromptTooLongError, MissingTokenError, UnknownModelTypeError.
    """
    cls = session_class(family_of(model) if family is None else family)
    cfg = cls.config_class.from_config(config, **config_overrides)
    ids = as_batch(input_ids)
    _check_context(model, ids.shape[1], cfg.gen_length)
    mask = cfg.mask_id if cfg.mask_id is not None else mask_token_id(model, tokenizer)
    token_ids = dataclasses.replace(special_token_ids(model, tokenizer), mask=int(mask))
    return cls.for_model(model, ids, cfg, token_ids=token_ids, attention_mask=attention_mask, generator=generator)


def make_row_sessions(
    model: Any,
    input_ids: Any,
    attention_mask: torch.Tensor | None,
    config: DecodeConfig,
    generators: Sequence[torch.Generator | None],
    tokenizer: Any = None,
) -> list[DecodeSession]:
    """One unpadded batch-1 session per prompt of the left-padded ``input_ids`` ``[B, P]`` (``attention_mask``
    ``[B, P]``, 0 = padding), each with its own generator: the row sessions of :mod:`spiffy.decoding.batch`."""
    ids = as_batch(input_ids)
    am = None if attention_mask is None else attention_mask.to(ids.device).bool()
    rows: list[DecodeSession] = []
    for r in range(ids.shape[0]):
        prompt = ids[r] if am is None else ids[r][am[r]]
        rows.append(make_session(model, prompt[None], config, tokenizer=tokenizer, generator=generators[r]))
    return rows


def _check_context(model: Any, prompt_len: int, gen_length: int) -> None:
    ctx = context_length(model)
    if ctx is not None and prompt_len + gen_length > ctx:
        raise PromptTooLongError(
            f"prompt ({prompt_len} tokens) + gen_length ({gen_length}) = {prompt_len + gen_length} exceeds the "
            f"model's context of {ctx} positions; fix: "
            + (f"shorten the prompt or lower gen_length to at most {ctx - prompt_len}" if ctx > prompt_len else
               f"shorten the prompt to at most {max(ctx - gen_length, 1)} tokens")
        )


__all__ = [
    "SESSIONS",
    "as_batch",
    "context_length",
    "make_row_sessions",
    "make_session",
    "recalibration_flags",
    "session_class",
]
