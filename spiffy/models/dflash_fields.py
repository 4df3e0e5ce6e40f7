"""The DFlash config fields that change what a drafter computes beyond its shapes, each honoured the way the official
``dflash`` package (PyPI 0.1.0, ``dflash/model.py``) reads it, or refused with a :class:`~spiffy.errors.ConfigError`:

* ``input_embedding_scale`` (``dflash_config`` first, then the config; default 1): the block's target embeddings
  are multiplied by it before the first layer;
* ``output_multiplier`` (same lookup; default 1): the logits are multiplied by it;
* ``final_logit_softcapping`` (same lookup; default none; active when > 0): logits ``cap * tanh(logits / cap)``,
  after the multiplier;
* ``is_causal`` (the config's own attribute; default none): ``true`` makes every layer causal, ``false`` every layer
  bidirectional; unset, ``sliding_attention`` layers are causal and ``full_attention`` layers bidirectional;
* ``layer_types`` + ``sliding_window``: a ``sliding_attention`` layer sees the keys less than ``sliding_window``
  positions behind its query (and ahead, when bidirectional); ``full_attention`` has no limit; any other kind is
  refused.

A layer's visibility is built over position ids (the official package builds it over key indices, which are the
positions of its contiguous cache): key ``k`` is visible to query ``q`` when ``pos_k <= pos_q`` (causal) and
``|pos_q - pos_k| < window`` (sliding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from spiffy.errors import ConfigError

__all__ = [
    "LAYER_KINDS",
    "LayerAttention",
    "draft_value",
    "input_embedding_scale",
    "layer_attention",
    "layer_visibility",
    "output_logits",
]

#: the layer kinds a DFlash drafter's ``layer_types`` may name
LAYER_KINDS: tuple[str, ...] = ("full_attention", "sliding_attention")


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash field read from ``config.dflash_config`` first, then from the config itself (``None`` = absent)."""
    extras = getattr(config, "dflash_config", None) or {}
    if isinstance(extras, dict) and extras.get(name) is not None:
        return extras[name]
    value = getattr(config, name, None)
    return default if value is None else value


def _number(config: Any, name: str, default: float | None) -> float | None:
    value = draft_value(config, name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"the drafter config's {name} is {value!r}; fix: a finite number (or remove it)")
    return float(value)


def input_embedding_scale(config: Any) -> float:
    """The factor on the block's target embeddings (``input_embedding_scale``, default 1)."""
    return float(_number(config, "input_embedding_scale", 1.0))  # type: ignore[arg-type]


def output_logits(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """``logits`` after ``output_multiplier`` and then ``final_logit_softcapping`` (when > 0)."""
    multiplier = _number(config, "output_multiplier", 1.0)
    if multiplier != 1.0:
        logits = logits * multiplier
    cap = _number(config, "final_logit_softcapping", None)
    if cap is not None and cap > 0:
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass(frozen=True)
class LayerAttention:
    """What one drafter layer's queries see among ``[cached context ; new context ; block]`` keys.

    Attributes:
        causal: keys at positions after the query's are hidden.
        window: keys ``window`` or more positions away are hidden (``None``: no limit).
    """

    causal: bool = False
    window: int | None = None

    @property
    def masked(self) -> bool:
        """Whether the layer hides any key by position (else it sees every key it is given)."""
        return self.causal or self.window is not None


def layer_attention(config: Any, num_layers: int) -> list[LayerAttention]:
    """Each layer's :class:`LayerAttention` from ``layer_types``, ``sliding_window`` and ``is_causal``.

    Raises:
        ConfigError: a layer kind other than :data:`LAYER_KINDS`, a non-boolean ``is_causal``, or a sliding window
            that is not a positive integer.
    """
    kinds = list(getattr(config, "layer_types", None) or [])
    bad = sorted({str(k) for k in kinds} - set(LAYER_KINDS))
    if bad:
        raise ConfigError(f"the drafter config's layer_types name {bad}, which a DFlash drafter does not have; fix: "
                          f"use {LAYER_KINDS} (or remove layer_types)")
    is_causal = getattr(config, "is_causal", None)
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ConfigError(f"the drafter config's is_causal is {is_causal!r}; fix: true, false or remove it")
    window = getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"the drafter config's sliding_window is {window!r}; fix: a positive integer or null")
    out = []
    for i in range(int(num_layers)):
        sliding = i < len(kinds) and kinds[i] == "sliding_attention"
        causal = sliding if is_causal is None else is_causal
        out.append(LayerAttention(causal=bool(causal), window=int(window) if sliding and window else None))
    return out


def layer_visibility(layer: LayerAttention, query_pos: torch.Tensor, key_pos: torch.Tensor,
                     attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask of one layer: ``query_pos [B, L]`` and ``key_pos [B, K]`` position ids, combined with the caller's
    ``attention_mask`` (``[B|1, 1, L|1, K]`` bool, True = visible, or additive float; ``None``: all visible).
    Returns ``attention_mask`` itself for an unmasked layer, else a ``[B, 1, L, K]`` mask of its kind."""
    if not layer.masked:
        return attention_mask
    dist = query_pos.unsqueeze(-1) - key_pos.unsqueeze(1)  # [B, L, K]: how far behind the query each key is
    visible = torch.ones_like(dist, dtype=torch.bool)
    if layer.causal:
        visible &= dist >= 0
    if layer.window is not None:
        visible &= dist < layer.window
        if not layer.causal:
            visible &= -dist < layer.window
    visible = visible.unsqueeze(1)
    if attention_mask is None:
        return visible
    if attention_mask.dtype == torch.bool:
        return visible & attention_mask
    return attention_mask.masked_fill(~visible, torch.finfo(attention_mask.dtype).min)
