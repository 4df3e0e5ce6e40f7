"""Fast-dLLM v2 (NVlabs, ``model_type="Fast_dLLM_Qwen"``): block diffusion adapted from Qwen2.5 (Qwen2 layout).

Own implementation keeping the official config keys and parameter names (Qwen2 layout: ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}``, ``model.layers.{i}.self_attn.o_proj.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight``, ``model.norm.weight``, ``lm_head.weight``; no ``lm_head`` when
``tie_word_embeddings``, as the 1.5B checkpoint).

Attention at inference is block-causal: a query at absolute position ``p`` sees key ``j`` iff
``j // block_size <= p // block_size``. The official ``forward`` builds that mask itself from its ``block_size``
argument (default 32, whatever the config's ``bd_size``) and the cache length; spiffy does the same when
``attention_mask`` is None (``block_size=`` keyword, default 32), and accepts explicit 4-D masks like the other
families. Logits are raw: the official generator reads token ``i`` of a block from logits ``i - 1`` (the first
position of a block from its own logits); that shift is the decoder's business (:mod:`spiffy.decoding.fast_dllm_v2`).

Config fields (the published ``config.json`` of Fast_dLLM_v2_7B / 1.5B): the Qwen2 architecture fields are honoured;
``rope_scaling`` other than plain RoPE, a ``hidden_act`` other than ``silu``, ``use_sliding_window=True`` and any
``layer_types`` entry other than ``full_attention`` are refused (ConfigError); ``bd_size`` (the training block) and
``conplemenrary_mask`` (sic, a training switch) are kept and have no effect at inference, as in the official model;
``attention_dropout`` applies only in training (the official model passes dropout 0 in eval), so it is kept unused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from spiffy.errors import ConfigError
from spiffy.models.layers import ForwardContext, check_rope_scaling
from spiffy.models.pretrained import SpiffyForwardMixin, init_weights
from spiffy.models.qwen_style import QwenStyleLMMixin, QwenStyleStackMixin
from spiffy.models.sdar import block_causal_mask

FAST_DLLM_V2_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
    "AutoModel": "modeling.Fast_dLLM_QwenModel",
    "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
}
#: the official forward's ``block_size`` default: its attention mask uses it unless the caller passes another
OFFICIAL_MASK_BLOCK = 32


class Fast_dLLM_QwenConfig(PretrainedConfig):
    """Qwen2-style Fast-dLLM v2 config; defaults are those of Fast_dLLM_v2_7B (Qwen2.5-7B: hidden 3584, 28 layers,
    28/4 heads, vocab 152064, rope_theta 1e6, RMSNorm eps 1e-6, q/k/v bias, untied head, training block 32).
    Official configs carry no mask id: the mask (``|<MASK>|``, 151665) comes from the tokenizer."""

    model_type = "Fast_dLLM_Qwen"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 3584,
        intermediate_size: int = 18944,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 28,
        num_key_value_heads: int | None = 4,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        rope_scaling: dict | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = None,
        max_window_layers: int = 28,
        layer_types: list[str] | None = None,
        attention_dropout: float = 0.0,
        bd_size: int = 32,
        bos_token_id: int | None = 151643,
        eos_token_id: int | None = 151645,
        pad_token_id: int | None = 151645,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if rope_scaling is not None:  # setting None triggers a transformers 5 deprecation warning
            self.rope_scaling = rope_scaling
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.attention_dropout = attention_dropout
        self.bd_size = bd_size
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def check_fast_dllm_v2_config(config: Fast_dLLM_QwenConfig) -> None:
    """Refuse (ConfigError) the config values spiffy does not implement exactly as the official model."""
    check_rope_scaling(config)
    if config.hidden_act != "silu":
        raise ConfigError(
            f"hidden_act={config.hidden_act!r} is not supported for Fast_dLLM_Qwen (SwiGLU with silu only); "
            "fix: use hidden_act='silu' as the published checkpoints"
        )
    if config.use_sliding_window:
        raise ConfigError(
            "use_sliding_window=True is not supported for Fast_dLLM_Qwen (its block-causal attention has no window); "
            "fix: set use_sliding_window=false as the published checkpoints"
        )
    kinds = set(config.layer_types)
    if kinds - {"full_attention"} or len(config.layer_types) != config.num_hidden_layers:
        raise ConfigError(
            f"layer_types {sorted(kinds)} ({len(config.layer_types)} entries for {config.num_hidden_layers} layers) "
            "is not supported for Fast_dLLM_Qwen; fix: one 'full_attention' entry per layer"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ConfigError(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={config.num_attention_heads}"
        )


def _official_mask_layout(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A batch-broadcast bool mask ``[1, 1, L, S]`` as the official model hands it to SDPA (``[L, S]``); the CPU
    SDPA kernels round differently per layout in half precision. Other masks unchanged."""
    if mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1:
        return mask[0, 0]
    return mask


class Fast_dLLM_QwenPreTrainedModel(SpiffyForwardMixin, PreTrainedModel):
    config_class = Fast_dLLM_QwenConfig
    base_model_prefix = "model"
    _no_split_modules = ["QwenStyleDecoderLayer"]
    _supports_sdpa = True
    supports_gradient_checkpointing = False
    causal_default = False

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, float(getattr(self.config, "initializer_range", 0.02)))

    def _context(self, input_ids: torch.Tensor, **kw: Any) -> ForwardContext:
        block_size = kw.pop("block_size", None)
        block_size = OFFICIAL_MASK_BLOCK if block_size is None else int(block_size)
        if kw.get("attention_mask") is None and block_size > 0:  # block_size=0: no mask (the sub-block cache)
            # the official forward's own mask: block-causal over [cache ; new] in blocks of `block_size`
            cache = kw.get("past_key_values")
            start = int(cache.get_seq_length()) if cache is not None else 0
            kw["attention_mask"] = block_causal_mask(int(input_ids.shape[1]), block_size, start=start,
                                                     device=input_ids.device)
        ctx = super()._context(input_ids, **kw)  # type: ignore[misc]
        ctx.mask = _official_mask_layout(ctx.mask)
        return ctx


def _policy(kwargs: dict[str, Any], cache_policy: str | None) -> str | None:
    """The official ``update_past_key_values`` keyword as spiffy's cache policy."""
    update = kwargs.pop("update_past_key_values", None)
    if cache_policy is None and update is not None:
        return "append" if update else "read"
    return cache_policy


class Fast_dLLM_QwenModel(QwenStyleStackMixin, Fast_dLLM_QwenPreTrainedModel):
    """Fast-dLLM v2 backbone (``embed_tokens``, ``layers``, ``norm``): ``forward -> BaseModelOutputWithPast``."""

    def __init__(self, config: Fast_dLLM_QwenConfig) -> None:
        super().__init__(config)
        c = config
        check_fast_dllm_v2_config(c)
        self._build_stack(
            c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta, qkv_bias=True, qk_norm=False,
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        store_kv: bool | None = None,
        cache_policy: str | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        block_size: int | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Backbone forward with the contract of :meth:`Fast_dLLM_QwenForCausalLM.forward` (no logits)."""
        ctx = self._context(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            use_cache=use_cache, store_kv=store_kv, cache_policy=_policy(kwargs, cache_policy), block_size=block_size,
        )
        h, hiddens = self.run(input_ids, ctx, output_hidden_states)
        out = BaseModelOutputWithPast(last_hidden_state=h, past_key_values=ctx.cache_out, hidden_states=hiddens)
        return out if return_dict else out.to_tuple()


class Fast_dLLM_QwenForCausalLM(QwenStyleLMMixin, Fast_dLLM_QwenPreTrainedModel):
    """Fast-dLLM v2 block-diffusion LM (``model`` + ``lm_head``).

    ``forward(input_ids [B, L]) -> logits [B, L, V]`` raw (unshifted). ``attention_mask`` None: the official
    block-causal mask over ``[cache ; new]`` with ``block_size`` (default 32, as the official forward); else an
    explicit mask as :meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward` takes. ``update_past_key_values``
    (the official keyword) / ``store_kv`` / ``cache_policy`` say whether the new K/V are appended to
    ``past_key_values``.
    """

    def __init__(self, config: Fast_dLLM_QwenConfig) -> None:
        super().__init__(config)
        self.model = Fast_dLLM_QwenModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, *args: Any, cache_policy: str | None = None,
                block_size: int | None = None, **kwargs: Any) -> Any:
        """See the class docstring."""
        policy = _policy(kwargs, cache_policy)
        if kwargs.pop("use_block_cache", False):
            raise ConfigError("use_block_cache is the official generator's sub-block cache; fix: decode with "
                              "spiffy.generate(..., cache='dual') (spiffy.decoding.fast_dllm_v2)")
        self._block_size = block_size
        try:
            return super().forward(input_ids, *args, cache_policy=policy, **kwargs)
        finally:
            self._block_size = None

    def _context(self, input_ids: torch.Tensor, **kw: Any) -> ForwardContext:
        kw.setdefault("block_size", getattr(self, "_block_size", None))
        return super()._context(input_ids, **kw)


__all__ = [
    "FAST_DLLM_V2_AUTO_MAP",
    "OFFICIAL_MASK_BLOCK",
    "Fast_dLLM_QwenConfig",
    "Fast_dLLM_QwenForCausalLM",
    "Fast_dLLM_QwenModel",
    "check_fast_dllm_v2_config",
]
