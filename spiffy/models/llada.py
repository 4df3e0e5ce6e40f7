"""LLaDA (ML-GSAI/LLaDA, ``model_type="llada"``): a bidirectional masked-diffusion transformer, OLMo-style.

Own implementation (the official remote code breaks under transformers 5.x) that keeps the official config keys
and checkpoint parameter names, so real ``GSAI-ML/LLaDA-8B-*`` weights load unchanged:

``model.transformer.wte.weight``, ``model.transformer.blocks.{i}.{attn_norm,ff_norm}.weight``,
``model.transformer.blocks.{i}.{q_proj,k_proj,v_proj,attn_out,ff_proj,up_proj,ff_out}.weight``,
``model.transformer.ln_f.weight``, ``model.transformer.ff_out.weight`` (absent when ``weight_tying``).

Block: ``x + attn_out(attn(attn_norm(x)))`` then ``x + ff_out(silu(ff_proj(h)) * up_proj(h))`` with
``h = ff_norm(x)``. RoPE rotate-half over ``rope_theta``: float32 tables (float64 models: float64); with
``rope_full_precision`` (the official default) queries/keys rotate in float32, else in the model dtype.
Logits: position ``i`` predicts token ``i`` (no shift); width = ``embedding_size`` (defaults to ``vocab_size``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from spiffy.errors import ConfigError
from spiffy.models.layers import ForwardContext, RMSNorm, RotaryEmbedding, apply_rotary, attend, compute_dtype
from spiffy.models.placement import tied_linear
from spiffy.models.pretrained import SpiffyForwardMixin, init_weights

LLADA_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration_llada.LLaDAConfig",
    "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    "AutoModel": "modeling_llada.LLaDAModelLM",
}


class LLaDAConfig(PretrainedConfig):
    """OLMo-style LLaDA config. Defaults are those of LLaDA-8B (d_model 4096, 32 layers/heads, mlp 12288,
    vocab/embedding 126464, rope_theta 5e5, RMSNorm eps 1e-5, untied head, no biases, mask 126336)."""

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "num_key_value_heads": "n_kv_heads",
        "max_position_embeddings": "max_sequence_length",
    }

    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: int | None = 32,
        n_layers: int = 32,
        mlp_ratio: int = 4,
        mlp_hidden_size: int | None = 12288,
        activation_type: str = "silu",
        block_type: str = "llama",
        block_group_size: int = 1,
        alibi: bool = False,
        alibi_bias_max: float = 8.0,
        rope: bool = True,
        rope_full_precision: bool = True,
        rope_theta: float = 500000.0,
        flash_attention: bool = False,
        attention_dropout: float = 0.0,
        multi_query_attention: bool | None = None,
        attention_layer_norm: bool = False,
        attention_layer_norm_with_affine: bool = True,
        residual_dropout: float = 0.0,
        embedding_dropout: float = 0.0,
        input_emb_norm: bool = False,
        layer_norm_type: str = "rms",
        layer_norm_with_affine: bool = True,
        rms_norm_eps: float = 1e-5,
        bias_for_layer_norm: bool = False,
        max_sequence_length: int = 4096,
        include_bias: bool = False,
        include_qkv_bias: bool = False,
        scale_logits: bool = False,
        vocab_size: int = 126464,
        embedding_size: int | None = 126464,
        weight_tying: bool = False,
        eos_token_id: int | None = 126081,
        pad_token_id: int | None = 126081,
        mask_token_id: int | None = 126336,
        init_device: str | None = "meta",
        init_fn: str = "mitchell",
        init_std: float = 0.02,
        init_cutoff_factor: float | None = None,
        precision: str | None = "amp_bf16",
        use_cache: bool = False,
        **kwargs: Any,
    ) -> None:
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size
        self.activation_type = activation_type
        self.block_type = block_type
        self.block_group_size = block_group_size
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.rope = rope
        self.rope_full_precision = rope_full_precision
        self.rope_theta = rope_theta
        self.flash_attention = flash_attention
        self.attention_dropout = attention_dropout
        self.multi_query_attention = multi_query_attention
        self.attention_layer_norm = attention_layer_norm
        self.attention_layer_norm_with_affine = attention_layer_norm_with_affine
        self.residual_dropout = residual_dropout
        self.embedding_dropout = embedding_dropout
        self.input_emb_norm = input_emb_norm
        self.layer_norm_type = layer_norm_type
        self.layer_norm_with_affine = layer_norm_with_affine
        self.rms_norm_eps = rms_norm_eps
        self.bias_for_layer_norm = bias_for_layer_norm
        self.max_sequence_length = max_sequence_length
        self.include_bias = include_bias
        self.include_qkv_bias = include_qkv_bias
        self.scale_logits = scale_logits
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.weight_tying = weight_tying
        self.mask_token_id = mask_token_id
        self.init_device = init_device
        self.init_fn = init_fn
        self.init_std = init_std
        self.init_cutoff_factor = init_cutoff_factor
        self.precision = precision
        self.use_cache = use_cache
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, tie_word_embeddings=weight_tying, **kwargs
        )

    @property
    def effective_n_kv_heads(self) -> int:
        if self.multi_query_attention:
            return 1
        return int(self.n_kv_heads if self.n_kv_heads is not None else self.n_heads)

    @property
    def effective_mlp_hidden_size(self) -> int:
        return int(self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model)

    @property
    def effective_embedding_size(self) -> int:
        return int(self.embedding_size if self.embedding_size is not None else self.vocab_size)


def _check_supported(config: LLaDAConfig) -> None:
    problems = []
    if config.block_type != "llama":
        problems.append(f"block_type={config.block_type!r} (only 'llama')")
    if config.block_group_size != 1:
        problems.append(f"block_group_size={config.block_group_size} (only 1)")
    if config.alibi:
        problems.append("alibi=True")
    if not config.rope:
        problems.append("rope=False")
    if config.activation_type not in ("silu", "swiglu"):
        problems.append(f"activation_type={config.activation_type!r} (only 'silu')")
    if config.layer_norm_type not in ("rms", "gemma_rms") and config.layer_norm_type is not None:
        problems.append(f"layer_norm_type={config.layer_norm_type!r} (only 'rms')")
    if config.attention_layer_norm:
        problems.append("attention_layer_norm=True")
    if config.d_model % config.n_heads:
        problems.append(f"d_model {config.d_model} not divisible by n_heads {config.n_heads}")
    if problems:
        raise ConfigError(
            "LLaDA config uses options spiffy does not implement: " + ", ".join(problems)
            + "; fix: use a LLaDA-8B style config (llama blocks, RoPE, RMSNorm, SiLU-gated MLP)"
        )


class LLaDABlock(nn.Module):
    """One LLaDA transformer block (official parameter names)."""

    def __init__(self, config: LLaDAConfig, layer_idx: int) -> None:
        super().__init__()
        d = config.d_model
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads = config.effective_n_kv_heads
        self.head_dim = d // config.n_heads
        self.rope_full_precision = bool(config.rope_full_precision)
        qkv_bias = bool(config.include_bias or config.include_qkv_bias)
        bias = bool(config.include_bias)
        hidden = config.effective_mlp_hidden_size
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=bias)
        self.ff_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.ff_out = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [B, L, d_model] -> [B, L, d_model]``."""
        b, length, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin, self.rope_full_precision)
        k = apply_rotary(k, cos, sin, self.rope_full_precision)
        x = x + self.attn_out(attend(q, k, v, self.layer_idx, ctx, scale=self.head_dim**-0.5))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    """Holds ``transformer`` = ModuleDict(wte, blocks, ln_f[, ff_out]) as in the official checkpoint."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        modules: dict[str, nn.Module] = {
            "wte": nn.Embedding(config.effective_embedding_size, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config, i) for i in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.effective_embedding_size, bias=bool(config.include_bias))
        self.transformer = nn.ModuleDict(modules)
        self.rotary_emb = RotaryEmbedding(config.d_model // config.n_heads, config.rope_theta)

    def run(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Return ``(logits [B, L, V], hidden states or None)``."""
        t = self.transformer
        x = t["wte"](input_ids)
        # the official model keeps its RoPE tables in float32 (rounding them to bf16 shifts logits by ulps)
        cos, sin = self.rotary_emb(ctx.position_ids, compute_dtype(x.dtype))
        hiddens: list[torch.Tensor] = []
        for block in t["blocks"]:
            if output_hidden_states:
                hiddens.append(x)
            x = block(x, cos, sin, ctx)
        x = t["ln_f"](x)
        if output_hidden_states:
            hiddens.append(x)
        if self.config.weight_tying:
            logits = tied_linear(x, t["wte"])  # the embedding may sit elsewhere (device_map)
        else:
            logits = t["ff_out"](x)
        if self.config.scale_logits:
            logits = logits * (1.0 / self.config.d_model**0.5)
        return logits, (tuple(hiddens) if output_hidden_states else None)


class LLaDAPreTrainedModel(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]
    _supports_sdpa = True
    _supports_flex_attn = True  # spiffy.models.flex (our own attention, not transformers')
    _supports_attention_backend = False
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, float(getattr(self.config, "init_std", 0.02)))


class LLaDAModelLM(SpiffyForwardMixin, LLaDAPreTrainedModel):
    """LLaDA masked-diffusion LM.

    ``forward`` (:meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward`, the uniform spiffy forward contract) is
    bidirectional: ``input_ids [B, L]`` -> ``logits [B, L, V]`` (raw, unshifted). ``past_key_values`` (spiffy
    KVCache or transformers DynamicCache; batch 1 broadcasts to B): the queries see ``[cached ; new]`` keys;
    ``cache_policy`` ``"append"`` stores the new K/V, ``"read"`` only reads (``store_kv`` True/False is an alias;
    otherwise ``use_cache`` decides). ``position_ids`` default to ``cache_len + arange(L)``. ``attention_mask``:
    None (all visible), 2-D key padding, 4-D bool / additive.
    """

    causal_default = False

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.transformer["wte"]

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.transformer["wte"] = value

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.config.weight_tying else self.model.transformer["ff_out"]

    def _num_layers(self) -> int:
        return int(self.config.n_layers)

    def _logits(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        return self.model.run(input_ids, ctx, output_hidden_states)
