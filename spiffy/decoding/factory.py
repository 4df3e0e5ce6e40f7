"""The session factory: :func:`make_session` builds the family's :class:`~spiffy.decoding.session.DecodeSession`.

Families are recognised from the model config's ``model_type`` (``llada``, ``Dream``, ``sdar``). Token ids (mask,
EOS, EoT) come from the config or the tokenizer, never from constants. Both the baseline path and Spiffy's
speculative path (:mod:`spiffy.selfspec`) drive the sessions built here; the public front door that dispatches
between them is :mod:`spiffy.api`.
"""

from __future__ import annotations

from typing import Any

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.dream import DreamSession
from spiffy.decoding.llada import LLaDASession
from spiffy.decoding.sdar import SDARDecodeConfig
from spiffy.decoding.sdar import make_session as sdar_make_session
from spiffy.decoding.session import DecodeSession
from spiffy.errors import ConfigError, MissingTokenError, PromptTooLongError, UnknownModelTypeError
from spiffy.models.registry import FAMILIES

#: config.json ``model_type`` (lower-cased) -> decoding family
_MODEL_TYPES: dict[str, str] = {"llada": "llada", "dream": "dream", "sdar": "sdar"}

#: decoding family -> the configuration class its sessions read
FAMILY_CONFIGS: dict[str, type[DecodeConfig]] = {"llada": DecodeConfig, "dream": DecodeConfig, "sdar": SDARDecodeConfig}



# ---------------------------------------------------------------------------------------------------- lookups
def family_of(model: Any) -> str:
    """The decoding family of ``model`` from its config's ``model_type`` (UnknownModelTypeError otherwise)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    family = _MODEL_TYPES.get(str(model_type).lower()) if model_type is not None else None
    if family is None:
        raise UnknownModelTypeError(
            f"cannot decode a model with model_type={model_type!r} as a diffusion LM; supported: llada, Dream, sdar; "
            "fix: load a LLaDA, Dream or SDAR checkpoint (Qwen3 targets use spiffy.ddtree_generate)"
        )
    return family


def _tokenizer_token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None
    try:
        tid = tokenizer.convert_tokens_to_ids(token)
    except Exception:  # noqa: BLE001 - tokenizers raise various errors for unknown tokens
        return None
    if tid is None or isinstance(tid, list):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and tid == unk and token != getattr(tokenizer, "unk_token", None):
        return None
    return int(tid)


def recalibration_flags() -> dict[str, str]:
    """``{calibrated_for field: CLI flag}`` over every family's configuration class (for graph mismatch hints)."""
    flags: dict[str, str] = {}
    for config_class in FAMILY_CONFIGS.values():
        flags.update(config_class.CLI_FLAGS)
    return flags


def _family_token(family: str, role: str) -> str | None:
    """The registry's ``role`` token string of ``family`` (``None`` for a family the registry does not know)."""
    spec = FAMILIES.get(family)
    return None if spec is None else getattr(spec, role)


def resolve_mask_id(model: Any, family: str, config: DecodeConfig, tokenizer: Any = None) -> int:
    """The mask id: ``config.mask_id``, else the model config, else the tokenizer's mask token."""
    if config.mask_id is not None:
        return int(config.mask_id)
    cfg = getattr(model, "config", None)
    value = getattr(cfg, "mask_token_id", None)
    if value is not None:
        return int(value)
    if tokenizer is not None:
        value = getattr(tokenizer, "mask_token_id", None)
        if value is not None:
            return int(value)
        token = _family_token(family, "mask_token")
        if token is not None:
            tid = _tokenizer_token_id(tokenizer, token)
            if tid is not None:
                return tid
    raise MissingTokenError(
        f"no mask token id for this {family} model: the config has no mask_token_id and no tokenizer provides one; "
        "fix: pass mask_id=... (or a tokenizer with the family's mask token)"
    )


def resolve_eos_eot(model: Any, family: str, tokenizer: Any = None) -> tuple[int | None, int | None]:
    """``(eos_id, eot_id)`` from the model config (``eos_token_id``, ``eot_token_id``) or the tokenizer."""
    cfg = getattr(model, "config", None)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    eot = getattr(cfg, "eot_token_id", None)
    if eot is None:
        token = _family_token(family, "eot_token")
        eot = None if token is None else _tokenizer_token_id(tokenizer, token)
    return (None if eos is None else int(eos)), (None if eot is None else int(eot))


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
        model: a loaded LLaDA, Dream or SDAR model.
        input_ids: ``[B, P]`` (or ``[P]``) prompt ids; ragged batches left padded with ``attention_mask``.
        config: decoding configuration (default :class:`DecodeConfig`); ``config_overrides`` replace fields.
        attention_mask: ``[B, P]`` 0/1 prompt mask (LLaDA/Dream).
        tokenizer: used to find special token ids missing from the config.
        generator: the random generator to consume (default: a new one seeded with ``config.seed``).
        family: force the family instead of reading ``model.config.model_type``.
    Raises:
        ConfigError (bad field), PromptTooLongError, MissingTokenError, UnknownModelTypeError.
    """
    family = family_of(model) if family is None else family.lower()
    ids = as_batch(input_ids)
    if family == "sdar":
        gen_length = int(config_overrides.get("gen_length") or (config.gen_length if config is not None else DecodeConfig.gen_length))
        _check_context(model, ids.shape[1], gen_length)
        return sdar_make_session(
            model, ids, config, attention_mask=attention_mask, tokenizer=tokenizer, generator=generator, **config_overrides
        )
    cfg = config if config is not None else DecodeConfig()
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    _check_context(model, ids.shape[1], cfg.gen_length)
    mask_id = resolve_mask_id(model, family, cfg, tokenizer)
    if family == "llada":
        eos, eot = resolve_eos_eot(model, family, tokenizer)
        if (cfg.logits_eos_inf or cfg.confidence_eos_eot_inf) and eos is None:
            raise MissingTokenError(
                "logits_eos_inf / confidence_eos_eot_inf need the EOS id but neither the config nor the tokenizer "
                "has one; fix: pass a tokenizer or set eos_token_id in config.json"
            )
        return LLaDASession(
            model, ids, cfg, mask_id=mask_id, attention_mask=attention_mask, generator=generator, eos_id=eos, eot_id=eot
        )
    if family == "dream":
        return DreamSession(model, ids, cfg, mask_id=mask_id, attention_mask=attention_mask, generator=generator)
    raise UnknownModelTypeError(f"unknown decoding family {family!r}; fix: use llada, dream or sdar")


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
    "FAMILY_CONFIGS",
    "as_batch",
    "context_length",
    "family_of",
    "make_session",
    "recalibration_flags",
    "resolve_eos_eot",
    "resolve_mask_id",
]
