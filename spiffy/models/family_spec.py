"""One model family's facts (:class:`FamilySpec`): the record every entry of
:data:`spiffy.models.registry.FAMILIES` is, kept apart so the registry module holds the entries alone."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from spiffy.errors import ConfigError
from spiffy.models.chat_templates import CHATML_TEMPLATE


def import_path(path: str) -> Any:
    """The object a dotted path ``package.module.Name`` names."""
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
        block_causal: whether attention is block-causal (SDAR: bidirectional inside a block, causal across blocks).
        base_model_class_path: the class ``AutoModel`` maps to when it differs from the causal-LM class.
        fingerprint_fields: the family's config spellings of the fields that define the architecture (what a draft
            graph's ``config_fingerprint`` hashes; see :func:`fingerprint_fields`).
        decoder: the decoding rule that decodes the family, a key of :data:`spiffy.decoding.factory.SESSIONS` (each
            session class's ``rule``); ``None``: not a diffusion LM spiffy decodes (AR targets, drafters).
        drafter: the family is a drafter of AR targets (its tiny checkpoint is sized to a target).
        loader_path: a drafter family's loader, ``(path, dtype=, device=, device_map=, offload_folder=, max_memory=)
            -> model`` (what :func:`~spiffy.models.loading.load_model` calls for it; its tiny checkpoint writer is
            named in :data:`spiffy.models.tiny.DRAFTER_WRITERS`).
        chat_template: the chat template of the family's tiny tokenizer (:mod:`spiffy.models.chat_templates`).
        tiny_config: the architecture values of the family's tiny random checkpoint (:func:`spiffy.models.tiny.make_tiny`;
            token ids and the vocabulary size are filled from its tokenizer).
        vocab_fields: the config keys that take the vocabulary size.
        generation_stops: the tiny checkpoint's ``generation_config.json`` lists every stop id as ``eos_token_id``
            (as Qwen3 checkpoints do), not the EOS id alone.
        verifiable: an AR family (transformers' class) whose layers a 4-D tree mask and a croppable K/V cache
            verify exactly: an AR target. ``False``: written and loaded, but refused as a target
            (:func:`spiffy.models.target.check_target_config` says why).
        variant_keys: for a family that shares its ``model_type`` with an earlier one (LLaDA-MoE's ``"llada"``): the
            config keys whose presence marks a config as this family's (see :func:`variant_family`).
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
    block_causal: bool = False
    base_model_class_path: str | None = None
    fingerprint_fields: tuple[str, ...] = ()
    decoder: str | None = None
    drafter: bool = False
    loader_path: str | None = None
    chat_template: str = CHATML_TEMPLATE
    tiny_config: Mapping[str, Any] = field(default_factory=dict)
    vocab_fields: tuple[str, ...] = ("vocab_size",)
    generation_stops: bool = False
    verifiable: bool = True
    variant_keys: tuple[str, ...] = ()

    @property
    def model_class(self) -> type:
        return import_path(self.model_class_path)

    @property
    def config_class(self) -> type:
        return import_path(self.config_class_path)

    @property
    def loader(self) -> Callable[..., Any]:
        """A drafter family's checkpoint loader (:attr:`loader_path`)."""
        if self.loader_path is None:
            raise ConfigError(f"the {self.name} family has no drafter loader")
        return import_path(self.loader_path)

    @property
    def base_model_class(self) -> type:
        """The class ``AutoModel`` maps to (the causal-LM class unless :attr:`base_model_class_path` says)."""
        return import_path(self.base_model_class_path) if self.base_model_class_path else self.model_class

    @property
    def own_classes(self) -> bool:
        """Whether spiffy implements the family's classes (rather than transformers)."""
        return self.model_class_path.startswith("spiffy.")

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
