"""PreTrainedModel plumbing shared by spiffy's LLaDA, Dream and SDAR models: weight initialisation and the uniform
forward contract (:class:`SpiffyForwardMixin`; see :mod:`spiffy.models` for the contract)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from spiffy.models.cache import hf_cache
from spiffy.models.layers import ForwardContext, RMSNorm, prepare_forward


def init_weights(module: nn.Module, std: float) -> None:
    """The families' ``_init_weights``: Linear/Embedding weights ~ N(0, std), biases 0, RMSNorm scales 1."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


class SpiffyForwardMixin:
    """The uniform spiffy forward contract of a ``PreTrainedModel`` (mix in before the PreTrainedModel base).

    Subclasses set :attr:`causal_default` (attention when ``attention_mask`` is None: bidirectional for
    LLaDA/Dream, causal over ``[cache ; new]`` for SDAR), may override :meth:`_num_layers`, and implement
    :meth:`_logits`.
    """

    causal_default: bool = False

    def _num_layers(self) -> int:
        return int(self.config.num_hidden_layers)  # type: ignore[attr-defined]

    def _context(self, input_ids: torch.Tensor, mask_all_visible: bool | None = None, **kw: Any) -> ForwardContext:
        """:func:`prepare_forward` for this model (layers, embedding dtype, mask default, attention backend).
        ``mask_all_visible``: the caller's host-side knowledge of whether its mask hides nothing (a family whose
        attention depends on that reads it instead of the mask's values: no host synchronisation)."""
        return prepare_forward(
            input_ids,
            self._num_layers(),
            self.get_input_embeddings().weight.dtype,  # type: ignore[attr-defined]
            causal_default=self.causal_default,
            attn_implementation=getattr(self.config, "_attn_implementation", None) or "sdpa",  # type: ignore[attr-defined]
            **kw,
        )

    def _logits(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """``input_ids [B, L]`` -> ``(logits [B, L, V], hidden states or None)``."""
        raise NotImplementedError

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
        mask_all_visible: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """``input_ids [B, L]`` -> ``logits [B, L, V]`` (raw; whether logits are shifted is the family's business).

        ``past_key_values`` (spiffy KVCache or transformers DynamicCache; batch 1 broadcasts to B): the queries see
        ``[cached ; new]`` keys; ``cache_policy`` ``"append"`` stores the new K/V, ``"read"`` only reads
        (``store_kv`` True/False is an alias; otherwise ``use_cache`` decides). ``position_ids`` default to
        ``cache_len + arange(L)``. ``attention_mask``: None (all visible, or causal for SDAR), 2-D key padding,
        3-D/4-D bool, 0/1 float (SDAR's reference block-causal mask ``[B|1, 1, L, C+L]``) or additive float.
        ``mask_all_visible``: whether ``attention_mask`` hides no key, when the caller knows it on the host (``None``:
        a family that needs the fact reads it from the mask, a host synchronisation).
        """
        ctx = self._context(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            store_kv=store_kv,
            cache_policy=cache_policy,
            mask_all_visible=mask_all_visible,
        )
        logits, hiddens = self._logits(input_ids, ctx, output_hidden_states)
        out = CausalLMOutputWithPast(logits=logits, hidden_states=hiddens, **hf_cache(ctx.cache_out))
        return out if return_dict else out.to_tuple()
