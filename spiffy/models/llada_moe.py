"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-*, config ``model_type="llada"``, class ``LLaDAMoEModelLM``): LLaDA's
masked-diffusion objective on an OLMoE-style decoder with full bidirectional attention and MoE feed-forward layers.

Own implementation with the official checkpoint's parameter names (strict keys), so real weights load unchanged:

``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
``model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj}.weight`` (``.bias`` with ``attention_bias``),
``model.layers.{i}.self_attn.{q_norm,k_norm}.weight`` (``qk_layernorm``),
``model.layers.{i}.post_attention_layernorm.weight``, MoE layers: ``model.layers.{i}.mlp.gate.weight``,
``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``,
``model.layers.{i}.mlp.expert_bias`` (``moe_router_enable_expert_bias``), ``model.layers.{i}.shared_expert.*``
(``shared_expert_intermediate_size`` not null); dense layers (``moe_layer_freq[i] == 0``):
``model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight``; ``model.norm.weight``, ``lm_head.weight``.

What the official ``modeling_lladamoe.py`` computes, and so what this module computes (each in the model dtype
unless said): RMSNorm in float32 (``weight * normed.to(dtype)``); q/k RMSNorm per head over ``head_dim`` before
RoPE; ``clip_qkv`` clamps q, k, v; RoPE rotate-half over the first ``head_dim * partial_rotary_factor`` channels
with float32 angles whose cos/sin tables are rounded to the model dtype; attention over all positions (no causal
mask). The MoE router: ``gate`` logits in the model dtype, softmax in float32, ``+ expert_bias`` (the bias enters
the weights, not only the choice), ``torch.topk(num_experts_per_tok)``, no renormalisation (the official block
hard-codes ``norm_topk_prob = False`` whatever the config says), the weights rounded to the model dtype; every
expert runs on the tokens routed to it and adds ``expert(x) * weight`` into a zero tensor in expert order
(``index_add_``); the shared expert's output is added after the routed sum. Routing reads one token's hidden state
only (no capacity limit, no batch-level balancing), so every batch row is routed on its own.
Logits: position ``i`` predicts token ``i`` (no shift).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from spiffy.errors import ConfigError
from spiffy.models.layers import (
    ForwardContext,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    attend,
    check_rope_scaling,
)
from spiffy.models.moe_dispatch import run_experts, sum_by_expert
from spiffy.models.placement import tied_linear
from spiffy.models.pretrained import SpiffyForwardMixin, init_weights


class LLaDAMoEConfig(PretrainedConfig):
    """The official LLaDA-MoE config keys (``configuration_lladamoe.LLaDAConfig``). Defaults are
    LLaDA-MoE-7B-A1B's: hidden 2048, 16 layers of 16 heads (head_dim 128), 64 experts of width 1024 with 8 routed
    per token, no shared expert, q/k RMSNorm, vocabulary 157184, untied head.

    Fields the official model reads and how spiffy treats them: every architecture field is honoured;
    ``norm_topk_prob`` is accepted and, as in the official MoE block, not applied; ``moe_router_score_function``
    (only ``"softmax"``, what the official block always computes), ``routed_scaling_factor`` (only 1) and
    ``router_num_group``/``router_topk_group`` (no group-limited routing) are never read by the official model, so a
    value that asks for something else is refused (:class:`~spiffy.errors.ConfigError`) rather than silently
    ignored; ``output_router_logits``, ``router_aux_loss_coef`` and ``attention_dropout`` are training-only.
    """

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        dense_intermediate_size: int = 8192,
        expert_intermediate_size: int = 1024,
        shared_expert_intermediate_size: int | None = None,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = False,
        pad_token_id: int | None = 156892,
        bos_token_id: int | None = None,
        eos_token_id: int | None = 156892,
        tie_word_embeddings: bool = False,
        rope_theta: float = 50000.0,
        partial_rotary_factor: float = 1.0,
        rope_scaling: dict[str, Any] | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        clip_qkv: float | None = None,
        num_experts_per_tok: int = 8,
        num_experts: int = 64,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.01,
        norm_topk_prob: bool | None = None,
        qk_layernorm: bool = True,
        moe_layer_freq: list[int] | None = None,
        moe_router_enable_expert_bias: bool | None = False,
        moe_router_score_function: str | None = "softmax",
        routed_scaling_factor: float | None = 1,
        router_num_group: int | None = None,
        router_topk_group: int | None = None,
        mask_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dense_intermediate_size = dense_intermediate_size
        self.expert_intermediate_size = expert_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        if rope_scaling is not None:  # setting None triggers a transformers 5 deprecation warning
            self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.clip_qkv = clip_qkv
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.norm_topk_prob = norm_topk_prob
        self.qk_layernorm = qk_layernorm
        self.moe_layer_freq = [1] * int(num_hidden_layers) if moe_layer_freq is None else moe_layer_freq
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.moe_router_score_function = moe_router_score_function
        self.routed_scaling_factor = routed_scaling_factor
        self.router_num_group = router_num_group
        self.router_topk_group = router_topk_group
        # the released config.json has no mask id (the official generate() takes mask_id=156895); spiffy's tiny
        # checkpoints write it, real ones read it from the tokenizer's mask token
        self.mask_token_id = mask_token_id
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self) -> int:
        return int(self.hidden_size) // int(self.num_attention_heads)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (transformers' default RoPE: ``int(head_dim * factor)``)."""
        return int(self.head_dim * float(self.partial_rotary_factor))


def _unused_routing_knob(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value not in neutral


def check_llada_moe_config(config: LLaDAMoEConfig) -> None:
    """ConfigError naming every field value spiffy (and the official model) cannot compute as asked."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (only 'silu')")
    if config.hidden_size % config.num_attention_heads:
        problems.append(f"hidden_size {config.hidden_size} not divisible by num_attention_heads "
                        f"{config.num_attention_heads}")
    elif config.num_attention_heads % config.num_key_value_heads:
        problems.append(f"num_attention_heads {config.num_attention_heads} not a multiple of num_key_value_heads "
                        f"{config.num_key_value_heads}")
    if not 0 < float(config.partial_rotary_factor) <= 1 or config.rotary_dim % 2:
        problems.append(f"partial_rotary_factor={config.partial_rotary_factor} (needs 0 < f <= 1 and an even "
                        "head_dim * f)")
    freq = config.moe_layer_freq
    if not isinstance(freq, (list, tuple)) or len(freq) != config.num_hidden_layers:
        problems.append(f"moe_layer_freq={freq!r} (the official model indexes it per layer: a list of "
                        f"{config.num_hidden_layers} 0/1 flags)")
    if any(bool(f) for f in (freq if isinstance(freq, (list, tuple)) else [])):
        if not 0 < int(config.num_experts_per_tok) <= int(config.num_experts):
            problems.append(f"num_experts_per_tok={config.num_experts_per_tok} with num_experts={config.num_experts}")
    if _unused_routing_knob(config.moe_router_score_function, ("softmax", None)):
        problems.append(f"moe_router_score_function={config.moe_router_score_function!r} (the official MoE block "
                        "always routes by softmax)")
    if _unused_routing_knob(config.routed_scaling_factor, (1, 1.0, None)):
        problems.append(f"routed_scaling_factor={config.routed_scaling_factor} (the official MoE block never scales)")
    if any(g is not None and int(g) > 1 for g in (config.router_num_group, config.router_topk_group)):
        problems.append("router_num_group/router_topk_group > 1 (the official MoE block has no group-limited routing)")
    if problems:
        raise ConfigError(
            "LLaDA-MoE config uses options spiffy does not implement: " + ", ".join(problems)
            + "; fix: use the released LLaDA-MoE-7B-A1B config values for these fields"
        )
    check_rope_scaling(config)


class LLaDAMoEAttention(nn.Module):
    """Bidirectional multi-head attention with optional q/k RMSNorm (official parameter names)."""

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int) -> None:
        super().__init__()
        d, bias = config.hidden_size, bool(config.attention_bias)
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.clip_qkv = None if config.clip_qkv is None else float(config.clip_qkv)
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=bias)
        if config.qk_layernorm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rotary_dim`` channels of ``x [B, H, L, D]`` (tables ``[B, L, rotary_dim]``)."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin, full_precision=False)
        rot = apply_rotary(x[..., : self.rotary_dim], cos, sin, full_precision=False)
        return torch.cat([rot, x[..., self.rotary_dim :]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [B, L, hidden] -> [B, L, hidden]``."""
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x)
        if hasattr(self, "q_norm"):  # per head, before RoPE (the official order)
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        q = self._rotate(q.transpose(1, 2), cos, sin)
        k = self._rotate(k.transpose(1, 2), cos, sin)
        v = v.view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(attend(q, k, v, self.layer_idx, ctx))


class LLaDAMoESparseMoeBlock(nn.Module):
    """Top-k softmax router over ``num_experts`` SwiGLU experts (official names ``gate``, ``experts.{e}``,
    optional ``expert_bias`` buffer). ``[B, L, hidden] -> [B, L, hidden]``; each token is routed on its own."""

    def __init__(self, config: LLaDAMoEConfig) -> None:
        super().__init__()
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLUMLP(config.hidden_size, config.expert_intermediate_size) for _ in range(self.num_experts)
        )
        self.expert_bias: torch.Tensor | None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        else:
            self.expert_bias = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [T, hidden]`` -> ``(weights [T, k] in h's dtype, experts [T, k] long)``."""
        weights = F.softmax(self.gate(h), dim=1, dtype=torch.float32)
        if self.expert_bias is not None:
            weights = weights + self.expert_bias
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        return weights.to(h.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        h = x.reshape(-1, d)
        weights, chosen = self.route(h)
        # each expert over its rows ordered by choice rank, then token, as the official mask (per expert or grouped);
        # experts then add into the running sum in index order, in the model dtype (the official summation order)
        pairs = run_experts(h, chosen, self.experts, F.silu, pair_order="slot")  # [N, k, d]
        return sum_by_expert(pairs * weights.unsqueeze(-1), chosen).view(b, length, d)


class LLaDAMoEDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x)) [+ shared_expert(norm(x))]``."""

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int) -> None:
        super().__init__()
        moe = bool(config.moe_layer_freq[layer_idx])
        self.self_attn = LLaDAMoEAttention(config, layer_idx)
        self.mlp: nn.Module = (
            LLaDAMoESparseMoeBlock(config) if moe else SwiGLUMLP(config.hidden_size, config.dense_intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if moe and config.shared_expert_intermediate_size is not None:
            self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [B, L, hidden] -> [B, L, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        out = self.mlp(h)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert(h)
        return x + out


class LLaDAMoEModel(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` (the official ``model.`` prefix)."""

    def __init__(self, config: LLaDAMoEConfig) -> None:
        super().__init__()
        check_llada_moe_config(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def run(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """``input_ids [B, L]`` -> ``(final hidden [B, L, hidden], per-layer inputs + final or None)``."""
        x = self.embed_tokens(input_ids)
        # float32 angles, tables rounded to the model dtype (the official rotary embedding returns x's dtype)
        cos, sin = self.rotary_emb(ctx.position_ids, x.dtype)
        hiddens: list[torch.Tensor] = []
        for layer in self.layers:
            if output_hidden_states:
                hiddens.append(x)
            x = layer(x, cos, sin, ctx)
        x = self.norm(x)
        if output_hidden_states:
            hiddens.append(x)
        return x, (tuple(hiddens) if output_hidden_states else None)


class LLaDAMoEPreTrainedModel(PreTrainedModel):
    config_class = LLaDAMoEConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # spiffy.models.flex (our own attention, not transformers')
    _supports_attention_backend = False
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        init_weights(module, std)
        if isinstance(module, LLaDAMoESparseMoeBlock) and module.expert_bias is not None:
            # random in tiny checkpoints (trained in real ones) so that the bias path is exercised
            nn.init.normal_(module.expert_bias, mean=0.0, std=std)


class LLaDAMoEModelLM(SpiffyForwardMixin, LLaDAMoEPreTrainedModel):
    """LLaDA-MoE masked-diffusion LM.

    ``forward`` (:meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward`, the uniform spiffy forward contract)
    is bidirectional: ``input_ids [B, L]`` -> ``logits [B, L, V]`` (raw, unshifted); ``past_key_values`` (spiffy
    KVCache or transformers DynamicCache, batch 1 broadcasts), ``cache_policy`` ``"append"``/``"read"``, explicit
    ``position_ids`` and 2-D/4-D masks as for LLaDA. The official model has no cache; spiffy's cache modes reuse
    the cached keys/values exactly as LLaDA's do.
    """

    causal_default = False

    def __init__(self, config: LLaDAMoEConfig) -> None:
        super().__init__(config)
        self.model = LLaDAMoEModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.config.tie_word_embeddings else self.lm_head

    def _logits(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        x, hiddens = self.model.run(input_ids, ctx, output_hidden_states)
        if self.config.tie_word_embeddings:
            return tied_linear(x, self.model.embed_tokens), hiddens  # the embedding may sit elsewhere (device_map)
        return self.lm_head(x), hiddens
