"""Dream's generation settings: every field a Dream-family checkpoint's ``generation_config.json`` (or a
``DreamGenerationConfig``) carries, honoured or refused, and the defaults Dream's own ``diffusion_generate`` uses.

The Dream family here is every ``model_type`` ``Dream`` checkpoint: Dream-v0 (Dream-org), Dream-Coder-v0 (Dream-org)
and DiffuCoder-7B Base / Instruct / cpGRPO (apple, whose model cards say they reuse Dream's modeling and generation
code). Their generator is Dream's ``DreamGenerationMixin`` (read in github.com/DreamLM/Dream-Coder, which vendors
it as ``instruct/code_eval/lcb/diffusion_utils/dream_utils.py``); spiffy's rule is :mod:`spiffy.decoding.dream`.

Fields (:func:`dream_generation_options` maps them to ``diffusion_generate``'s keywords):

* the rule: ``steps``, ``eps``, ``alg`` (origin / maskgit_plus / topk_margin / entropy), ``alg_temp``,
  ``temperature``, ``top_p``, ``top_k``; the length: ``max_new_tokens`` (else ``max_length`` minus the prompt);
* tokens: ``mask_token_id`` (the only id Dream's sampler reads); ``bos_token_id``, ``eos_token_id``,
  ``pad_token_id`` are accepted and change nothing (the sampler never reads them: DiffuCoder-Instruct's responses
  end in ``<|dlm_pad|>`` padding, which is cut from the text afterwards, not during decoding);
* the output form: ``output_history``, ``return_dict_in_generate``; metadata: ``_from_model_config``,
  ``_commit_hash``, ``transformers_version``;
* refused with :class:`~spiffy.errors.ConfigError`: ``num_return_sequences`` other than 1 (repeat the prompt rows
  with their own seeds instead), a non-empty ``generation_kwargs``, a non-zero ``eos_penalty`` (the Dream-Coder
  demos' option: not part of the vendored generator, so its exact effect cannot be reproduced), ``alg`` of the
  ``transition_N`` schedule, and any other key.

**Where the official defaults come from** (a quirk to follow): called without a ``generation_config`` object,
``diffusion_generate`` does not read ``generation_config.json``. It builds ``DreamGenerationConfig.from_model_config
(model.config)``: the class defaults (``steps`` 512, ``eps`` 1e-3, ``alg`` origin, ``alg_temp`` None,
``temperature`` 0, ``top_p`` / ``top_k`` None) overridden by every non-None value of the model config's dict. Under
transformers 4.46.2, the version the model cards pin, that dict carries ``PretrainedConfig``'s legacy generation
defaults, so an option the caller leaves out is ``temperature`` 1.0, ``top_k`` 50, ``top_p`` 1.0: DiffuCoder's and
Dream-Coder's recommended calls (``top_p`` 0.95, no ``top_k``) therefore sample from the top 50 tokens, and their
``maskgit_plus`` / ``entropy`` confidences are computed on that renormalised top 50. :func:`official_call_defaults`
returns these values (``dream_diffusion_generate(..., official_defaults=True)`` uses them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spiffy.decoding.config import DREAM_ALGS
from spiffy.errors import ConfigError

#: fields that set the decoding rule or length: ``diffusion_generate``'s keyword of the same name
RULE_FIELDS: tuple[str, ...] = (
    "steps", "eps", "alg", "alg_temp", "temperature", "top_p", "top_k", "max_new_tokens", "max_length",
    "mask_token_id",
)
#: fields that change what is returned, not the tokens
OUTPUT_FIELDS: tuple[str, ...] = ("output_history", "return_dict_in_generate")
#: token ids Dream's sampler never reads (accepted, no effect on the tokens)
UNUSED_TOKEN_FIELDS: tuple[str, ...] = ("bos_token_id", "eos_token_id", "pad_token_id")
#: bookkeeping written by transformers
METADATA_FIELDS: tuple[str, ...] = ("_from_model_config", "_commit_hash", "transformers_version")
#: ``DreamGenerationConfig``'s own defaults
CLASS_DEFAULTS: dict[str, Any] = {
    "steps": 512, "eps": 1e-3, "alg": "origin", "alg_temp": None, "temperature": 0.0, "top_p": None, "top_k": None,
}
#: ``PretrainedConfig``'s legacy generation attributes under transformers 4.46.2 (every model config has them)
TRANSFORMERS4_CONFIG_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
#: the calls the model cards recommend (``steps = max_new_tokens // tokens_per_step``; ``top_k`` is left out, so the
#: official code uses the model config's 50): DiffuCoder's README and inference_demo.py (github.com/apple/
#: ml-diffucoder), Dream-Coder's README (github.com/DreamLM/Dream-Coder)
MODEL_CARD_CALLS: dict[str, dict[str, Any]] = {
    "apple/DiffuCoder-7B-Base": dict(alg="entropy", alg_temp=0.0, temperature=0.2, top_p=0.95, tokens_per_step=1),
    "apple/DiffuCoder-7B-Instruct": dict(alg="entropy", alg_temp=0.0, temperature=0.3, top_p=0.95,
                                         tokens_per_step=1),
    "apple/DiffuCoder-7B-cpGRPO": dict(alg="entropy", alg_temp=0.0, temperature=0.4, top_p=0.95, tokens_per_step=1),
    "Dream-org/Dream-Coder-v0-Instruct-7B": dict(alg="entropy", alg_temp=0.0, temperature=0.1, top_p=0.95,
                                                 tokens_per_step=1),
}
#: what is read from a generation-config object
_OBJECT_FIELDS: tuple[str, ...] = RULE_FIELDS + OUTPUT_FIELDS + ("num_return_sequences", "generation_kwargs",
                                                                  "eos_penalty")


def _as_dict(gen: Any) -> dict[str, Any]:
    """A generation config as a dict: a mapping, a path (file or checkpoint directory) or an object."""
    if isinstance(gen, Mapping):
        return dict(gen)
    if isinstance(gen, (str, os.PathLike)):
        path = Path(gen)
        path = path / "generation_config.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the generation config {str(path)!r}: {exc}; fix: pass a readable "
                              "generation_config.json") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{str(path)!r} is not a JSON object; fix: pass a generation_config.json")
        return data
    # an object (DreamGenerationConfig, transformers' GenerationConfig): the attributes Dream's generator reads or
    # spiffy refuses (a GenerationConfig also carries AR-only attributes Dream's generator never looks at)
    return {k: getattr(gen, k) for k in _OBJECT_FIELDS if getattr(gen, k, None) is not None}


def check_alg(alg: Any) -> str:
    """``alg`` if Dream's sampler has it, else :class:`ConfigError` (``transition_N`` is named: not supported)."""
    if isinstance(alg, str) and alg.startswith("transition"):
        raise ConfigError(f"alg={alg!r} (the transition schedule of Dream-Coder's vendored generator) is not "
                          f"supported; fix: use one of {', '.join(DREAM_ALGS)}")
    if alg not in DREAM_ALGS:
        raise ConfigError(f"alg={alg!r} is unknown to Dream's generator; fix: use one of {', '.join(DREAM_ALGS)}")
    return str(alg)


def dream_generation_options(gen: Any) -> dict[str, Any]:
    """The ``diffusion_generate`` keywords a Dream generation config sets, every field checked.

    Args:
        gen: ``generation_config.json`` as a dict, its path (or the checkpoint directory), or a generation-config
            object (``DreamGenerationConfig`` / ``GenerationConfig``).
    Returns:
        the fields of :data:`RULE_FIELDS` and :data:`OUTPUT_FIELDS` present (``None`` values kept: Dream's "off").
    Raises:
        ConfigError: a refused field or value (see the module docstring), naming it and the fix.
    """
    data = _as_dict(gen)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in RULE_FIELDS or key in OUTPUT_FIELDS:
            out[key] = value
        elif key in UNUSED_TOKEN_FIELDS or key in METADATA_FIELDS:
            continue
        elif key == "num_return_sequences":
            if value not in (None, 1):
                raise ConfigError(f"num_return_sequences={value!r} is not supported; fix: repeat the prompt row "
                                  "once per sample (each row takes its own seed) and use num_return_sequences=1")
        elif key == "generation_kwargs":
            if value:
                raise ConfigError(f"generation_kwargs={value!r} is not supported by Dream's generator; fix: pass "
                                  "the options themselves")
        elif key == "eos_penalty":
            if value not in (None, 0, 0.0):
                raise ConfigError(f"eos_penalty={value!r} is not supported (Dream's generator has no EOS penalty, so "
                                  "spiffy cannot reproduce one exactly); fix: remove it or set it to 0")
        else:
            raise ConfigError(f"generation config field {key!r} is unknown to Dream's generator; fix: remove it "
                              f"(known: {', '.join(RULE_FIELDS + OUTPUT_FIELDS + UNUSED_TOKEN_FIELDS)})")
    if "alg" in out and out["alg"] is not None:
        out["alg"] = check_alg(out["alg"])
    return out


def official_call_defaults(model_config: Any, transformers4: bool = True) -> dict[str, Any]:
    """The rule options ``diffusion_generate`` uses when neither the caller nor a generation-config object sets
    them: ``DreamGenerationConfig.from_model_config(model.config)`` (see the module docstring).

    Args:
        model_config: the model's config (object or dict).
        transformers4: add ``PretrainedConfig``'s legacy generation attributes of transformers 4.46.2
            (:data:`TRANSFORMERS4_CONFIG_DEFAULTS`), as every config had them there.
    Returns:
        ``steps``, ``eps``, ``alg``, ``alg_temp``, ``temperature``, ``top_p``, ``top_k`` and, when the config has
        one, ``mask_token_id``.
    """
    cfg = model_config if isinstance(model_config, Mapping) else (
        model_config.to_dict() if hasattr(model_config, "to_dict") else dict(vars(model_config)))
    out = dict(CLASS_DEFAULTS)
    if transformers4:
        out.update(TRANSFORMERS4_CONFIG_DEFAULTS)
    for key in (*CLASS_DEFAULTS, "mask_token_id"):
        if cfg.get(key) is not None:  # from_model_config drops the config's None values
            out[key] = cfg[key]
    return out


def card_decode_options(model: str, gen_length: int, tokens_per_step: int | None = None) -> dict[str, Any]:
    """:class:`~spiffy.decoding.config.DecodeConfig` fields of a model card's recommended call, as the official code
    runs it (``top_k`` 50 and ``top_p`` from the call; one block, no cache).

    Args:
        model: a key of :data:`MODEL_CARD_CALLS`.
        gen_length: ``max_new_tokens``.
        tokens_per_step: the cards' ``TOKEN_PER_STEP`` (``None`` = the card's 1); must divide ``gen_length``.
    """
    if model not in MODEL_CARD_CALLS:
        raise ConfigError(f"no model-card call for {model!r}; fix: use one of {', '.join(MODEL_CARD_CALLS)}")
    call = dict(MODEL_CARD_CALLS[model])
    tps = int(call.pop("tokens_per_step") if tokens_per_step is None else tokens_per_step)
    if tps < 1 or gen_length % tps:
        raise ConfigError(f"tokens_per_step={tps} does not divide gen_length={gen_length}; fix: choose a divisor")
    call.pop("tokens_per_step", None)
    defaults = official_call_defaults({})
    return dict(gen_length=gen_length, steps=gen_length // tps, eps=defaults["eps"], top_k=defaults["top_k"], **call)


__all__ = [
    "CLASS_DEFAULTS", "MODEL_CARD_CALLS", "card_decode_options", "METADATA_FIELDS", "OUTPUT_FIELDS", "RULE_FIELDS", "TRANSFORMERS4_CONFIG_DEFAULTS",
    "UNUSED_TOKEN_FIELDS", "check_alg", "dream_generation_options", "official_call_defaults",
]
