"""SDAR (JetAstra/SDAR, ``model_type="sdar"``): block diffusion in the Qwen3 layout; and its MoE variant SDAR-MoE
(SDAR-30B-A3B-Chat / -Sci, ``model_type="sdar_moe"``: :class:`SDARMoeForCausalLM`, the same attention with Qwen3-MoE
feed-forward layers ``mlp.gate`` + ``mlp.experts.{e}.{gate,up,down}_proj``, see :mod:`spiffy.models.qwen_moe`).

Own implementation keeping the official config keys and parameter names (Qwen3 layout: ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.self_attn.{q_norm,k_norm}.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight``, ``model.norm.weight``, ``lm_head.weight``).

Attention is block-causal (bidirectional inside a block, causal across blocks). As in the reference
``generate.py`` the **caller passes the block-causal mask** (see :func:`block_causal_mask`); the reference
calling convention ``model(x, attention_mask=m, position_ids=p, past_key_values=DynamicCache, use_cache=True,
store_kv=True|False)`` is accepted: ``store_kv=True`` appends the new K/V to the cache, ``False`` only reads it.
The reference passes the mask as a float 0/1 tensor and reads it as boolean; spiffy does the same for a float
mask made of 0s and 1s (any other float mask is additive). **When ``attention_mask`` is None, plain causal
attention over ``[cache ; new]`` is used** (query at absolute position ``C + i`` sees keys ``0..C + i``).
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
from spiffy.models.qwen_moe import SparseMoeBlock
from spiffy.models.qwen_style import QwenStyleLMMixin, QwenStyleStackMixin

SDAR_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration_sdar.SDARConfig",
    "AutoModel": "modeling_sdar.SDARModel",
    "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
}


class SDARConfig(PretrainedConfig):
    """Qwen3-style SDAR config; defaults are those of SDAR-8B (Qwen3-8B: hidden 4096, 36 layers, 32/8 heads,
    head_dim 128, vocab 151936, rope_theta 1e6, RMSNorm eps 1e-6, untied head). Official SDAR configs carry no
    ``mask_token_id``: the mask id (``<|MASK|>``, 151669) comes from the tokenizer unless set here.
    ``fuse_cross_entropy`` (default True, as official configs) is kept for the official modeling code only."""

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 36,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = 8,
        head_dim: int | None = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        use_sliding_window: bool = False,
        sliding_window: int | None = None,
        max_window_layers: int = 36,
        attention_dropout: float = 0.0,
        bos_token_id: int | None = 151643,
        eos_token_id: int | None = 151643,
        pad_token_id: int | None = None,
        fuse_cross_entropy: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if rope_scaling is not None:  # setting None triggers a transformers 5 deprecation warning
            self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.attention_dropout = attention_dropout
        # a training switch spiffy never uses, but official SDARForCausalLM.forward reads it (AttributeError
        # without it) and official configs carry it, so configs written here keep it
        self.fuse_cross_entropy = fuse_cross_entropy
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


def block_causal_mask(
    length: int,
    block_length: int,
    start: int = 0,
    total: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor:
    """The SDAR block-causal visibility mask ``[1, 1, L, start + L]`` (``L = length``).

    Absolute position ``p`` lies in block ``p // block_length``; query ``start + i`` sees key ``j`` iff
    ``j // block_length <= (start + i) // block_length`` (bidirectional within a block, causal across blocks).
    ``start`` is the number of cached positions (keys ``0..start-1`` come from the cache). ``total`` (default
    ``start + length``) is the key count. ``dtype=torch.bool`` gives True = visible; a floating dtype gives an
    additive mask (0 visible, dtype min hidden).
    """
    if block_length <= 0:
        raise ConfigError(f"block_length must be > 0, got {block_length}")
    total = start + length if total is None else total
    q_block = (torch.arange(length, device=device) + start) // block_length
    k_block = torch.arange(total, device=device) // block_length
    visible = (k_block[None, :] <= q_block[:, None])[None, None]
    if dtype == torch.bool:
        return visible
    out = torch.zeros(visible.shape, dtype=dtype, device=device)
    return out.masked_fill(~visible, torch.finfo(dtype).min)


class SDARPreTrainedModel(SpiffyForwardMixin, PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    _no_split_modules = ["QwenStyleDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # spiffy.models.flex (our own attention, not transformers')
    supports_gradient_checkpointing = False
    causal_default = True

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, float(getattr(self.config, "initializer_range", 0.02)))

    def _context(self, input_ids: torch.Tensor, mask_all_visible: bool | None = None, **kw: Any) -> ForwardContext:
        ctx = super()._context(input_ids, **kw)  # type: ignore[misc]
        ctx.mask = official_mask_layout(ctx.mask, mask_all_visible)
        return ctx


def official_mask_layout(mask: torch.Tensor | None, all_visible: bool | None = None) -> torch.Tensor | None:
    """The visibility mask in the layout the official SDAR model hands to attention.

    Official SDAR attends with no mask when every key is visible (its decoding branch) and otherwise passes
    SDPA the ``[1, L, S]`` mask its ``generate`` builds. The CPU SDPA kernels it selects depend on that (none vs
    4-D mask vs 3-D mask), and they round differently in half precision, so spiffy keeps the same layout: an
    all-visible bool mask becomes ``None`` and a batch-broadcast bool ``[1, 1, L, S]`` becomes ``[1, L, S]``
    (SDPA and the eager path broadcast it the same way). Other masks are returned unchanged. ``all_visible``: whether
    the mask hides nothing, when the caller knows it (``None``: read from the mask, a host synchronisation).
    """
    if mask is None or mask.dtype != torch.bool:
        return mask
    if bool(mask.all()) if all_visible is None else all_visible:
        return None
    if mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1:
        return mask[0]
    return mask


class SDARModel(QwenStyleStackMixin, SDARPreTrainedModel):
    """SDAR backbone (``embed_tokens``, ``layers``, ``norm``): ``forward -> BaseModelOutputWithPast``."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__(config)
        c = config
        check_rope_scaling(c)
        if c.hidden_act != "silu":  # the official MLPs read ACT2FN[hidden_act]; every SDAR checkpoint has silu
            raise ConfigError(f"hidden_act {c.hidden_act!r} is not supported (SwiGLU with silu only); fix config.json")
        self._build_stack(
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
            c.rope_theta,
            qkv_bias=bool(c.attention_bias),
            qk_norm=True,
            o_bias=bool(c.attention_bias),  # the official o_proj has bias=attention_bias as q/k/v do
            mlp_for=self._mlp_for,
        )
        self.post_init()

    def _mlp_for(self, layer_idx: int) -> nn.Module | None:
        """Layer ``layer_idx``'s feed-forward: ``None`` = the dense SwiGLU MLP (every layer of dense SDAR)."""
        return None

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
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Backbone forward with the same contract as :meth:`SDARForCausalLM.forward` (no logits)."""
        ctx = self._context(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            store_kv=store_kv,
            cache_policy=cache_policy,
        )
        h, hiddens = self.run(input_ids, ctx, output_hidden_states)
        out = BaseModelOutputWithPast(last_hidden_state=h, past_key_values=ctx.cache_out, hidden_states=hiddens)
        return out if return_dict else out.to_tuple()


class SDARForCausalLM(QwenStyleLMMixin, SDARPreTrainedModel):
    """SDAR block-diffusion LM (``model`` + ``lm_head``).

    ``forward`` (:meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward`) is block-causal: ``input_ids [B, L]`` ->
    ``logits [B, L, V]`` (position i predicts token i). ``attention_mask``: the caller's block-causal mask
    ``[B|1, 1, L, C+L]`` (bool, float 0/1 as in the reference, or additive), a 2-D key-padding mask (combined with
    causal), or None = plain causal over ``[cache ; new]``. ``store_kv=True`` appends the new K/V to
    ``past_key_values`` (KVCache or DynamicCache), ``False`` reads only; ``cache_policy`` is the spiffy spelling of
    the same.
    """

    backbone_class: type = SDARModel

    def __init__(self, config: SDARConfig) -> None:
        super().__init__(config)
        self.model = self.backbone_class(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


# --------------------------------------------------------------------------------------------------------------
# SDAR-MoE (SDAR-30B-A3B-Chat / -Sci, ``model_type="sdar_moe"``): SDAR with Qwen3-MoE feed-forward layers
# --------------------------------------------------------------------------------------------------------------

SDAR_MOE_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
    "AutoModel": "modeling_sdar_moe.SDARMoeModel",
    "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
}


class SDARMoeConfig(SDARConfig):
    """SDAR-MoE config; defaults are those of SDAR-30B-A3B-Chat (Qwen3-30B-A3B shape: hidden 2048, 48 layers, 32/4
    heads of 128, 128 experts of 768 with 8 per token, ``norm_topk_prob``, vocab 151936, untied head).

    The MoE fields, as the official ``modeling_sdar_moe.py`` reads them: layer ``i`` is sparse when ``num_experts
    > 0``, ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, else a dense SwiGLU MLP of
    ``intermediate_size``; ``num_experts_per_tok``, ``moe_intermediate_size`` and ``norm_topk_prob`` shape the
    routing (:class:`~spiffy.models.qwen_moe.SparseMoeBlock`). ``output_router_logits`` and
    ``router_aux_loss_coef`` feed only the training loss (no effect on logits); they are kept so configs round-trip.
    """

    model_type = "sdar_moe"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 2048,
        intermediate_size: int = 6144,
        num_hidden_layers: int = 48,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = 4,
        head_dim: int | None = 128,
        max_window_layers: int = 48,
        decoder_sparse_step: int = 1,
        moe_intermediate_size: int = 768,
        num_experts_per_tok: int = 8,
        num_experts: int = 128,
        norm_topk_prob: bool = True,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
        mlp_only_layers: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.decoder_sparse_step = decoder_sparse_step
        self.moe_intermediate_size = moe_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.mlp_only_layers = [] if mlp_only_layers is None else list(mlp_only_layers)
        super().__init__(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            max_window_layers=max_window_layers,
            **kwargs,
        )


def is_sparse_layer(config: SDARMoeConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of an SDAR-MoE config is an MoE layer (the official rule; see
    :class:`SDARMoeConfig`). ConfigError when ``decoder_sparse_step < 1`` with experts (the official code divides
    by it)."""
    if int(config.num_experts) <= 0 or layer_idx in config.mlp_only_layers:
        return False
    step = int(config.decoder_sparse_step)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1 when num_experts > 0, got {step}; fix config.json")
    return (layer_idx + 1) % step == 0


class SDARMoeModel(SDARModel):
    """SDAR-MoE backbone: :class:`SDARModel` whose sparse layers' ``mlp`` is a
    :class:`~spiffy.models.qwen_moe.SparseMoeBlock` (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``)."""

    config_class = SDARMoeConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]

    def _mlp_for(self, layer_idx: int) -> nn.Module | None:
        c = self.config
        if not is_sparse_layer(c, layer_idx):
            return None
        return SparseMoeBlock(
            c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, bool(c.norm_topk_prob)
        )


class SDARMoeForCausalLM(SDARForCausalLM):
    """SDAR-MoE block-diffusion LM (``model`` + ``lm_head``), the same forward contract as :class:`SDARForCausalLM`."""

    config_class = SDARMoeConfig
    backbone_class = SDARMoeModel
