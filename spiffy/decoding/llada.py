"""LLaDA baseline decoding (ML-GSAI/LLaDA ``generate`` semantics, plus Fast-dLLM threshold and cache modes).

Per block of ``block_length`` positions, ``steps_per_block`` steps (static schedule from
:func:`~spiffy.decoding.schedules.get_num_transfer_tokens`) or, with ``threshold``, steps until the block has no
mask left. One step:

1. ``logits`` (CFG: batch doubled with the prompt masked in the unconditional copy,
   ``un + (cfg + 1) * (cond - un)``); ``logits_eos_inf`` sets the EOS logit to ``-inf``.
2. ``x0 = argmax(exp(logits) / (-log u) ** T)`` with ``u`` float64 uniforms (``T = 0``: ``argmax(logits)``, no
   draw).
3. Confidence: ``low_confidence`` = ``softmax(logits)[x0]``, in the logits' dtype without cache and threshold
   (ML-GSAI's ``generate``), in float64 with a cache or a threshold (Fast-dLLM's generators compute
   ``softmax(logits.to(float64))``; in bfloat16 the two rank differently); ``random`` = uniforms
   ``torch.rand((B, L))``. Non-masked rows and rows outside the block get ``-inf``. (Fast-dLLM's no-cache,
   fixed-step ``generate`` also uses float64; there spiffy follows ML-GSAI, the original.)
4. ``torch.topk`` per row picks the scheduled number of positions (threshold: every masked in-block position with
   confidence ``>= tau``, and always the most confident one).

``confidence_eos_eot_inf`` reproduces the official script exactly, including its chained assignment: after ``x0``
is chosen, the EoT logit is set to ``-inf`` before the softmax, and at ``T = 0`` (where the noisy logits are the
logits themselves) the EOS logit too; so proposals of those tokens get confidence 0 rather than ``-inf``.

Seeds: without a cache, ``seed=K`` reproduces the official script run after ``torch.manual_seed(K)`` token for
token (same draws: ``rand`` over the full ``[B, T, V]`` float64 logits for the Gumbel noise, ``rand((B, T))`` for
random remasking, in the same order). With a cache the draws cover the window only (Fast-dLLM uses the global RNG;
its seeds are not reproduced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spiffy.decoding.base import BidirectionalSession
from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.sampling import add_gumbel_noise
from spiffy.decoding.schedules import get_num_transfer_tokens, threshold_transfer, topk_transfer
from spiffy.decoding.session import StepInfo
from spiffy.errors import MissingTokenError
from spiffy.models.loading import SpecialTokenIds


class LLaDASession(BidirectionalSession):
    """One LLaDA generation (see the module docstring for the rule).

    Args:
        model, input_ids, config, mask_id, attention_mask: see :class:`~spiffy.decoding.base.BidirectionalSession`.
        eos_id: EOS token id (``logits_eos_inf``/``confidence_eos_eot_inf``), from config/tokenizer.
        eot_id: end-of-turn token id (``confidence_eos_eot_inf``), from config/tokenizer; may be ``None``.
    """

    rule = "llada"
    shifted_logits = False

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig,
        *,
        token_ids: SpecialTokenIds,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> "LLaDASession":
        """A session with the EOS / end-of-turn ids the LLaDA options read (MissingTokenError when an option needs
        the EOS id and the model has none)."""
        if (config.logits_eos_inf or config.confidence_eos_eot_inf) and token_ids.eos is None:
            raise MissingTokenError(
                "logits_eos_inf / confidence_eos_eot_inf need the EOS id but neither the config nor the tokenizer "
                "has one; fix: pass a tokenizer or set eos_token_id in config.json"
            )
        return cls(model, input_ids, config, mask_id=token_ids.require("mask"), attention_mask=attention_mask,
                   generator=generator, eos_id=token_ids.eos, eot_id=token_ids.eot)

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        config: DecodeConfig,
        *,
        mask_id: int,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
    ) -> None:
        super().__init__(model, input_ids, config, mask_id=mask_id, attention_mask=attention_mask, generator=generator)
        self.eos_id = eos_id
        self.eot_id = eot_id
        self.num_transfer_tokens: torch.Tensor | None = None  # [B, steps] this block's schedule
        self._transfer_counts: list[list[int]] = []  # the same on the host, read once per block
        # Fast-dLLM's generators (every cache mode, and the threshold rule) rank softmax(logits.to(float64));
        # ML-GSAI's generate ranks the softmax in the logits' dtype (bf16 ties and roundings differ)
        self.float64_confidence = config.cache != "none" or config.threshold is not None

    def on_block_start(self, block: int) -> None:
        start, end = self.block_bounds(block)
        self.num_transfer_tokens = get_num_transfer_tokens(self.x[:, start:end] == self.mask_id, self.steps_per_block)
        # each step's torch.topk needs its count on the host: the schedule is a function of the block's masked count
        # (get_num_transfer_tokens on the host), read once per block or taken from a read Spiffy made of this state
        steps = int(self.steps_per_block)
        self._transfer_counts = [[m // steps + (i < m % steps) for i in range(steps)]
                                 for m in self.masked_counts(block, self.x)[1]]

    def block_end_by_rule(self, block: int, step: int) -> bool | None:
        if self.config.threshold is not None:
            return True if step >= self.max_dynamic_steps() else None
        return step >= self.steps_per_block

    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """One LLaDA step on ``x [B, T]`` from aligned window logits ``[B, W, V]``; returns the next state."""
        cfg = self.config
        b, t = x.shape
        w = logits.shape[1]
        ws = info.window_start
        lo, hi = self.frame(info, w)
        off = ws - lo  # window offset inside the frame
        lg = logits
        if cfg.logits_eos_inf and self.eos_id is not None:
            lg = lg.clone()
            lg[:, :, self.eos_id] = -torch.inf
        temp = float(cfg.temperature)
        if temp == 0:
            noisy = lg
        else:
            # the reference draws uniforms for every row of its frame (full sequence without cache)
            noise = torch.rand((b, hi - lo, lg.shape[-1]), generator=self.generator, device=lg.device, dtype=torch.float64)
            noisy = add_gumbel_noise(lg, temp, self.generator, noise=noise[:, off : off + w])
        x0 = torch.argmax(noisy, dim=-1)  # [B, W]
        if cfg.confidence_eos_eot_inf:
            lg = lg.clone()
            if self.eot_id is not None:
                lg[:, :, self.eot_id] = -torch.inf
            if temp == 0 and self.eos_id is not None:  # the reference's noisy logits alias the logits at T = 0
                lg[:, :, self.eos_id] = -torch.inf
        if cfg.remasking == "low_confidence":
            p = F.softmax(lg.to(torch.float64) if self.float64_confidence else lg, dim=-1)
            x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
        else:
            x0_p = torch.rand((b, hi - lo), generator=self.generator, device=x.device)[:, off : off + w]
        mask_w = self.block_mask_in_window(x, info, w)
        conf = torch.full((b, hi - lo), -torch.inf, dtype=x0_p.dtype, device=x.device)
        conf[:, off : off + w] = torch.where(mask_w, x0_p, torch.full_like(x0_p, -torch.inf))
        if cfg.remasking == "low_confidence":
            self._publish(logits, lg, p, x0_p, conf, lo, temp)
        if cfg.threshold is not None:
            # the eligible counts on the host (a read Spiffy made of this state, else one read here)
            transfer = threshold_transfer(conf, self.masked_counts(info.block, x)[0], float(cfg.threshold))
        else:
            assert self.num_transfer_tokens is not None, "begin_block was not called"
            transfer = topk_transfer(conf, [counts[info.step] for counts in self._transfer_counts])
        x0_frame = x[:, lo:hi].clone()
        x0_frame[:, off : off + w] = torch.where(mask_w, x0, x[:, ws : ws + w])
        out = x.clone()
        out[:, lo:hi] = torch.where(transfer, x0_frame, x[:, lo:hi])
        return out

    def _publish(self, logits: torch.Tensor, lg: torch.Tensor, p: torch.Tensor, x0_p: torch.Tensor,
                 conf: torch.Tensor, lo: int, temp: float) -> None:
        """Publish what ranking drafts can reuse: the plain float32/float64 softmax of ``logits`` (with, greedy, its
        top-1 = the proposals' confidence ``x0_p``), and at ``T = 0`` the frame confidences ``conf [B, hi - lo]``
        the ``torch.topk`` chose from (their ties decide the order in half precision)."""
        plain = lg is logits and p.dtype in (torch.float32, torch.float64)
        selection = conf if temp == 0 else None
        if plain or selection is not None:
            self.publish_probs(logits, p if plain else None, x0_p if plain and temp == 0 else None, selection, lo)


__all__ = ["LLaDASession"]
