"""LLaDA2.0 baseline decoder: the official ``LLaDA2MoeModelLM.generate`` (inclusionAI ``modeling_llada2_moe.py``).

The official generator is SDAR's block diffusion (it lays out, denoises and stops blocks exactly as
:mod:`spiffy.decoding.sdar`), so :class:`LLaDA2Session` is an :class:`~spiffy.decoding.sdar.SDARSession` with the
official generator's rule and defaults:

* blocks of ``block_length`` (default 32) anchored at position 0, the prompt's tail sharing the first decode block;
* per block at most ``steps`` steps (the official ``steps``, default 32, capped at ``gen_length // minimal_topk``);
  the step's count comes from ``get_num_transfer_tokens(block_length, steps)`` (a schedule longer than the block
  ends in steps of count 0, which take only rows above the threshold but still draw their samples: they matter
  when a sampled token was the mask id itself and left its row masked);
* each step samples every block row (``temperature == 0``: argmax of the float32 softmax, the confidence its
  probability, top-k/top-p not applied, as the official greedy branch; else ``logits / T`` when ``T != 1``, top-k
  then top-p (``-inf`` fill, the crossing token kept), softmax, one ``multinomial`` draw per row) and takes every
  masked row whose confidence is strictly above ``threshold`` (default 0.95) when there are at least the step's
  count of them, else the ``min(count, masked)`` most confident (``torch.topk``);
* generation stops after the block that leaves the EOS id in the generated positions (the official ``eos_id``
  check; ``stop_token_ids`` default to the model's EOS id). The official output is ``x[P:]`` cut after its first
  EOS (inclusive) or at ``gen_length``; :meth:`LLaDA2Session.generated` returns every position after the prompt.

Cache modes: ``cache="none"`` (default) is the official computation: every step runs the model on the whole window
``x[:, :block_end]`` under the block-causal mask (the official generator keeps no K/V cache).
``cache="prefix"`` commits each finished block's K/V once (SDAR's ``store_kv`` cache) and denoises on the block's
rows only: the same function of the state (block-causal attention never lets a committed row see later rows), in
fewer FLOPs, equal up to floating-point rounding.

Documented differences from the official generator (none changes a token it returns): ``gen_length`` must be a
multiple of ``block_length`` (the official rounds the layout up, then cuts); ``eos_early_stop`` (a return in the
middle of a block once the EOS and every row before it are decoded) is not offered: the rows before that EOS are
final then, so the official output is the same without it; and the official batch size is 1 (spiffy decodes
ragged batches as SDAR does, each row as alone).

LLaDA2.1's token editing (``editing_threshold``, ``max_post_steps``: rewriting already decoded rows) is refused
with :class:`~spiffy.errors.UnsupportedDecodingError`: see :class:`LLaDA2DecodeConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from spiffy.decoding.config import DecodeConfig
from spiffy.decoding.sdar import SDARSession
from spiffy.decoding.sdar_config import SDARDecodeConfig
from spiffy.decoding.sdar_rule import sdar_sample, select_transfer
from spiffy.decoding.session import StepInfo
from spiffy.errors import ConfigError, UnsupportedDecodingError
from spiffy.models.loading import SpecialTokenIds

OFFICIAL_THRESHOLD = 0.95  # the official generate()'s default
OFFICIAL_BLOCK_LENGTH = 32


@dataclass
class LLaDA2DecodeConfig(SDARDecodeConfig):
    """:class:`~spiffy.decoding.sdar_config.SDARDecodeConfig` with LLaDA2.0's rule and defaults.

    ``block_length`` 32 (``None`` too: LLaDA2 is trained on blocks of 32, so "one block" is not its default),
    ``threshold`` 0.95 (``None`` too), ``cache`` ``"none"`` (official) or ``"prefix"``; the strategy is the
    official one (``low_confidence_dynamic``); ``denoising_steps`` is the official per-block ``steps``.

    Attributes:
        minimal_topk: the official ``minimal_topk``: steps per block capped at ``gen_length // minimal_topk``.
        editing_threshold: LLaDA2.1's token-editing threshold; only ``None`` / ``0`` (LLaDA2.0 semantics) are
            accepted. Editing rewrites rows already decoded: Spiffy's draft graph proposes states that unmask rows
            only and takes a block as final once no mask is left, so under editing a block could be closed (and
            its K/V committed) while the official rule would still rewrite it: output would not be exact.
        max_post_steps: LLaDA2.1's editing steps after a block has no mask left; only ``None`` / ``0`` accepted.
    """

    block_length: int | None = OFFICIAL_BLOCK_LENGTH
    cache: str = "none"
    threshold: float | None = OFFICIAL_THRESHOLD
    strategy: str | None = "low_confidence_dynamic"
    minimal_topk: int = 1
    editing_threshold: float | None = None
    max_post_steps: int | None = None

    NON_RULE_FIELDS: ClassVar[tuple[str, ...]] = SDARDecodeConfig.NON_RULE_FIELDS + (
        "minimal_topk", "editing_threshold", "max_post_steps",
    )

    def validate(self) -> None:
        for name in ("editing_threshold", "max_post_steps"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise UnsupportedDecodingError(
                    f"{name}={value!r} asks for LLaDA2.1 token editing, which rewrites rows already decoded; Spiffy "
                    "cannot stay exact with it (its drafts only unmask rows and a block is closed and committed "
                    f"once no mask is left, while editing may still rewrite it); fix: {name}=0 (LLaDA2.0 decoding)"
                )
        cache = self.cache
        if cache not in ("none", "prefix"):
            raise ConfigError(
                f"cache={cache!r} does not apply to LLaDA2 (a block-causal model never reads future K/V); fix: use "
                "cache='none' (the official generator) or cache='prefix' (committed blocks' K/V)"
            )
        if self.strategy not in (None, "low_confidence_dynamic"):
            raise ConfigError(
                f"strategy={self.strategy!r}: the LLaDA2 generator has one rule (confidence above the threshold, at "
                "least the schedule's count); fix: leave strategy unset"
            )
        self.strategy = "low_confidence_dynamic"
        if self.block_length is None:
            self.block_length = OFFICIAL_BLOCK_LENGTH
        if self.threshold is None:
            self.threshold = OFFICIAL_THRESHOLD
        if isinstance(self.minimal_topk, bool) or not isinstance(self.minimal_topk, int) or self.minimal_topk < 1:
            raise ConfigError(f"minimal_topk={self.minimal_topk!r} must be an integer >= 1; fix: use 1 (official)")
        if int(self.gen_length) // self.minimal_topk < 1:
            raise ConfigError(
                f"minimal_topk={self.minimal_topk} leaves gen_length // minimal_topk = 0 steps per block; fix: use "
                f"minimal_topk <= gen_length ({self.gen_length})"
            )
        # SDAR's checks without its steps <= block_length bound: the official schedule may be longer than the
        # block (its extra steps have a count of 0: they take only rows above the threshold, yet still draw samples)
        DecodeConfig.validate(self)
        if self.denoising_steps is not None:
            if isinstance(self.denoising_steps, bool) or not isinstance(self.denoising_steps, int) or self.denoising_steps < 1:
                raise ConfigError(f"denoising_steps must be an integer >= 1, got {self.denoising_steps!r}")
            if self.steps is not None and self.steps != self.denoising_steps * self.num_blocks:
                raise ConfigError(
                    f"steps={self.steps} (total) contradicts denoising_steps={self.denoising_steps} per block "
                    f"x {self.num_blocks} blocks; fix: pass only one of them"
                )
        if self.stop_token_ids is not None:
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ConfigError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids
        self.cache = cache

    @property
    def steps_per_block(self) -> int:
        if self.denoising_steps is not None:
            steps = int(self.denoising_steps)
        elif self.steps is not None:
            steps = int(self.steps) // self.num_blocks
        else:
            steps = OFFICIAL_BLOCK_LENGTH  # the official default steps=32
        return max(1, min(steps, int(self.gen_length) // int(self.minimal_topk)))

    def rule_dict(self) -> dict[str, Any]:
        d = super().rule_dict()
        d["cache"] = None  # both modes compute the same function of the state
        return d


def llada2_sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The official ``_sample_with_temperature_topk_topp`` on ``logits [B, L, V]``: returns tokens ``[B, L]``,
    their probabilities ``[B, L]`` and the distribution ``[B, L, V]``. ``temperature == 0``: argmax of the softmax
    of the raw logits (top-k/top-p not applied); else SDAR's sampling step (the same filters and draw)."""
    if float(temperature) != 0.0:
        return sdar_sample(logits, temperature, top_k, top_p, generator)
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.argmax(probs, dim=-1, keepdim=True)
    return tokens[..., 0], torch.gather(probs, -1, tokens)[..., 0], probs


class LLaDA2Session(SDARSession):
    """One LLaDA2.0 generation (see the module doc). Constructor as :class:`~spiffy.decoding.sdar.SDARSession`."""

    rule = "llada2"
    config_class = LLaDA2DecodeConfig

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any = None, **kw: Any) -> None:
        cfg = config if isinstance(config, LLaDA2DecodeConfig) else LLaDA2DecodeConfig.from_config(config)
        super().__init__(model, input_ids, cfg, **kw)
        self.recompute = cfg.cache == "none"

    @classmethod
    def for_model(
        cls,
        model: Any,
        input_ids: torch.Tensor,
        config: Any,
        *,
        token_ids: SpecialTokenIds,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> "LLaDA2Session":
        """As the base, and the official stop rule: ``stop_token_ids`` default to the model's EOS id."""
        if config.stop_token_ids is None and token_ids.eos is not None:
            config = LLaDA2DecodeConfig.from_config(config, stop_token_ids=(int(token_ids.eos),))
        return cls(model, input_ids, config, mask_id=token_ids.require("mask"), attention_mask=attention_mask,
                   generator=generator)

    # ------------------------------------------------------------------ model calls
    def begin_block(self, block: int) -> torch.Tensor | None:
        if not self.recompute:
            return super().begin_block(block)
        self._block = block  # nothing to commit: every step recomputes the whole window
        return None

    def begin_block_calls(self, block: int) -> int:
        return 0 if self.recompute else super().begin_block_calls(block)

    def query_start(self) -> int:
        """``cache="none"``: the official call computes the whole window ``[0, block_end)`` of each state under the
        block-causal mask (logits of the block kept); ``"prefix"``: the block's rows against the committed K/V."""
        return 0 if self.recompute else super().query_start()

    # ------------------------------------------------------------------ the rule
    def transition(self, x: torch.Tensor, logits: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """One official denoising step on ``x [B, T]`` with window logits ``[B, L, V]`` (one multinomial draw per
        block row from :attr:`generator` when ``temperature > 0``)."""
        s, e = info.block_start, info.block_end
        off = s - info.window_start
        block_logits = logits[:, off : off + (e - s)]
        tokens, token_probs, _ = llada2_sample(block_logits, self.temperature, self.top_k, self.top_p, self.generator)
        cur = x[:, s:e]
        masked = cur == self.mask_id
        transfer = select_transfer(
            masked, token_probs, None, self.schedule[info.step], "low_confidence_dynamic", self.threshold, 0.0,
            counts=self.masked_counts(info.block, x)[1],
        )
        if self.temperature == 0:
            # the confidences the rule's torch.topk ranked (their ties order ranking's drafts as the baseline would)
            self.publish_probs(logits, None, selection=torch.where(masked, token_probs, -torch.inf), selection_start=s)
        out = x.clone()
        out[:, s:e] = torch.where(transfer, tokens, cur)
        return out


__all__ = ["LLaDA2DecodeConfig", "LLaDA2Session", "OFFICIAL_THRESHOLD", "llada2_sample"]
