"""The model families spiffy knows, and their registration with transformers' Auto classes.

:data:`FAMILIES` is the one list of families: it maps a family name to a :class:`FamilySpec` holding every fact of the
family: the config ``model_type``, its model and config classes, its special tokens and where the mask id lives
(config key and tokenizer token), the official ``auto_map``, the chat template and tiny shape of its demo
checkpoints, the config spellings a draft graph's fingerprint hashes, and which decoding rule decodes it (a key of
:data:`spiffy.decoding.factory.SESSIONS`). Every other module derives its family lists from here; adding a family
is one model module plus one entry (docs/EXTENDING.md). :func:`register_with_transformers` (run when ``spiffy`` is
imported; idempotent) registers the families that replace remote code (a non-empty ``auto_map``) with
``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` so ``AutoModel.from_pretrained(dir)`` works without
``trust_remote_code`` even though the checkpoint's config.json carries the official remote-code ``auto_map``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from spiffy.errors import ConfigError
from spiffy.models.family_spec import FamilySpec
from spiffy.models.chat_templates import (
    DREAM_CHAT_TEMPLATE,
    LLADA_CHAT_TEMPLATE,
    LING_CHAT_TEMPLATE,
    LLAMA3_CHAT_TEMPLATE,
    MISTRAL_CHAT_TEMPLATE,
)

_REGISTERED = False


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
#: LLaDA-MoE keeps OLMoE's spellings plus its expert layout
_LLADA_MOE_ARCH_FIELDS: tuple[str, ...] = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "dense_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_experts_per_tok", "moe_layer_freq", "moe_router_enable_expert_bias", "qk_layernorm", "clip_qkv",
    "partial_rotary_factor", "attention_bias", "hidden_act", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
    "mask_token_id",
)
#: SDAR keeps Qwen3's spellings (explicit head_dim, attention_bias) plus its training block size
_SDAR_ARCH_FIELDS: tuple[str, ...] = _DREAM_ARCH_FIELDS + ("head_dim", "attention_bias", "block_size")
#: the MoE fields of SDAR-MoE (Qwen3-MoE spellings)
_MOE_ARCH_FIELDS: tuple[str, ...] = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    "norm_topk_prob",
)

#: LLaDA2's (BailingMoeV2) spellings of the architecture fields
_LLADA2_ARCH_FIELDS: tuple[str, ...] = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rope_theta", "partial_rotary_factor", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "use_qkv_bias", "use_bias", "use_qk_norm", "num_experts",
    "num_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
    "moe_intermediate_size", "first_k_dense_replace", "mask_token_id",
)

#: initializer std of tiny models: larger than the 0.02 of real models so a random model's distributions are
#: not flat (logit spread ~ std * sqrt(hidden)), which gives decoding tests distinct confidences.
TINY_INIT_STD = 0.1
#: the tiny shape of the Qwen-layout families (Dream, SDAR, Qwen3): hidden 64, 2 layers, 4 heads, 2 KV heads
_TINY_QWEN: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, initializer_range=TINY_INIT_STD, rms_norm_eps=1e-6, tie_word_embeddings=False,
)

#: what the DFlash drafter families share (qwen3 configs with ``dflash_config``, the target's tokens)
_DFLASH_DRAFTER: dict[str, Any] = dict(
    model_type="qwen3", config_class_path="transformers.Qwen3Config", mask_config_key="dflash_config.mask_token_id",
    mask_token="<|MASK|>", special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
    diffusion=False, drafter=True,
)
#: the tiny Qwen-family tokenizers' special tokens (ChatML, plus the ``<|MASK|>`` their DFlash drafters fill blocks with)
_QWEN_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")

#: every family spiffy knows, by name (the one list: every other family list is derived from it)
FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    FamilySpec(
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
        decoder="llada",
        chat_template=LLADA_CHAT_TEMPLATE,
        tiny_config=dict(
            d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_ratio=2, mlp_hidden_size=128, max_sequence_length=512,
            rope_theta=500000.0, init_std=TINY_INIT_STD, init_device=None, precision=None,
        ),
        vocab_fields=("vocab_size", "embedding_size"),
        auto_map={
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
    ),
    FamilySpec(
        # LLaDA-MoE-7B-A1B: the official config keeps LLaDA's model_type "llada"; its MoE keys tell it apart
        name="llada_moe",
        model_type="llada",
        model_class_path="spiffy.models.llada_moe.LLaDAMoEModelLM",
        config_class_path="spiffy.models.llada_moe.LLaDAMoEConfig",
        mask_config_key="mask_token_id",
        mask_token="<|mask|>",
        special_tokens=("<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"),
        eot_token="<|role_end|>",
        auto_map={
            "AutoConfig": "configuration_lladamoe.LLaDAConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
            "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        fingerprint_fields=_LLADA_MOE_ARCH_FIELDS,
        decoder="llada",
        chat_template=LING_CHAT_TEMPLATE,
        tiny_config=dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            dense_intermediate_size=128, expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            moe_layer_freq=[1, 1], max_position_embeddings=512, initializer_range=TINY_INIT_STD,
        ),
        variant_keys=("expert_intermediate_size", "num_experts"),
    ),
    FamilySpec(
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
        decoder="dream",
        chat_template=DREAM_CHAT_TEMPLATE,
        tiny_config=dict(_TINY_QWEN, rope_theta=1000000.0),
    ),
    FamilySpec(
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
        block_causal=True,
        fingerprint_fields=_SDAR_ARCH_FIELDS,
        decoder="sdar",
        tiny_config=dict(_TINY_QWEN, head_dim=16, rope_theta=1000000.0, max_window_layers=2),
    ),
    FamilySpec(
        name="llada2",
        model_type="llada2_moe",
        model_class_path="spiffy.models.llada2.LLaDA2MoeModelLM",
        config_class_path="spiffy.models.llada2.LLaDA2MoeConfig",
        mask_config_key="mask_token_id",
        mask_token="<|mask|>",
        special_tokens=("<|startoftext|>", "<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"),
        bos_token="<|startoftext|>",
        eot_token="<|role_end|>",
        auto_map={
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        base_model_class_path="spiffy.models.llada2.LLaDA2MoeModel",
        block_causal=True,
        fingerprint_fields=_LLADA2_ARCH_FIELDS,
        decoder="llada2",
        chat_template=LING_CHAT_TEMPLATE,
        tiny_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, initializer_range=TINY_INIT_STD, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_theta=600000.0, partial_rotary_factor=0.5, use_qkv_bias=False,
            use_bias=False, use_qk_norm=True, num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=32, first_k_dense_replace=1,
            embedding_dropout=0.0, attention_dropout=0.0, output_dropout=0.0,
        ),
    ),
    FamilySpec(
        # SDAR-30B-A3B-Chat / -Sci: SDAR with Qwen3-MoE feed-forward layers, decoded by SDAR's rule
        name="sdar_moe",
        model_type="sdar_moe",
        model_class_path="spiffy.models.sdar.SDARMoeForCausalLM",
        config_class_path="spiffy.models.sdar.SDARMoeConfig",
        mask_config_key="mask_token_id",
        mask_token="<|MASK|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
        auto_map={
            "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
            "AutoModel": "modeling_sdar_moe.SDARMoeModel",
            "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
        },
        base_model_class_path="spiffy.models.sdar.SDARMoeModel",
        block_causal=True,
        fingerprint_fields=_SDAR_ARCH_FIELDS + _MOE_ARCH_FIELDS,
        decoder="sdar",
        tiny_config=dict(
            _TINY_QWEN, head_dim=16, rope_theta=1000000.0, max_window_layers=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[],
        ),
    ),
    FamilySpec(
        name="qwen3",
        model_type="qwen3",
        model_class_path="transformers.Qwen3ForCausalLM",
        config_class_path="transformers.Qwen3Config",
        mask_config_key=None,
        mask_token=None,
        special_tokens=_QWEN_TOKENS,
        diffusion=False,
        tiny_config=dict(
            _TINY_QWEN, head_dim=16, max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        generation_stops=True,
    ),
    FamilySpec(
        name="qwen3_moe",
        model_type="qwen3_moe",
        model_class_path="transformers.Qwen3MoeForCausalLM",
        config_class_path="transformers.Qwen3MoeConfig",
        mask_config_key=None,
        mask_token=None,
        special_tokens=_QWEN_TOKENS,
        diffusion=False,
        tiny_config=dict(
            _TINY_QWEN, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        generation_stops=True,
    ),
    FamilySpec(
        name="qwen2",
        model_type="qwen2",
        model_class_path="transformers.Qwen2ForCausalLM",
        config_class_path="transformers.Qwen2Config",
        mask_config_key=None,
        mask_token=None,
        special_tokens=_QWEN_TOKENS,
        diffusion=False,
        tiny_config=dict(_TINY_QWEN, use_sliding_window=False, max_window_layers=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        generation_stops=True,
    ),
    FamilySpec(
        name="llama",
        model_type="llama",
        model_class_path="transformers.LlamaForCausalLM",
        config_class_path="transformers.LlamaConfig",
        mask_config_key=None,
        mask_token=None,
        # Llama 3's special tokens; the first reserved token is what its DFlash drafters fill blocks with
        special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"),
        eos_token="<|end_of_text|>",
        pad_token=None,
        bos_token="<|begin_of_text|>",
        eot_token="<|eot_id|>",
        diffusion=False,
        chat_template=LLAMA3_CHAT_TEMPLATE,
        tiny_config=dict(
            _TINY_QWEN, head_dim=16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        generation_stops=True,
    ),
    FamilySpec(
        name="mistral",
        model_type="mistral",
        model_class_path="transformers.MistralForCausalLM",
        config_class_path="transformers.MistralConfig",
        mask_config_key=None,
        mask_token=None,
        # Mistral v0.3's first tokens; a reserved control token is what its DFlash drafters fill blocks with
        special_tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[control_8]"),
        eos_token="</s>",
        pad_token=None,
        bos_token="<s>",
        eot_token="</s>",
        diffusion=False,
        chat_template=MISTRAL_CHAT_TEMPLATE,
        tiny_config=dict(_TINY_QWEN, head_dim=16, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
    FamilySpec(
        # a hybrid (Gated-DeltaNet linear attention between full attention layers): its recurrent layers run branch
        # by branch during verification (spiffy.models.recurrent.RecurrentMixers)
        name="qwen3_5",
        model_type="qwen3_5_text",
        model_class_path="transformers.Qwen3_5ForCausalLM",
        config_class_path="transformers.Qwen3_5TextConfig",
        mask_config_key=None,
        mask_token=None,
        special_tokens=_QWEN_TOKENS,
        diffusion=False,
        tiny_config=dict(
            _TINY_QWEN, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        ),
        generation_stops=True,
    ),
    FamilySpec(
        # a hybrid mixture-of-experts (Gated-DeltaNet linear attention between full attention layers, a shared
        # expert); its recurrent layers run branch by branch as Qwen3.5's do
        name="qwen3_next",
        model_type="qwen3_next",
        model_class_path="transformers.Qwen3NextForCausalLM",
        config_class_path="transformers.Qwen3NextConfig",
        mask_config_key=None,
        mask_token=None,
        special_tokens=_QWEN_TOKENS,
        diffusion=False,
        tiny_config=dict(
            _TINY_QWEN, head_dim=16, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                  "partial_rotary_factor": 0.25},
        ),
        generation_stops=True,
    ),
    FamilySpec(
        # Fast-dLLM v2 (NVlabs): Qwen2.5 turned block diffusion; the official generator's sub-block threshold rule
        name="fast_dllm_v2",
        model_type="Fast_dLLM_Qwen",
        model_class_path="spiffy.models.fast_dllm_v2.Fast_dLLM_QwenForCausalLM",
        config_class_path="spiffy.models.fast_dllm_v2.Fast_dLLM_QwenConfig",
        mask_config_key="mask_token_id",
        mask_token="|<MASK>|",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "|<MASK>|"),
        eos_token="<|im_end|>",
        auto_map={
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModel": "modeling.Fast_dLLM_QwenModel",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        base_model_class_path="spiffy.models.fast_dllm_v2.Fast_dLLM_QwenModel",
        block_causal=True,
        fingerprint_fields=_DREAM_ARCH_FIELDS + ("bd_size", "layer_types"),
        decoder="fast_dllm_v2",
        tiny_config=dict(_TINY_QWEN, rope_theta=1000000.0, max_window_layers=2, bd_size=8),
    ),
    FamilySpec(name="dflash", model_class_path="spiffy.models.dflash.DFlashDraftModel",
               loader_path="spiffy.models.dflash.load_drafter", **_DFLASH_DRAFTER),
    FamilySpec(name="dflash2", model_class_path="spiffy.models.dflash2.DFlash2DraftModel",
               loader_path="spiffy.models.dflash2.load_dflash2_drafter", **_DFLASH_DRAFTER),
)}

def fingerprint_fields() -> tuple[str, ...]:
    """The union of every family's architecture-field spellings, in first-seen order. A graph's
    ``config_fingerprint`` hashes the ones a config has, so unrelated bookkeeping (dtype, paths, transformers
    version, generation defaults) never changes it."""
    return tuple(dict.fromkeys(name for spec in FAMILIES.values() for name in spec.fingerprint_fields))


def model_types() -> dict[str, str]:
    """``{config.json model_type: family}``: the first family of each model type (``qwen3`` maps to the target;
    drafters share their target's model type and are recognised by their config)."""
    found: dict[str, str] = {}
    for name, spec in FAMILIES.items():
        if not spec.drafter:
            found.setdefault(spec.model_type, name)
    return found


def variant_family(config: Mapping[str, Any]) -> str | None:
    """The family a config dict belongs to by its :attr:`FamilySpec.variant_keys` (a family sharing its
    ``model_type`` with an earlier one: LLaDA-MoE's configs say ``"llada"`` and have expert fields); ``None``
    when no variant matches (the model type decides)."""
    model_type = config.get("model_type")
    for name, spec in FAMILIES.items():
        if spec.variant_keys and spec.model_type == model_type and any(k in config for k in spec.variant_keys):
            return name
    return None


def family_of_model_type(model_type: Any) -> str | None:
    """The family of a config.json ``model_type`` (case-insensitive, as transformers' spellings vary: ``Dream``);
    ``None`` for a model type no family has."""
    if not isinstance(model_type, str):
        return None
    types = model_types()
    exact = types.get(model_type)
    if exact is not None:
        return exact
    return next((f for t, f in types.items() if t.lower() == model_type.lower()), None)


def decoded_families() -> dict[str, FamilySpec]:
    """The families spiffy decodes as diffusion LMs (those with a :attr:`FamilySpec.decoder`)."""
    return {name: spec for name, spec in FAMILIES.items() if spec.decoder is not None}


def family_spec(family: str) -> FamilySpec:
    """The :class:`FamilySpec` of ``family`` (case-insensitive); ConfigError naming the known ones otherwise."""
    spec = FAMILIES.get(family.lower()) if isinstance(family, str) else None
    if spec is None:
        raise ConfigError(f"unknown model family {family!r}; fix: use one of {', '.join(FAMILIES)}")
    return spec


def register_with_transformers() -> None:
    """Register the configs and models of the families that replace remote code (LLaDA, Dream, SDAR: a non-empty
    ``auto_map``) with transformers' Auto classes (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    owners: dict[str, type] = {}
    for spec in FAMILIES.values():
        if not spec.auto_map:
            continue
        cfg_cls = spec.config_class
        if spec.model_type not in owners:  # a variant (same model_type) is reached through the owner's from_dict
            owners[spec.model_type] = cfg_cls
        _safe(AutoModel.register, cfg_cls, spec.base_model_class)
        _safe(AutoModelForCausalLM.register, cfg_cls, spec.model_class)
    for model_type, cfg_cls in owners.items():
        variants = any(s.variant_keys and s.model_type == model_type for s in FAMILIES.values())
        _safe(AutoConfig.register, model_type, _dispatching(cfg_cls) if variants else cfg_cls)
    _REGISTERED = True


def _dispatching(cfg_cls: type) -> type:
    """A subclass of ``cfg_cls`` (same name and model type) whose ``from_dict`` builds the variant family's config
    when the dict carries its :attr:`FamilySpec.variant_keys`, and ``cfg_cls`` itself otherwise: AutoConfig maps one
    model type to one class, and LLaDA and LLaDA-MoE checkpoints both say ``"llada"``."""

    def from_dict(cls: type, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        variant = variant_family(config_dict)
        target = FAMILIES[variant].config_class if variant else cfg_cls
        return target.from_dict(config_dict, **kwargs)

    return type(cfg_cls.__name__, (cfg_cls,), {"from_dict": classmethod(from_dict), "__module__": cfg_cls.__module__})


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
