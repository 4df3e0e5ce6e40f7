"""Dream baseline decoding (HKUNLP/Dream ``diffusion_generate`` semantics, plus Fast-dLLM's blockwise variant).

Logits are shifted: the token at row ``i`` is read from the logits of row ``i - 1``.

Static schedule (per block; the original is one block covering the whole response): timesteps
``linspace(1, eps, steps_per_block + 1)``; step ``i`` unmasks ``int(n_masked * (1 - s / t))`` positions
(``t, s`` = timesteps ``i, i + 1``; all remaining ones at the last step), where ``n_masked`` is the
batch-averaged masked count of the block. Rules (``alg``):

* ``origin``: every masked position is revealed with probability ``1 - s / t`` (uniform draws), its token sampled.
* ``maskgit_plus`` / ``topk_margin`` / ``entropy``: confidence = probability of the proposed token / top-1 minus
  top-2 probability / negative entropy; the most confident positions are revealed (``alg_temp > 0``: positions
  drawn by ``multinomial(softmax(confidence / alg_temp))`` instead).

Proposals: logits / temperature, top-p, top-k, softmax; ``T = 0`` = argmax, else one categorical draw per row.
Threshold (Fast-dLLM ``confidence_threshold``). Without a cache (Fast-dLLM ``generation_utils``): each block
has a quota ``q = n_masked // steps_per_block`` per step; a step ranks the masked positions with ``torch.topk``
over ``q`` plus what earlier steps left over, always takes the first and every other one with confidence
``>= tau``, and carries the rest over; at or after the last scheduled step anything left over adds a step (quota
0) until the block has no mask. The carry is derived from the state (``cur = R - max(S - 1 - i, 0) * q`` for
``R`` masked rows at step ``i`` of ``S``), so the rule stays pure; it equals the official running count unless
the model proposes the mask token itself. With a cache (``generation_utils_block``): every masked in-block
position with confidence ``>= tau`` (and at least the most confident) per step, until the block has no mask.

Cache modes (Fast-dLLM ``generation_utils_block``): the block-start full forward decodes only the block's first row
(its correctly shifted logits are available only there); later steps run on the cached window, whose first row
takes its own logits (never used: that row is already decoded). Steps ``1 .. steps_per_block - 1`` then follow the
schedule above, stopping early when the block has no mask. Deviations from Fast-dLLM, documented: the configured
``alg`` is used (Fast-dLLM hard-codes ``entropy`` there) and with ``steps_per_block == 1`` the single step unmasks
the whole block (Fast-dLLM would leave it masked).

Seeds: every draw comes from the session's generator (the reference uses the global RNG; draw shapes and order
follow the reference, so the streams agree after ``torch.manual_seed(K)`` on CPU, but this is not promised).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spiffy.decoding.base import BidirectionalSession, mask_positions
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.sampling import dream_sample_tokens
from spiffy.decoding.schedules import (dream_num_transfer_host, dream_timesteps, masked_rows,
                                       threshold_transfer)
from spiffy.decoding.session import StepInfo


class DreamSession(BidirectionalSession):
    """One Dream generation (see the module docstring for the rule).

    Position ids follow Dream: under left padding ``cumsum(attention_mask) - 1`` (padding rows get 1), else
    ``arange``.
    """

    rule = "dream"
    shifted_logits = True

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig,
        *,
        mask_id: int,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(model, input_ids, config, mask_id=mask_id, attention_mask=attention_mask, generator=generator)
        self.alg = config.resolved_alg
        self.timesteps = dream_timesteps(self.steps_per_block, config.eps, device=self.x.device)
        self._host_timesteps: list[float] = self.timesteps.tolist()  # read once: each step's count is host arithmetic
        self.threshold_quota: list[int] | None = None  # [B] per-step quota of the no-cache threshold rule

    def on_block_start(self, block: int) -> None:
        if self.config.threshold is not None and self.cache_mode == "none":
            # the block's masked count per row, on the host (floor division of non-negative ints, as the tensor's)
            self.threshold_quota = [m // self.steps_per_block for m in self.masked_counts(block, self.x)[1]]

    def _positions(self, device: torch.device) -> torch.Tensor:
        if self.attention_mask is None:
            return torch.arange(self.x.shape[1], device=device)[None]
        return mask_positions(self.attention_mask)

    def full_position_ids(self) -> torch.Tensor | None:
        return None if self.attention_mask is None else self.position_ids

    # ------------------------------------------------------------------ schedule
    def _first_row_step(self, step: int) -> bool:
        """Fast-dLLM's block-start step under a cache: decode only the block's first row."""
        if self.cache_mode == "none" or step != 0:
            return False
        return self.config.threshold is not None or self.steps_per_block > 1

    def rule_signature(self) -> dict[str, Any]:
        sig = super().rule_signature()
        if "tokens_per_step" in sig and sig["tokens_per_step"] != "dynamic":
            # Dream's static schedule (int(n_masked * (1 - s/t)) per step) is not uniform: node sizes may vary by level
            sig["tokens_per_step"] = None
        return sig

    def block_end_by_rule(self, block: int, step: int) -> bool | None:
        if self.config.threshold is not None:
            return True if step >= self.max_dynamic_steps() else None
        if step >= self.steps_per_block:
            return True
        return None if self.cache_mode != "none" and step > 0 else False

    # ------------------------------------------------------------------ transition
    def _confidence_kind(self) -> dict[str, bool]:
        return {"margin_confidence": self.alg == "topk_margin", "neg_entropy": self.alg == "entropy"}

    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """One Dream step on ``x [B, T]`` from aligned window logits ``[B, W, V]``; returns the next state."""
        cfg = self.config
        b, t = x.shape
        w = logits.shape[1]
        ws = info.window_start
        gen = self.generator
        temp = float(cfg.temperature)
        out = x.clone()
        if self._first_row_step(info.step):
            row = info.block_start - ws
            _, x0 = dream_sample_tokens(logits[:, row], temp, cfg.top_p, cfg.top_k, gen)
            cur = x[:, info.block_start]
            out[:, info.block_start] = torch.where(cur == self.mask_id, x0, cur)
            return out
        lo, hi = self.frame(info, w)
        off = ws - lo
        mask_w = self.block_mask_in_window(x, info, w)  # [B, W]
        eligible = self.masked_counts(info.block, x)[0]  # [B] host ints: mask_w's row counts
        # the masked rows in row-major order (as logits[mask_w]) found with their count known on the host: no read
        flat = masked_rows(mask_w, sum(eligible))  # [n] indices into the [B * W] window rows
        mask_logits = logits[flat // w, flat % w]  # [n, V]
        if cfg.threshold is not None:
            conf, x0 = dream_sample_tokens(mask_logits, temp, cfg.top_p, cfg.top_k, gen, **self._confidence_kind())
            counts = eligible
            if self.cache_mode == "none":
                assert self.threshold_quota is not None, "begin_block was not called"
                spare = max(self.steps_per_block - 1 - info.step, 0)
                counts = [max(c - spare * q, 0) for c, q in zip(eligible, self.threshold_quota)]
            return self._apply(out, x, mask_w, conf, x0, lo, hi, off, w, flat, threshold=float(cfg.threshold),
                               counts=counts, logits=logits if temp == 0 else None)
        step, steps = info.step, self.steps_per_block
        if self.alg == "origin":
            t_ = self.timesteps[step]
            s_ = self.timesteps[step + 1]
            p_transfer = 1 - s_ / t_ if step < steps - 1 else 1
            n = int(mask_logits.shape[0])
            reveal = torch.rand((n,), generator=gen, device=x.device) < p_transfer
            if temp == 0:
                # greedy proposals draw nothing: propose for every masked row and keep the revealed ones (the same
                # tokens as proposing for the revealed rows only, without reading how many were revealed)
                _, greedy = dream_sample_tokens(mask_logits, temp, cfg.top_p, cfg.top_k, gen)
                x0 = torch.where(reveal, greedy, self.mask_id)
            else:
                # a sampled proposal draws one categorical per revealed row, in row order: the generator's stream
                # depends on which rows were revealed, so this read stays (the reference draws the same way)
                x0 = torch.full((n,), self.mask_id, dtype=torch.long, device=x.device)
                if bool(reveal.any()):
                    _, x0[reveal] = dream_sample_tokens(mask_logits[reveal], temp, cfg.top_p, cfg.top_k, gen)
            # the masked rows' tokens written by their flat window indices (a boolean index would read its count)
            out[flat // w, ws + flat % w] = x0
            return out
        conf, x0 = dream_sample_tokens(mask_logits, temp, cfg.top_p, cfg.top_k, gen, **self._confidence_kind())
        k = dream_num_transfer_host(sum(eligible), b, self._host_timesteps, step, steps, self.timesteps.dtype)
        return self._apply(out, x, mask_w, conf, x0, lo, hi, off, w, flat, k=k, logits=logits if temp == 0 else None)

    def _apply(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        mask_w: torch.Tensor,
        conf: torch.Tensor,
        x0: torch.Tensor,
        lo: int,
        hi: int,
        off: int,
        w: int,
        flat: torch.Tensor,
        *,
        k: int | None = None,
        threshold: float | None = None,
        counts: list[int] | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scatter proposals ``x0 [n]`` / confidences ``conf [n]`` of the masked window rows (``flat [n]``: their
        indices into the ``[B * W]`` window rows, row-major) into the frame and
        reveal ``k`` positions (top-k, or multinomial with ``alg_temp``) or the threshold set among the
        ``counts [B]`` most confident. With the step's ``logits`` (greedy proposals) and a deterministic choice, the
        frame confidences are published for ranking drafts (:meth:`publish_probs`)."""
        b = x.shape[0]
        dev = x.device
        full_conf = torch.full((b, hi - lo), -torch.inf, dtype=conf.dtype, device=dev)
        frame_mask = torch.zeros((b, hi - lo), dtype=torch.bool, device=dev)
        frame_mask[:, off : off + w] = mask_w
        # window row r * W + c is frame entry r * F + off + c: the writes of full_conf[frame_mask] = conf, no read
        at = (flat // w) * (hi - lo) + off + flat % w  # [n]
        full_conf.view(-1).index_copy_(0, at, conf)
        proposal = torch.full((b, hi - lo), self.mask_id, dtype=torch.long, device=dev)
        proposal.view(-1).index_copy_(0, at, x0)
        if logits is not None and (threshold is not None or not self.config.alg_temp):
            self.publish_probs(logits, None, selection=full_conf, selection_start=lo)
        if threshold is not None:
            transfer = threshold_transfer(full_conf, counts, threshold)  # type: ignore[arg-type]
        else:
            transfer = torch.zeros((b, hi - lo), dtype=torch.bool, device=dev)
            if k is not None and k > 0:
                alg_temp = self.config.alg_temp
                if alg_temp is None or alg_temp == 0:
                    _, idx = torch.topk(full_conf, k)
                else:
                    probs = F.softmax(full_conf / alg_temp, dim=-1)
                    idx = torch.multinomial(probs, num_samples=k, generator=self.generator)
                transfer.scatter_(1, idx, True)
            transfer &= frame_mask  # never overwrite a decoded row (the reference would only with ragged counts)
        out[:, lo:hi] = torch.where(transfer, proposal, x[:, lo:hi])
        return out


__all__ = ["DreamSession"]
