"""The model families spiffy knows, and their registration with transformers' Auto classes.

:data:`FAMILIES` maps a family name (``"llada"``, ``"dream"``, ``"sdar"``, ``"qwen3"``, ``"dflash"``) to a
:class:`FamilySpec`: the config ``model_type``, how to get the model class, where the mask token lives (config key
and tokenizer token), and the official ``auto_map``. :func:`register_with_transformers` (run when ``spiffy`` is
imported; idempotent) registers LLaDA / Dream / SDAR with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM`` so ``AutoModel.from_pretrained(dir)`` works without ``trust_remote_code`` even though
the checkpoint's config.json carries the official remote-code ``auto_map``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from spiffy.errors import ConfigError

_REGISTERED = False


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class FamilySpec:
    """Facts about one model family.

    Attributes:
        name: family name used throughout spiffy.
        model_type: config.json ``model_type``.
        model_class_path: dotted path of the causal-LM class ``load_model`` builds.
        config_class_path: dotted path of the config class.
        mask_config_key: dotted config attribute holding the mask id (``None``: no mask token in the config).
        mask_token: the tokenizer's mask token string (``None``: the family has none).
        special_tokens: the family's special tokens, in the order
            :func:`~spiffy.models.tokenizer.build_tokenizer` adds them (their ids follow the learned vocabulary).
        eos_token, pad_token, bos_token: the tokenizer's end-of-sequence / padding / beginning tokens (``None``:
            none).
        eot_token: the end-of-turn token a chat response ends with (LLaDA ``<|eot_id|>``, ChatML ``<|im_end|>``).
        auto_map: the official ``auto_map`` written into config.json (empty for native transformers models).
        diffusion: whether the family is a diffusion LM (has a mask token and is decoded by denoising).
        shifted_logits: whether token ``i`` is read from logits ``i - 1`` (Dream).
        base_model_class_path: the class ``AutoModel`` maps to when it differs from the causal-LM class.
        fingerprint_fields: the family's config spellings of the fields that define the architecture (what a draft
            graph's ``config_fingerprint`` hashes; see :func:`fingerprint_fields`).
    """

    name: str
    model_type: str
    model_class_path: str
    config_class_path: str
    mask_config_key: str | None
    mask_token: str | None
    special_tokens: tuple[str, ...]
    eos_token: str | None = "<|endoftext|>"
    pad_token: str | None = "<|endoftext|>"
    bos_token: str | None = None
    eot_token: str | None = "<|im_end|>"
    auto_map: dict[str, str] = field(default_factory=dict)
    diffusion: bool = True
    shifted_logits: bool = False
    base_model_class_path: str | None = None
    fingerprint_fields: tuple[str, ...] = ()

    @property
    def model_class(self) -> type:
        return _import(self.model_class_path)

    @property
    def config_class(self) -> type:
        return _import(self.config_class_path)

    def mask_id_from_config(self, config: Any) -> int | None:
        """The mask id stored in ``config`` under :attr:`mask_config_key` (``None`` when absent)."""
        if self.mask_config_key is None:
            return None
        value: Any = config
        for part in self.mask_config_key.split("."):
            if value is None:
                return None
            value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        return None if value is None else int(value)

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        """Token strings that end a response: end of sequence, then end of turn (distinct, ``None`` dropped)."""
        return tuple(dict.fromkeys(t for t in (self.eos_token, self.eot_token) if t is not None))

    def token_roles(self) -> dict[str, str]:
        """``{role: token}`` for the tokenizer's ``bos``/``eos``/``pad``/``mask`` roles the family defines."""
        roles = {"bos": self.bos_token, "eos": self.eos_token, "pad": self.pad_token, "mask": self.mask_token}
        return {role: token for role, token in roles.items() if token is not None}


#: LLaDA's own (OLMo-style) config spellings of the architecture fields
_LLADA_ARCH_FIELDS: tuple[str, ...] = (
    "model_type", "vocab_size", "embedding_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "multi_query_attention",
    "mlp_ratio", "mlp_hidden_size", "activation_type", "block_type", "rope", "rope_theta", "alibi", "layer_norm_type",
    "include_bias", "include_qkv_bias", "weight_tying", "scale_logits", "input_emb_norm", "attention_layer_norm",
    "max_sequence_length", "mask_token_id",
)
#: Dream keeps Qwen2's config spellings
_DREAM_ARCH_FIELDS: tuple[str, ...] = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "hidden_act", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "use_sliding_window", "mask_token_id",
)
#: SDAR keeps Qwen3's spellings (explicit head_dim, attention_bias) plus its training block size
_SDAR_ARCH_FIELDS: tuple[str, ...] = _DREAM_ARCH_FIELDS + ("head_dim", "attention_bias", "block_size")

FAMILIES: dict[str, FamilySpec] = {
    "llada": FamilySpec(
        name="llada",
        model_type="llada",
        model_class_path="spiffy.models.llada.LLaDAModelLM",
        config_class_path="spiffy.models.llada.LLaDAConfig",
        mask_config_key="mask_token_id",
        mask_token="<|mdm_mask|>",
        special_tokens=(
            "<|endoftext|>",
            "<|startoftext|>",
            "<|mdm_mask|>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
        ),
        bos_token="<|startoftext|>",
        eot_token="<|eot_id|>",
        fingerprint_fields=_LLADA_ARCH_FIELDS,
        auto_map={
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
    ),
    "dream": FamilySpec(
        name="dream",
        model_type="Dream",
        model_class_path="spiffy.models.dream.DreamModel",
        config_class_path="spiffy.models.dream.DreamConfig",
        mask_config_key="mask_token_id",
        mask_token="<|mask|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"),
        auto_map={
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        shifted_logits=True,
        fingerprint_fields=_DREAM_ARCH_FIELDS,
    ),
    "sdar": FamilySpec(
        name="sdar",
        model_type="sdar",
        model_class_path="spiffy.models.sdar.SDARForCausalLM",
        config_class_path="spiffy.models.sdar.SDARConfig",
        mask_config_key="mask_token_id",
        mask_token="<|MASK|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
        auto_map={
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        base_model_class_path="spiffy.models.sdar.SDARModel",
        fingerprint_fields=_SDAR_ARCH_FIELDS,
    ),
    "qwen3": FamilySpec(
        name="qwen3",
        model_type="qwen3",
        model_class_path="transformers.Qwen3ForCausalLM",
        config_class_path="transformers.Qwen3Config",
        mask_config_key=None,
        mask_token=None,
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
        diffusion=False,
    ),
    "dflash": FamilySpec(
        name="dflash",
        model_type="qwen3",
        model_class_path="spiffy.models.dflash.DFlashDraftModel",
        config_class_path="transformers.Qwen3Config",
        mask_config_key="dflash_config.mask_token_id",
        mask_token="<|MASK|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
        diffusion=False,
    ),
}

def fingerprint_fields() -> tuple[str, ...]:
    """The union of every family's architecture-field spellings, in first-seen order. A graph's
    ``config_fingerprint`` hashes the ones a config has, so unrelated bookkeeping (dtype, paths, transformers
    version, generation defaults) never changes it."""
    return tuple(dict.fromkeys(name for spec in FAMILIES.values() for name in spec.fingerprint_fields))


#: config.json ``model_type`` -> family (``qwen3`` maps to the target; drafters are recognised by their config)
MODEL_TYPE_TO_FAMILY: dict[str, str] = {"llada": "llada", "Dream": "dream", "sdar": "sdar", "qwen3": "qwen3"}


def family_spec(family: str) -> FamilySpec:
    """The :class:`FamilySpec` of ``family`` (case-insensitive); ConfigError naming the known ones otherwise."""
    spec = FAMILIES.get(family.lower()) if isinstance(family, str) else None
    if spec is None:
        raise ConfigError(f"unknown model family {family!r}; supported: {', '.join(FAMILIES)}")
    return spec


def register_with_transformers() -> None:
    """Register LLaDA / Dream / SDAR configs and models with transformers' Auto classes (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for name in ("llada", "dream", "sdar"):
        spec = FAMILIES[name]
        cfg_cls = spec.config_class
        lm_cls = spec.model_class
        base_cls = _import(spec.base_model_class_path) if spec.base_model_class_path else lm_cls
        _safe(AutoConfig.register, spec.model_type, cfg_cls)
        _safe(AutoModel.register, cfg_cls, base_cls)
        _safe(AutoModelForCausalLM.register, cfg_cls, lm_cls)
    _REGISTERED = True


def _safe(register: Callable[..., Any], *args: Any) -> None:
    """Call an Auto ``register`` and ignore "already registered" (a re-import, or another copy of spiffy)."""
    try:
        register(*args, exist_ok=True)
    except TypeError:  # older transformers without exist_ok
        try:
            register(*args)
        except ValueError:
            pass
    except ValueError:
        pass
