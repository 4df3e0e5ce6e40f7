"""Model families (LLaDA, Dream, SDAR; Qwen3 targets; DFlash and DFlash2 drafters), loaders, tokenizers, prompts, tiny checkpoints.

Uniform forward contract of spiffy's own diffusion models (``LLaDAModelLM``, ``DreamModel``,
``SDARForCausalLM``)::

    out = model(input_ids [B, L], attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, store_kv=None, cache_policy=None, output_hidden_states=False)
    out.logits            # [B, L, V], raw and unshifted (Dream's shift is the decoder's business)
    out.past_key_values   # the cache passed in, or a new KVCache when use_cache=True and none was passed
                          # (transformers >= 5.2x names the field out.cache: spiffy.models.cache.HF_CACHE_NAME)
    out.hidden_states     # when output_hidden_states=True

``past_key_values`` is a :class:`~spiffy.models.cache.KVCache` or a transformers ``DynamicCache``; a cache of
batch 1 broadcasts against a query batch B. Queries see ``[cached ; new]`` keys. ``cache_policy="append"``
stores the new K/V, ``"read"`` only reads (SDAR's ``store_kv=True/False`` is the same switch; otherwise
``use_cache`` decides). ``position_ids`` default to ``cache_len + arange(L)``. Masks: None, 2-D key padding,
4-D bool / 0-1 float / additive float (see :func:`spiffy.models.layers.normalize_attention_mask`).
"""

from __future__ import annotations

from spiffy.models.backends import quiet_quantizer_import

quiet_quantizer_import()  # before the first transformers model import below (see spiffy.models.backends)

from spiffy.models.ar_checkpoints import make_tiny_dflash, make_tiny_dflash2, make_tiny_target, save_drafter
from spiffy.models.ar_drafters import drafter_kind, load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.cache import KVCache, as_kv_cache
from spiffy.models.dflash import DFlashDraftModel, TargetFeatureHooks, check_compatible, load_drafter
from spiffy.models.dflash2 import DFlash2DraftModel, load_dflash2_drafter
from spiffy.models.loading import (
    SpecialTokenIds,
    family_of,
    load_config,
    load_model,
    load_state_dict,
    load_target,
    load_tokenizer,
    mask_token_id,
    read_config_dict,
    resolve_dtype,
    save_checkpoint,
    special_token_ids,
)
from spiffy.models.prompting import prompt_token_ids, stop_token_ids
from spiffy.models.registry import FAMILIES, FamilySpec, family_spec, register_with_transformers
from spiffy.models.tiny import make_tiny
from spiffy.models.tokenizer import build_tokenizer

__all__ = [
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "FAMILIES",
    "FamilySpec",
    "KVCache",
    "SpecialTokenIds",
    "as_kv_cache",
    "build_tokenizer",
    "check_compatible",
    "drafter_kind",
    "family_of",
    "family_spec",
    "load_config",
    "load_dflash2_drafter",
    "load_ar_drafter",
    "load_model",
    "load_drafter",
    "load_state_dict",
    "load_target",
    "load_tokenizer",
    "make_tiny",
    "make_tiny_dflash",
    "make_tiny_dflash2",
    "make_tiny_dllm_drafter",
    "make_tiny_target",
    "mask_token_id",
    "prompt_token_ids",
    "read_config_dict",
    "register_with_transformers",
    "resolve_dtype",
    "save_checkpoint",
    "save_drafter",
    "special_token_ids",
    "stop_token_ids",
    "TargetFeatureHooks",
]

# transformers' AutoConfig / AutoModel / AutoModelForCausalLM know LLaDA, Dream and SDAR once the families are
# importable (spiffy/__init__.py triggers this import when transformers is imported first)
register_with_transformers()
