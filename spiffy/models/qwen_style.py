"""The Qwen-layout decoder shared by Dream (Qwen2 layout with q/k/v bias) and SDAR (Qwen3 layout with q_norm/k_norm),
and the causal-LM plumbing on top of it (:class:`QwenStyleLMMixin`)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from spiffy.errors import ConfigError
from spiffy.models.layers import ForwardContext, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary, attend
from spiffy.models.placement import tied_linear
from spiffy.models.pretrained import SpiffyForwardMixin


class QwenStyleAttention(nn.Module):
    """Self-attention with parameter names ``{q,k,v,o}_proj`` (+ ``{q,k}_norm`` when ``qk_norm``).

    ``forward(x [B, L, H], cos, sin, layer ctx) -> [B, L, H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        qkv_bias: bool,
        o_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        # Qwen convention (official Dream and SDAR code): tables in the model dtype, rotation in the model dtype
        q = apply_rotary(q.transpose(1, 2), cos, sin, full_precision=False)
        k = apply_rotary(k.transpose(1, 2), cos, sin, full_precision=False)
        v = v.transpose(1, 2)
        out = attend(q, k, v, self.layer_idx, ctx, scale=self.head_dim**-0.5)
        return self.o_proj(out)


class QwenStyleDecoderLayer(nn.Module):
    """Pre-norm block: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``.

    ``mlp`` (default: a :class:`~spiffy.models.layers.SwiGLUMLP` of ``intermediate_size``) is any module mapping
    ``[B, L, H] -> [B, L, H]`` (an MoE block for SDAR-MoE); ``o_bias`` gives ``o_proj`` a bias (Qwen3 layout with
    ``attention_bias``).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        eps: float,
        qkv_bias: bool,
        qk_norm: bool,
        o_bias: bool = False,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = QwenStyleAttention(
            hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, qkv_bias=qkv_bias, o_bias=o_bias,
            qk_norm=qk_norm, eps=eps,
        )
        self.mlp = mlp if mlp is not None else SwiGLUMLP(hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenStyleStackMixin:
    """``run`` over the ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb`` built by :meth:`_build_stack`."""

    def _build_stack(
        self,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        rope_theta: float,
        qkv_bias: bool,
        qk_norm: bool,
        o_bias: bool = False,
        mlp_for: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """Create ``embed_tokens``, ``layers.{i}`` (:class:`QwenStyleDecoderLayer`), ``norm`` and ``rotary_emb``.

        ``qkv_bias`` (Dream, Qwen2 layout) and ``qk_norm`` (SDAR, Qwen3 layout) select the attention variant;
        ``o_bias`` adds the ``o_proj`` bias; ``mlp_for(i)`` builds layer ``i``'s feed-forward (``None`` or absent:
        the dense SwiGLU MLP of ``intermediate_size``).
        """
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            QwenStyleDecoderLayer(
                hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, i, eps, qkv_bias, qk_norm,
                o_bias=o_bias, mlp=mlp_for(i) if mlp_for is not None else None,
            )
            for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, eps)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_theta)

    def run(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """``input_ids [B, L]`` -> ``(final normed hidden [B, L, H], hidden states or None)``."""
        return run_decoder_stack(
            self.embed_tokens, self.layers, self.norm, self.rotary_emb, input_ids, ctx, output_hidden_states
        )


class QwenStyleBackbone(QwenStyleStackMixin, nn.Module):
    """``embed_tokens``, ``layers.{i}``, ``norm``: ``run(input_ids [B, L], ctx) -> (h [B, L, H], hiddens)``.

    Constructor arguments: those of :meth:`QwenStyleStackMixin._build_stack`. ``hiddens`` (when requested)
    follows transformers' convention: the embeddings, each layer's output, and the final normed state in place
    of the last layer's raw output (``N + 1`` tensors).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._build_stack(*args, **kwargs)


def run_decoder_stack(
    embed: nn.Module,
    layers: nn.ModuleList,
    norm: nn.Module,
    rotary: RotaryEmbedding,
    input_ids: torch.Tensor,
    ctx: ForwardContext,
    output_hidden_states: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Embed ``input_ids [B, L]``, run the layers and the final norm: ``(h [B, L, H], hiddens or None)``."""
    h = embed(input_ids)
    cos, sin = rotary(ctx.position_ids, h.dtype)
    hiddens: list[torch.Tensor] = []
    for layer in layers:
        if output_hidden_states:
            hiddens.append(h)
        h = layer(h, cos, sin, ctx)
    h = norm(h)
    if output_hidden_states:
        hiddens.append(h)
    return h, (tuple(hiddens) if output_hidden_states else None)


class QwenStyleLMMixin(SpiffyForwardMixin):
    """Embedding accessors and LM head of a ``model`` (with ``embed_tokens`` and ``run``) + ``lm_head`` wrapper;
    the head is ``model.embed_tokens`` when ``config.tie_word_embeddings`` (then ``lm_head`` is absent)."""

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens  # type: ignore[attr-defined]

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value  # type: ignore[attr-defined]

    def get_output_embeddings(self) -> nn.Module | None:
        return getattr(self, "lm_head", None)

    def _logits(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        h, hiddens = self.model.run(input_ids, ctx, output_hidden_states)  # type: ignore[attr-defined]
        if self.config.tie_word_embeddings:  # type: ignore[attr-defined]
            logits = tied_linear(h, self.model.embed_tokens)  # type: ignore[attr-defined]
        else:
            logits = self.lm_head(h)  # type: ignore[attr-defined]
        return logits, hiddens
