"""Test oracle: the official LLaDA and Dream forwards restated op by op, in the model's own dtype.

Written from the documented behaviour of the official modeling code (the LLaDA hub / Fast-dLLM ``modeling_llada``
and the Dream hub / Fast-dLLM ``modeling_dream``), not copied. What matters in half precision is *where* each
operation rounds, so that is restated exactly:

* RMSNorm: the input in float32, ``x * rsqrt(mean(x^2) + eps)``, back to the model dtype, then ``weight * x``;
* LLaDA RoPE: float32 tables (``positions x inv_freq``), queries and keys converted to float32, rotated there
  (``t * cos + rotate_half(t) * sin``) and converted back;
* Dream RoPE (transformers' Qwen convention): float32 tables cast to the model dtype, rotation in the model dtype;
* attention: ``F.scaled_dot_product_attention`` without a mask (no padding), K/V heads repeated for GQA;
* LLaDA MLP ``ff_out(silu(ff_proj(h)) * up_proj(h))``, Dream ``down_proj(silu(gate_proj(h)) * up_proj(h))``.

The wrappers read the weights of a loaded spiffy model and answer ``wrapper(ids).logits`` (``[B, L, V]``), so the
reference generators in ``reference_llada.py`` / ``test_decoding_dream.py`` can run on the official numerics.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _tables(length: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` ``[L, dim]`` of positions ``0..L-1``."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)


class OfficialLLaDA:
    """``OfficialLLaDA(spiffy_llada)(ids [B, L]).logits`` with the official LLaDA numerics (no padding)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: object) -> SimpleNamespace:
        assert attention_mask is None or bool((attention_mask != 0).all()), "the oracle restates the unpadded path"
        c = self.config
        t = self.model.model.transformer
        heads, kv = c.n_heads, c.effective_n_kv_heads
        d = c.d_model // heads
        b, length = ids.shape
        cos, sin = _tables(length, d, c.rope_theta)
        x = t["wte"](ids)
        for blk in t["blocks"]:
            h = _rms(x, blk.attn_norm.weight, c.rms_norm_eps)
            q = blk.q_proj(h).view(b, length, heads, d).transpose(1, 2)
            k = blk.k_proj(h).view(b, length, kv, d).transpose(1, 2)
            v = blk.v_proj(h).view(b, length, kv, d).transpose(1, 2)
            qf, kf = q.float(), k.float()
            q = (qf * cos + _rotate_half(qf) * sin).type_as(q)
            k = (kf * cos + _rotate_half(kf) * sin).type_as(k)
            att = _attention(q, k, v).transpose(1, 2).contiguous().view(b, length, c.d_model)
            x = x + blk.attn_out(att)
            h = _rms(x, blk.ff_norm.weight, c.rms_norm_eps)
            x = x + blk.ff_out(F.silu(blk.ff_proj(h)) * blk.up_proj(h))
        x = _rms(x, t["ln_f"].weight, c.rms_norm_eps)
        logits = F.linear(x, t["wte"].weight) if c.weight_tying else t["ff_out"](x)
        return SimpleNamespace(logits=logits)


class OfficialDream:
    """``OfficialDream(spiffy_dream)(ids [B, L]).logits`` with the official Dream numerics (no padding)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: object) -> SimpleNamespace:
        assert attention_mask is None, "the oracle restates the unpadded path"
        c = self.config
        m = self.model.model
        heads, kv = c.num_attention_heads, c.num_key_value_heads
        d = c.hidden_size // heads
        b, length = ids.shape
        x = m.embed_tokens(ids)
        cos, sin = (t.to(x.dtype) for t in _tables(length, d, c.rope_theta))
        for layer in m.layers:
            a = layer.self_attn
            h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q = a.q_proj(h).view(b, length, heads, d).transpose(1, 2)
            k = a.k_proj(h).view(b, length, kv, d).transpose(1, 2)
            v = a.v_proj(h).view(b, length, kv, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            att = _attention(q, k, v).transpose(1, 2).contiguous().view(b, length, heads * d)
            x = x + a.o_proj(att)
            h = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        x = _rms(x, m.norm.weight, c.rms_norm_eps)
        logits = F.linear(x, m.embed_tokens.weight) if c.tie_word_embeddings else self.model.lm_head(x)
        return SimpleNamespace(logits=logits)
