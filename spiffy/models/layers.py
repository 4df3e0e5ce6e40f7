"""Building blocks shared by spiffy's LLaDA, Dream and SDAR implementations.

* :class:`RMSNorm` - root-mean-square norm, computed in at least float32 (float64 stays float64).
* :class:`RotaryEmbedding` / :func:`apply_rotary` - rotate-half RoPE, angles computed in at least float32.
* :func:`attend` - attention of new queries over ``[cached keys ; new keys]`` with an optional mask, through
  torch SDPA (default), a plain eager path, flex_attention, or flash-attn for mask-free calls only; grouped-query
  attention supported.
* :class:`ForwardContext` / :func:`prepare_forward` - the uniform forward contract of the three families: cache
  policy resolution (``cache_policy`` / SDAR's ``store_kv`` / ``use_cache``), default position ids, attention-mask
  normalisation (2-D key padding, 3-D/4-D bool, 0/1 or additive float).

Tensor layout conventions: hidden states ``[B, L, H]``; per-head tensors ``[B, heads, L, D]``; masks
``[B|1, 1, L, C+L]`` where ``C`` is the number of cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spiffy.errors import ConfigError
from spiffy.models.cache import CACHE_POLICIES, KVCache, as_kv_cache, between
from spiffy.models.flash import FLASH, flash_applicable, flash_attend
from spiffy.models.flex import flex_attend

ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flex_attention", FLASH)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype numerically sensitive pieces run in: float64 stays float64, anything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMS norm with a learned scale (``weight [dim]``), no bias. ``x [..., dim] -> [..., dim]``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        h = x.to(compute_dtype(in_dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary position embedding.

    ``forward(position_ids [B, L], dtype) -> (cos, sin)`` each ``[B, L, head_dim]`` in ``dtype``; angles are
    computed in float32 (float64 when ``dtype`` is float64) whatever the model dtype. LLaDA asks for float32
    tables (its official model keeps them in float32), Dream and SDAR for model-dtype tables (theirs round them).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ConfigError(f"rotary embedding needs an even head_dim, got {head_dim}; fix the model config")
        self.head_dim = int(head_dim)
        self.theta = float(theta)

    def inv_freq(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(dtype) / self.head_dim
        return 1.0 / (self.theta**exponent)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cdt = compute_dtype(dtype)
        inv = self.inv_freq(cdt, position_ids.device)
        freqs = position_ids.to(cdt)[..., None] * inv  # [B, L, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def check_rope_scaling(config: Any) -> None:
    """Raise ConfigError when a config asks for RoPE scaling (spiffy implements plain RoPE only)."""
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(
                f"rope_scaling {scaling!r} is not supported (plain RoPE only); fix: remove rope_scaling from config.json"
            )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., D] -> [..., D]``: ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
    """Rotate ``x [B, heads, L, D]`` by ``cos/sin [B, L, D]`` (broadcast over heads); returns ``x``'s dtype.

    ``full_precision=True`` (LLaDA's ``rope_full_precision``): ``x`` and the tables are converted to float32
    (float64 stays float64) and rotated there; pass tables built in that dtype, as LLaDA keeps them, or half
    precision logits drift from the official model's by a few ulps. ``False`` (Dream, SDAR, the transformers
    Qwen convention): the tables are cast to ``x``'s dtype and each product and the sum round in that dtype.
    """
    if full_precision:
        cdt = compute_dtype(x.dtype)
        xf = x.to(cdt)
        return (xf * cos.to(cdt).unsqueeze(1) + rotate_half(xf) * sin.to(cdt).unsqueeze(1)).to(x.dtype)
    c = cos.to(x.dtype).unsqueeze(1)
    s = sin.to(x.dtype).unsqueeze(1)
    return x * c + rotate_half(x) * s


class SwiGLUMLP(nn.Module):
    """Qwen-style gated MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``[B, L, H] -> [B, L, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------------------------
# forward contract: cache policy, positions, masks
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ForwardContext:
    """Everything the layers of one forward need besides the hidden states.

    Attributes:
        cache: the cache wrapped for ``layer/append`` (``None`` = no cache).
        cache_out: the object returned as ``past_key_values`` (the caller's cache, or a new :class:`KVCache`).
        policy: ``"append"`` (store the new K/V after attending) or ``"read"`` (only read).
        cache_len: ``C``, the number of cached positions before this forward.
        position_ids: ``[B|1, L]`` long.
        mask: ``None`` (everything visible), a bool ``[B|1, 1, L, C+L]`` (True = visible) or an additive float
            mask of that shape; fully hidden query rows have already been made finite.
        attn_implementation: ``"sdpa"``, ``"eager"``, ``"flex_attention"`` or ``"flash_attention_2"`` (mask-free
            calls only, :mod:`spiffy.models.flash`; masked ones use SDPA).
        plain_causal: ``mask`` is the family's default causal mask (no mask was passed): flash-attn can run it.
    """

    cache: Any
    cache_out: Any
    policy: str
    cache_len: int
    position_ids: torch.Tensor
    mask: torch.Tensor | None
    attn_implementation: str = "sdpa"
    plain_causal: bool = False


def resolve_cache_policy(
    past_key_values: Any, use_cache: bool | None, store_kv: bool | None, cache_policy: str | None, num_layers: int
) -> tuple[Any, Any, str]:
    """Return ``(cache_view, cache_out, policy)`` following the forward contract.

    Priority: explicit ``cache_policy``; else SDAR's ``store_kv`` (True -> append, False -> read); else with a
    cache passed ``use_cache=True`` -> append, otherwise read. With no cache passed, ``use_cache=True`` (or an
    explicit append policy) creates a fresh :class:`KVCache` that is appended to and returned.
    """
    if cache_policy is not None:
        if cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"cache_policy must be one of {CACHE_POLICIES}, got {cache_policy!r}")
        policy: str | None = cache_policy
    elif store_kv is not None:
        policy = "append" if store_kv else "read"
    else:
        policy = None
    if past_key_values is None:
        if use_cache or policy == "append":
            cache = KVCache(num_layers)
            return cache, cache, "append"
        return None, None, policy or "read"
    if policy is None:
        policy = "append" if use_cache else "read"
    return as_kv_cache(past_key_values), past_key_values, policy


def _float_mask_is_binary(mask: torch.Tensor) -> bool:
    """A float mask holding only 0/1 and at least one 1 is a 0/1 visibility mask (SDAR's reference passes one)."""
    ones = mask == 1
    return bool(ones.any()) and bool((ones | (mask == 0)).all())


def normalize_attention_mask(
    attention_mask: torch.Tensor | None,
    batch: int,
    length: int,
    cache_len: int,
    dtype: torch.dtype,
    device: torch.device,
    causal_default: bool = False,
) -> torch.Tensor | None:
    """Turn any accepted mask form into ``None``, a bool ``[B|1, 1, L, C+L]`` or an additive float mask.

    Accepted forms: ``None`` (all visible, or causal over ``[cache ; new]`` when ``causal_default``); 2-D 0/1
    key-padding ``[B, C+L]`` or ``[B, L]`` (then cached keys are visible), combined with the causal default when
    set; 3-D ``[B, L, C+L]``; 4-D ``[B|1, 1, L, C+L]`` as bool/integer (nonzero = visible), 0/1 float (as SDAR's
    reference generate passes it) or additive float (0 visible, very negative hidden). A query row that sees no
    key is made finite (bool: the row is opened; additive: clamped to the dtype minimum), never NaN.
    """
    total = cache_len + length
    if attention_mask is None:
        if not causal_default:
            return None
        q = torch.arange(length, device=device)[:, None] + cache_len
        k = torch.arange(total, device=device)[None, :]
        return (k <= q)[None, None]
    m = attention_mask.to(device)
    if m.dim() == 2:
        if m.shape[-1] == length and cache_len > 0:
            m = torch.cat([torch.ones(m.shape[0], cache_len, dtype=m.dtype, device=device), m], dim=-1)
        if m.shape[-1] != total or m.shape[0] not in (1, batch):
            raise ConfigError(
                f"2-D attention_mask has shape {tuple(attention_mask.shape)}, expected [{batch}, {total}] "
                f"(cache {cache_len} + new {length}) or [{batch}, {length}]; fix the mask shape"
            )
        visible = (m != 0)[:, None, None, :]
        if causal_default:
            causal = normalize_attention_mask(None, batch, length, cache_len, dtype, device, True)
            visible = visible & causal  # type: ignore[operator]
        return _open_hidden_rows(visible)
    if m.dim() == 3:
        m = m[:, None]
    if m.dim() != 4 or m.shape[-1] != total or m.shape[-2] != length or m.shape[0] not in (1, batch):
        raise ConfigError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B|1, 1, {length}, {total}] "
            f"(queries {length}, keys = cache {cache_len} + new {length}), [B, {total}] or [B, {length}]; "
            "fix the mask shape"
        )
    if m.dtype == torch.bool:
        return _open_hidden_rows(m)
    if not torch.is_floating_point(m):
        return _open_hidden_rows(m != 0)
    if _float_mask_is_binary(m):
        return _open_hidden_rows(m != 0)
    return m.to(dtype).clamp(min=torch.finfo(dtype).min)


def _open_hidden_rows(visible: torch.Tensor) -> torch.Tensor:
    """Make every query row of a bool mask see at least one key (a fully hidden row is opened entirely).
    Unconditional (or-ing an all-false ``dead`` changes nothing), so no host synchronisation: a captured forward
    runs it too."""
    dead = ~visible.any(dim=-1, keepdim=True)
    return visible | dead


def prepare_forward(
    input_ids: torch.Tensor,
    num_layers: int,
    dtype: torch.dtype,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = None,
    store_kv: bool | None = None,
    cache_policy: str | None = None,
    causal_default: bool = False,
    attn_implementation: str = "sdpa",
) -> ForwardContext:
    """Resolve cache, policy, positions and mask for a forward on ``input_ids [B, L]``.

    ``position_ids`` default to ``C + arange(L)`` (``C`` = cached positions); ``[L]`` and ``[1, L]`` broadcast.
    """
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    device = input_ids.device
    cache, cache_out, policy = resolve_cache_policy(past_key_values, use_cache, store_kv, cache_policy, num_layers)
    cache_len = cache.get_seq_length(0) if cache is not None else 0
    if position_ids is None:
        position_ids = (torch.arange(length, device=device) + cache_len)[None]
    else:
        position_ids = position_ids.to(device=device, dtype=torch.long)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.shape[-1] != length or position_ids.shape[0] not in (1, batch):
            raise ConfigError(
                f"position_ids has shape {tuple(position_ids.shape)}, expected [{batch}, {length}] or [{length}]"
            )
    mask = normalize_attention_mask(attention_mask, batch, length, cache_len, dtype, device, causal_default)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        attn_implementation = "sdpa"
    plain_causal = attention_mask is None and causal_default
    return ForwardContext(cache, cache_out, policy, cache_len, position_ids, mask, attn_implementation, plain_causal)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D]`` (each K/V head serves ``n_rep`` query heads)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    ctx: ForwardContext,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, H, L, D]`` over ``[cached ; new]`` keys, updating the cache per ``ctx.policy``.

    ``k``/``v`` are the new positions' rotated keys and values ``[B, H_kv, L, D]``. A cache of batch 1 is
    broadcast against ``B``; a cache with ``insert_at`` (read-only) gets the new keys between its cached
    positions ``[:insert_at]`` and ``[insert_at:]`` (the mask's key columns follow that order). Returns
    ``[B, L, H * D]``.
    """
    batch = q.shape[0]
    k_all, v_all = k, v
    record = getattr(ctx.cache, "record_new", None)
    if record is not None:  # a cache that keeps each layer's new K/V (Fast-dLLM v2's sub-block cache)
        record.append((k, v))
    if ctx.cache is not None:
        k_old, v_old = ctx.cache.layer(layer_idx)
        if k_old is not None:
            k_old = k_old.to(dtype=k.dtype)
            v_old = v_old.to(dtype=v.dtype)
            if k_old.shape[0] != batch:
                if k_old.shape[0] != 1:
                    raise ConfigError(
                        f"cache batch {k_old.shape[0]} does not match query batch {batch}; a cache must have batch "
                        "1 (broadcast) or the query batch"
                    )
                k_old = k_old.expand(batch, *k_old.shape[1:])
                v_old = v_old.expand(batch, *v_old.shape[1:])
            insert_at = getattr(ctx.cache, "insert_at", None)
            if insert_at is None:
                k_all = torch.cat([k_old, k], dim=-2)
                v_all = torch.cat([v_old, v], dim=-2)
            else:  # keys in sequence order: [cached before ; new ; cached after]
                if ctx.policy == "append":
                    raise ConfigError("a cache with insert_at is read-only; fix: use cache_policy='read'")
                k_all, v_all = between(k_old, k, insert_at), between(v_old, v, insert_at)
        if ctx.policy == "append":
            stored = ctx.cache.layer(layer_idx)[0]
            if stored is not None and stored.shape[0] != batch:
                raise ConfigError(
                    f"cannot append K/V of batch {batch} to a cache of batch {stored.shape[0]}; use "
                    "cache_policy='read' (store_kv=False) for several drafts sharing one prefix"
                )
            ctx.cache.append(layer_idx, k, v)
    if ctx.attn_implementation == FLASH and flash_applicable(q):
        in_order = getattr(ctx.cache, "insert_at", None) is None  # keys in sequence order: causal = bottom-right
        if ctx.mask is None or (ctx.plain_causal and in_order):
            return flash_attend(q, k_all, v_all, scale, causal=ctx.mask is not None)
    n_rep = q.shape[1] // k_all.shape[1]
    k_all = repeat_kv(k_all, n_rep)
    v_all = repeat_kv(v_all, n_rep)
    mask = ctx.mask
    if mask is not None and mask.device != q.device:  # layers placed on several devices (device_map)
        mask = mask.to(q.device)
    if mask is not None and torch.is_floating_point(mask):
        mask = mask.to(q.dtype)
    if ctx.attn_implementation == "eager":
        out = _eager_attention(q, k_all, v_all, mask, scale)
    elif ctx.attn_implementation == "flex_attention":
        out = flex_attend(q, k_all, v_all, mask, scale)
    else:
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
    b, h, length, d = out.shape
    return out.transpose(1, 2).reshape(b, length, h * d)


def _eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores.to(compute_dtype(q.dtype)), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
