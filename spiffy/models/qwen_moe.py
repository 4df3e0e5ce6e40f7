"""The Qwen3-MoE-style sparse feed-forward block of SDAR-MoE (SDAR-30B-A3B-Chat / -Sci), with the official
parameter names: ``gate.weight [E, H]`` (the router, no bias) and ``experts.{e}.{gate,up,down}_proj.weight`` (each
expert a SwiGLU MLP of ``moe_intermediate_size``).

Routing restates the official ``SDARMoeSparseMoeBlock.forward`` (``modeling_sdar_moe.py`` of the SDAR-30B-A3B
checkpoints, itself transformers 4.52's Qwen3-MoE block), because in half precision *where* each step rounds decides
the tokens:

* router logits ``gate(h)`` in the model dtype over every token ``[N, H] -> [N, E]``;
* ``softmax`` in **float32** (whatever the model dtype, float64 included), ``topk(num_experts_per_tok)`` on those
  probabilities (ties: ``torch.topk``'s order), divided by their sum when ``norm_topk_prob``, then cast to the model
  dtype;
* the output starts as zeros in the model dtype and each chosen expert adds ``expert(h) * weight`` (the official
  ``index_add_``), experts in increasing index order (so every token sums its experts in the same order); the experts
  run per expert or grouped (:mod:`spiffy.models.moe_dispatch`), the same bits either way.

Each token is routed on its own: no capacity limit, no batch-level balancing, nothing read across tokens, so a row
of a batch (a Spiffy candidate state) gets the routing it would get alone. The auxiliary load-balancing loss
(``router_aux_loss_coef``, ``output_router_logits``) is a training term that changes no logits; it is not computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spiffy.errors import ConfigError
from spiffy.models.layers import SwiGLUMLP
from spiffy.models.moe_dispatch import run_experts, sum_by_expert


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts: ``forward(x [B, L, H]) -> [B, L, H]``.

    Args:
        hidden_size: ``H``.
        moe_intermediate_size: each expert's inner size.
        num_experts: ``E`` (>= 1).
        top_k: experts per token (``num_experts_per_tok``, ``1 <= top_k <= E``).
        norm_topk_prob: renormalise the chosen experts' probabilities to sum to 1.
    """

    def __init__(
        self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool
    ) -> None:
        super().__init__()
        if not 1 <= int(top_k) <= int(num_experts):
            raise ConfigError(
                f"num_experts_per_tok ({top_k}) must lie in 1..num_experts ({num_experts}); fix the model config"
            )
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.gate = nn.Linear(hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, moe_intermediate_size) for _ in range(self.num_experts))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [N, H]`` -> ``(weights [N, k] in h's dtype, experts [N, k] int64)``, each token on its own."""
        probs = F.softmax(self.gate(h), dim=1, dtype=torch.float32)  # the router reads float32, as official
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, hidden = x.shape
        h = x.reshape(-1, hidden)
        weights, chosen = self.route(h)
        # each expert over its (slot, token) rows in the official one-hot order (per expert, or grouped when static)
        pairs = run_experts(h, chosen, self.experts, F.silu, pair_order="slot")  # [N, k, H]
        return sum_by_expert(pairs * weights.unsqueeze(-1), chosen).view(b, length, hidden)
