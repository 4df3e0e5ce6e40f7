"""LLaDA2.0 (inclusionAI ``LLaDA2.0-mini`` 16B / ``LLaDA2.0-flash`` 100B-A6B, ``model_type="llada2_moe"``):
block diffusion with a Ling-2.0 (BailingMoeV2) mixture-of-experts decoder.

Own implementation keeping the official config keys and parameter names of ``modeling_llada2_moe.py``
(``model.word_embeddings``, ``model.layers.{i}.attention.{query_key_value,dense}``,
``model.layers.{i}.attention.{query_layernorm,key_layernorm}``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm}``, dense layers ``model.layers.{i}.mlp.{gate,up,down}_proj``, MoE layers
``model.layers.{i}.mlp.gate.{weight,expert_bias}``, ``...mlp.experts.{j}.{gate,up,down}_proj``,
``...mlp.shared_experts.{gate,up,down}_proj``, ``model.norm``, ``lm_head``), so strict key matching loads real
checkpoints unchanged.

What the official code computes, and this module reproduces:

* attention: one fused ``query_key_value`` projection split into ``num_attention_heads`` query and
  ``num_key_value_heads`` key/value heads; per-head RMSNorm (``use_qk_norm``) before a *partial* rotate-half RoPE
  on the first ``head_dim * partial_rotary_factor`` dims (tables and rotation in the model dtype); ``dense`` output.
  The caller passes the block-causal mask (:func:`spiffy.models.sdar.block_causal_mask`); without one every key
  is visible (the official model's no-mask path is bidirectional).
* MoE routing per token (so each batch row is routed on its own; no capacity, no batch-level balancing): float32
  router logits ``linear(h.float(), W.float())``, **sigmoid** scores, ``+ expert_bias`` (a buffer in the model
  dtype) for the choice only, group-limited top-k (``n_group`` groups scored by their top-2 sum, ``topk_group``
  kept, then ``num_experts_per_tok`` experts), weights = the chosen *unbiased* scores normalised to sum 1 (when
  more than one expert is chosen, ``+ 1e-20``) times ``routed_scaling_factor``; expert outputs weighted and summed
  in float32, cast back, plus the ``shared_experts`` MLP (``moe_intermediate_size * num_shared_experts`` wide).
  Layers below ``first_k_dense_replace`` are dense MLPs.
* logits are returned in float32 (the official ``logits.float()``; float64 models stay float64).

Config fields the official code does not read are honoured by refusing values it would mis-run
(:func:`check_llada2_config`): ``score_function`` other than sigmoid, ``router_dtype`` other than fp32,
``norm_topk_prob`` false, ``moe_router_enable_expert_bias`` false with a non-zero bias, a ``rotary_dim`` or
``moe_shared_expert_intermediate_size`` that contradicts what the official code derives, ``norm_head``,
multi-token-prediction layers, sliding windows and RoPE scaling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN

from spiffy.errors import ConfigError
from spiffy.models.layers import ForwardContext, RMSNorm, RotaryEmbedding, apply_rotary, attend, check_rope_scaling
from spiffy.models.moe_dispatch import run_experts
from spiffy.models.pretrained import SpiffyForwardMixin, init_weights

LLADA2_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
    "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
    "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
}


class LLaDA2MoeConfig(PretrainedConfig):
    """The official ``LLaDA2MoeConfig`` keys and defaults (the official class's defaults, not a real size: real
    checkpoints spell every field). Extra keys of the published config.json (``score_function``, ``router_dtype``,
    ``norm_topk_prob``, ``rotary_dim``, ...) are kept as attributes and checked by :func:`check_llada2_config`."""

    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 30592,
        hidden_size: int = 1024,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 0,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        use_bias: bool = True,
        rms_norm_eps: float = 1e-05,
        norm_head: bool = False,
        tie_word_embeddings: bool = False,
        embedding_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        output_dropout: float = 0.1,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 16384,
        rope_theta: float = 10000.0,
        use_cache: bool = True,
        use_sliding_window: bool = False,
        sliding_window: int = 4096,
        max_window_layers: int = 28,
        rope_scaling: dict | None = None,
        pad_token_id: int = 126081,
        num_experts: int | None = 16,
        num_shared_experts: int | None = 0,
        num_experts_per_tok: int = 2,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        moe_intermediate_size: int | None = None,
        first_k_dense_replace: int = 0,
        head_dim: int | None = None,
        output_router_logits: bool = False,
        partial_rotary_factor: float = 0.5,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_qk_norm = use_qk_norm
        self.use_bias = use_bias
        self.rms_norm_eps = rms_norm_eps
        self.norm_head = norm_head
        self.embedding_dropout = embedding_dropout
        self.attention_dropout = attention_dropout
        self.output_dropout = output_dropout
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.use_cache = use_cache
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.head_dim = head_dim or hidden_size // num_attention_heads
        if rope_scaling is not None:  # setting None triggers a transformers 5 deprecation warning
            self.rope_scaling = rope_scaling
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.output_router_logits = output_router_logits
        self.routed_scaling_factor = routed_scaling_factor
        self.partial_rotary_factor = partial_rotary_factor
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)


def _refuse(field: str, value: Any, why: str, fix: str) -> None:
    raise ConfigError(f"LLaDA2 config {field}={value!r}: {why}; fix: {fix}")


def rotary_dim_of(config: Any) -> int:
    """The rotated dims per head: ``int(head_dim * partial_rotary_factor)`` (what the official RoPE init derives)."""
    factor = getattr(config, "partial_rotary_factor", None)
    return int(int(config.head_dim) * (1.0 if factor is None else float(factor)))


def check_llada2_config(config: Any) -> None:
    """Raise :class:`~spiffy.errors.ConfigError` for a config value the official computation does not follow.

    The official ``modeling_llada2_moe.py`` always scores experts with a sigmoid in float32, always normalises the
    chosen weights (``top_k > 1``), always adds ``expert_bias``, derives the rotary width from
    ``partial_rotary_factor`` and the shared-expert width from ``moe_intermediate_size * num_shared_experts``, and
    has no output-head norm, MTP layers, sliding window or RoPE scaling. A config saying otherwise describes a model
    the official code (and so this module) would compute differently: refused rather than silently mis-run.
    """
    c = config
    check_rope_scaling(c)
    score = getattr(c, "score_function", "sigmoid")
    if score not in (None, "sigmoid"):
        _refuse("score_function", score, "the official router always scores with a sigmoid", "use 'sigmoid'")
    dtype = getattr(c, "router_dtype", "fp32")
    if dtype not in (None, "fp32", "float32"):
        _refuse("router_dtype", dtype, "the official router always runs in float32", "use 'fp32'")
    if getattr(c, "norm_topk_prob", True) is False and int(c.num_experts_per_tok) > 1:
        _refuse("norm_topk_prob", False, "the official router always normalises the chosen weights", "set it true")
    if getattr(c, "moe_router_enable_expert_bias", True) is False:
        _refuse(
            "moe_router_enable_expert_bias", False, "the official router always adds its expert_bias buffer",
            "set it true (a checkpoint without a bias stores zeros)",
        )
    rd = getattr(c, "rotary_dim", None)
    if rd is not None and int(rd) != rotary_dim_of(c):
        _refuse("rotary_dim", rd, f"the official RoPE rotates head_dim * partial_rotary_factor = {rotary_dim_of(c)}",
                "make partial_rotary_factor and rotary_dim agree")
    shared = getattr(c, "moe_shared_expert_intermediate_size", None)
    if shared is not None and c.num_shared_experts is not None and c.moe_intermediate_size is not None:
        expected = int(c.moe_intermediate_size) * int(c.num_shared_experts)
        if int(shared) != expected:
            _refuse("moe_shared_expert_intermediate_size", shared,
                    f"the official shared experts are moe_intermediate_size * num_shared_experts = {expected} wide",
                    "make the widths agree")
    if getattr(c, "norm_head", False):
        _refuse("norm_head", True, "the official LLaDA2 head has no norm", "set norm_head false")
    if int(getattr(c, "num_nextn_predict_layers", 0) or 0) > 0:
        _refuse("num_nextn_predict_layers", c.num_nextn_predict_layers, "LLaDA2 has no multi-token-prediction layers",
                "set it to 0")
    if getattr(c, "use_sliding_window", False):
        _refuse("use_sliding_window", True, "the official LLaDA2 attention has no window", "set it false")
    if c.num_experts is not None:
        n, g, kg, k = int(c.num_experts), int(c.n_group), int(c.topk_group), int(c.num_experts_per_tok)
        if g < 1 or n % g or not 1 <= kg <= g or n // g < 2 or not 1 <= k <= kg * (n // g):
            _refuse("n_group/topk_group/num_experts_per_tok", (g, kg, k),
                    f"group-limited top-k needs n_group | num_experts ({n}), >= 2 experts per group, "
                    "1 <= topk_group <= n_group and num_experts_per_tok <= the experts of the kept groups",
                    "use the published values")
    if int(c.num_attention_heads) % max(int(c.num_key_value_heads), 1) or int(c.num_key_value_heads) < 1:
        _refuse("num_key_value_heads", c.num_key_value_heads, "it must divide num_attention_heads", "fix the config")


class LLaDA2MoeMLP(nn.Module):
    """Gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))``: ``[..., H] -> [..., H]``."""

    def __init__(self, config: LLaDA2MoeConfig, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2MoeGate(nn.Module):
    """The router: ``weight [E, H]`` and the ``expert_bias [E]`` buffer (a checkpoint tensor, in the model dtype).

    ``forward(h [T, H]) -> (topk_idx [T, k] long, topk_weight [T, k] float32)``; each token is routed on its own.
    """

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.num_experts = int(config.num_experts)  # type: ignore[arg-type]
        self.n_group = int(config.n_group)
        self.topk_group = int(config.topk_group)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rdt = torch.float64 if h.dtype == torch.float64 else torch.float32  # the official float32 router
        logits = F.linear(h.to(rdt), self.weight.to(rdt))
        scores = torch.sigmoid(logits)
        choice = scores + self.expert_bias  # the bias steers the choice only, never the weights
        t = choice.shape[0]
        # group-limited top-k: groups ranked by the sum of their two best experts, topk_group of them kept
        group_scores = choice.view(t, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, self.n_group, self.num_experts // self.n_group).reshape(t, -1)
        topk_idx = torch.topk(choice.masked_fill(~keep.bool(), float("-inf")), k=self.top_k, dim=-1)[1]
        chosen = torch.gather(scores, 1, topk_idx)
        weight = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if self.top_k > 1 else chosen
        return topk_idx, weight * self.routed_scaling_factor


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """Routed experts plus shared experts: ``[B, L, H] -> [B, L, H]``."""

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__()
        width = int(config.moe_intermediate_size)  # type: ignore[arg-type]
        self.experts = nn.ModuleList(LLaDA2MoeMLP(config, width) for _ in range(int(config.num_experts)))  # type: ignore[arg-type]
        self.gate = LLaDA2MoeGate(config)
        self.shared_experts: LLaDA2MoeMLP | None = None
        if config.num_shared_experts is not None:
            self.shared_experts = LLaDA2MoeMLP(config, width * int(config.num_shared_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        topk_idx, topk_weight = self.gate(flat)
        # each expert runs once on the (token, slot) pairs routed to it, in the flat token * k + slot order the
        # official moe_infer groups them in (per expert, or grouped on the static path: the same bits)
        act = self.experts[0].act_fn
        out = run_experts(flat, topk_idx, self.experts, act, pair_order="token")  # [N, k, H]
        # weighted sum over the k slots in the router's dtype (float32), then back to the model dtype
        y = out.to(topk_weight.dtype).mul_(topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        y = y.view(b, length, hidden)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class LLaDA2MoeAttention(nn.Module):
    """Fused-QKV attention with per-head q/k RMSNorm and partial RoPE: ``[B, L, H] -> [B, L, H]``."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.rope_dim = rotary_dim_of(config)
        self.query_key_value = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.use_qkv_bias
        )
        self.use_qk_norm = bool(config.use_qk_norm)
        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rope_dim`` dims of ``x [B, heads, L, D]`` (model-dtype tables), pass the rest."""
        r = self.rope_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin, full_precision=False), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, length, _ = x.shape
        qkv = self.query_key_value(x).view(b, length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.use_qk_norm:
            q = self.query_layernorm(q)
            k = self.key_layernorm(k)
        q = self._rotate(q, cos, sin)
        k = self._rotate(k, cos, sin)
        out = attend(q, k, v, self.layer_idx, ctx, scale=self.head_dim**-0.5)
        return self.dense(out)


class LLaDA2MoeDecoderLayer(nn.Module):
    """Pre-norm block: ``input_layernorm``, ``attention``, ``post_attention_layernorm``, ``mlp`` (dense or MoE)."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        moe = config.num_experts is not None and layer_idx >= int(config.first_k_dense_replace)
        self.mlp: nn.Module = (
            LLaDA2MoeSparseMoeBlock(config) if moe else LLaDA2MoeMLP(config, int(config.intermediate_size))  # type: ignore[arg-type]
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDA2MoePreTrainedModel(SpiffyForwardMixin, PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # spiffy.models.flex (our own attention, not transformers')
    supports_gradient_checkpointing = False
    causal_default = False  # without a mask every key is visible, as the official no-mask path

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, float(getattr(self.config, "initializer_range", 0.02)))
        if isinstance(module, LLaDA2MoeGate):
            nn.init.normal_(module.weight, mean=0.0, std=float(getattr(self.config, "initializer_range", 0.02)))
            module.expert_bias.zero_()


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The backbone (``word_embeddings``, ``layers``, ``norm``): ``forward -> BaseModelOutputWithPast``."""

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__(config)
        check_llada2_config(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rotary_dim_of(config), float(config.rope_theta))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.word_embeddings = value

    def run(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """``input_ids [B, L]`` -> ``(final normed hidden [B, L, H], hidden states or None)``."""
        h = self.word_embeddings(input_ids)
        cos, sin = self.rotary_emb(ctx.position_ids, h.dtype)  # model-dtype tables, as the official RoPE
        hiddens: list[torch.Tensor] = []
        for layer in self.layers:
            if output_hidden_states:
                hiddens.append(h)
            h = layer(h, cos, sin, ctx)
        h = self.norm(h)
        if output_hidden_states:
            hiddens.append(h)
        return h, (tuple(hiddens) if output_hidden_states else None)

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
    ) -> Any:
        """Backbone forward with the contract of :meth:`LLaDA2MoeModelLM.forward` (no logits)."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        ctx = self._context(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            use_cache=use_cache, store_kv=store_kv, cache_policy=cache_policy,
        )
        h, hiddens = self.run(input_ids, ctx, output_hidden_states)
        out = BaseModelOutputWithPast(last_hidden_state=h, past_key_values=ctx.cache_out, hidden_states=hiddens)
        return out if return_dict else out.to_tuple()


class LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel):
    """LLaDA2.0 block-diffusion LM (``model`` + ``lm_head``).

    ``forward`` (:meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward`): ``input_ids [B, L]`` ->
    ``logits [B, L, V]`` float32 (position ``i`` predicts token ``i``). ``attention_mask``: the caller's
    block-causal mask ``[B|1, 1, L, C+L]`` (bool, or additive as the official generator's ``0 / -inf``), a 2-D
    key-padding mask, or None = every key visible. ``store_kv`` / ``cache_policy`` as for SDAR.
    """

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def _logits(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        h, hiddens = self.model.run(input_ids, ctx, output_hidden_states)
        logits = self.lm_head(h)
        # the official head returns logits.float(): half-precision models hand float32 logits to the sampler
        return (logits if logits.dtype == torch.float64 else logits.float()), hiddens


__all__ = [
    "LLADA2_AUTO_MAP",
    "LLaDA2MoeConfig",
    "LLaDA2MoeModel",
    "LLaDA2MoeModelLM",
    "check_llada2_config",
    "rotary_dim_of",
]
