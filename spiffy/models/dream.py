"""Dream (HKUNLP/Dream, ``model_type="Dream"``): a bidirectional masked-diffusion LM in the Qwen2 layout.

Own implementation keeping the official config keys and parameter names: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}``, ``model.layers.{i}.self_attn.o_proj.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when tied).

Logits are returned raw: Dream is trained *shifted* (token ``i`` is read from logits ``i-1``); applying that
shift is the decoder's business. Position ids are honoured (``cumsum(attention_mask) - 1`` under left padding
is the caller's choice, as in Dream's own generate).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from spiffy.errors import ConfigError
from spiffy.models.layers import check_rope_scaling
from spiffy.models.pretrained import init_weights
from spiffy.models.qwen_style import QwenStyleBackbone, QwenStyleLMMixin

DREAM_AUTO_MAP: dict[str, str] = {
    "AutoConfig": "configuration_dream.DreamConfig",
    "AutoModel": "modeling_dream.DreamModel",
}


class DreamConfig(PretrainedConfig):
    """Qwen2-style Dream config; defaults are those of Dream-v0-7B (hidden 3584, 28 layers, 28/4 heads, vocab
    152064, rope_theta 1e6, RMSNorm eps 1e-6, q/k/v bias, untied head, mask 151666)."""

    model_type = "Dream"
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
        max_position_embeddings: int = 131072,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        rope_scaling: dict | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = None,
        max_window_layers: int = 28,
        attention_dropout: float = 0.0,
        mask_token_id: int | None = 151666,
        pad_token_id: int | None = 151643,
        bos_token_id: int | None = 151643,
        eos_token_id: int | None = 151643,
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
        self.attention_dropout = attention_dropout
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
        return self.hidden_size // self.num_attention_heads


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["QwenStyleDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True  # spiffy.models.flex (our own attention, not transformers')
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, float(getattr(self.config, "initializer_range", 0.02)))


class DreamModel(QwenStyleLMMixin, DreamPreTrainedModel):
    """Dream masked-diffusion LM (``model`` backbone + ``lm_head``).

    ``forward`` (:meth:`spiffy.models.pretrained.SpiffyForwardMixin.forward`) is bidirectional: ``input_ids [B, L]``
    -> ``logits [B, L, V]`` raw and **unshifted**; cache / policy / mask / position semantics as in
    :meth:`spiffy.models.llada.LLaDAModelLM.forward`.
    """

    causal_default = False

    def __init__(self, config: DreamConfig) -> None:
        super().__init__(config)
        c = config
        check_rope_scaling(c)
        if getattr(c, "use_sliding_window", False):
            # Dream's own code applies the window only in its flash-attention path (its SDPA path attends to every
            # position): which one a checkpoint was meant for is unknowable, and spiffy implements no window
            raise ConfigError("Dream config has use_sliding_window=true, which spiffy does not implement (the official "
                              "SDPA attention ignores it, its flash-attention path applies it); fix: set "
                              "use_sliding_window to false in config.json (Dream, Dream-Coder and DiffuCoder ship false)")
        self.model = QwenStyleBackbone(
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.hidden_size // c.num_attention_heads,
            c.rms_norm_eps,
            c.rope_theta,
            qkv_bias=True,
            qk_norm=False,
        )
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.post_init()
