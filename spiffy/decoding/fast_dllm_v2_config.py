"""Fast-dLLM v2's decoding configuration: :class:`FastDLLMv2DecodeConfig` (a
:class:`~spiffy.decoding.config.DecodeConfig` plus the official generator's sub-block size and stop token). The
decoder is :mod:`spiffy.decoding.fast_dllm_v2`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from spiffy.decoding.config import DecodeConfig
from spiffy.errors import ConfigError

#: the official ``generate``'s threshold default (``x1_p > 1`` never holds: exactly one token per step)
OFFICIAL_DEFAULT_THRESHOLD = 1.0


@dataclass
class FastDLLMv2DecodeConfig(DecodeConfig):
    """:class:`~spiffy.decoding.config.DecodeConfig` with Fast-dLLM v2's options and the official ``generate``'s
    defaults.

    Shared fields: ``gen_length`` is the official ``max_new_tokens`` (a multiple of ``block_length``: the official
    loop runs ``max_new_tokens // block_size`` blocks); ``block_length`` is ``block_size`` (default 32);
    ``threshold`` the confidence above which a masked position of the current sub-block is unmasked (strictly ``>``;
    the most confident one always is); ``None`` = the official default 1.0 (one token per step); ``temperature``
    (0 = argmax of the softmax) and ``top_p`` (default 0.95, the official default; used when ``temperature > 0``);
    ``cache``: ``"prefix"`` (``"none"`` is read as it: the committed blocks' K/V are always cached, as officially)
    or ``"dual"`` (the official ``use_block_cache=True`` sub-block cache). ``steps``, ``top_k``, ``remasking`` other
    than ``low_confidence``, ``cfg_scale`` and LLaDA's EOS options are refused; Dream's ``alg``/``alg_temp``/``eps``
    are not part of the rule.

    Attributes:
        small_block_size: sub-block length (the official ``small_block_size``, default 8); divides ``block_length``.
        stop_token_ids: ids that end generation (``None`` = the model's end-of-turn id, the official
            ``stop_token=151645`` ``<|im_end|>``; ``()`` = never).
    """

    block_length: int | None = 32
    top_p: float = 0.95
    cache: str = "prefix"
    small_block_size: int = 8
    stop_token_ids: tuple[int, ...] | None = None

    NON_RULE_FIELDS: ClassVar[tuple[str, ...]] = ("gen_length", "seed", "mask_id", "stop_token_ids")
    CLI_FLAGS: ClassVar[dict[str, str]] = {**DecodeConfig.CLI_FLAGS, "small_block_size": "--small-block-size"}

    def validate(self) -> None:
        if self.cache == "none":
            self.cache = "prefix"
        super().validate()
        bl = self.resolved_block_length
        sb = self.small_block_size
        if isinstance(sb, bool) or not isinstance(sb, int) or sb < 1 or bl % sb:
            raise ConfigError(
                f"small_block_size={sb!r} must be a positive divisor of block_length={bl} (the official loop never "
                f"finishes a block otherwise); fix: use e.g. small_block_size={min(8, bl) if bl % min(8, bl) == 0 else 1}"
            )
        refused = {
            "steps": (self.steps is not None, "Fast-dLLM v2 unmasks by threshold (no step schedule); drop steps"),
            "top_k": (self.top_k != 0, "the official sampler has no top-k; use top_p"),
            "remasking": (self.remasking != "low_confidence", "the official rule is confidence based"),
            "cfg_scale": (float(self.cfg_scale) != 0.0, "the official generator has no guidance"),
            "logits_eos_inf": (bool(self.logits_eos_inf), "a LLaDA option"),
            "confidence_eos_eot_inf": (bool(self.confidence_eos_eot_inf), "a LLaDA option"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"{name}={getattr(self, name)!r} does not apply to Fast-dLLM v2 ({why}); fix: leave "
                                  f"{name} at its default")
        if self.stop_token_ids is not None:
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ConfigError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids

    @property
    def resolved_threshold(self) -> float:
        return OFFICIAL_DEFAULT_THRESHOLD if self.threshold is None else float(self.threshold)

    @property
    def block_cache(self) -> bool:
        """The official ``use_block_cache`` (``cache="dual"``)."""
        return self.cache == "dual"

    @property
    def tokens_per_step(self) -> int | str | None:
        return 1 if self.resolved_threshold >= 1.0 else "dynamic"

    def rule_dict(self) -> dict[str, Any]:
        d = super().rule_dict()
        d["threshold"] = self.resolved_threshold
        for name in ("steps", "remasking", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf", "alg", "alg_temp",
                     "eps", "top_k"):
            d.pop(name, None)  # not part of Fast-dLLM v2's rule
        if float(self.temperature) == 0.0:
            d.pop("top_p", None)  # read only when sampling
        return d


__all__ = ["OFFICIAL_DEFAULT_THRESHOLD", "FastDLLMv2DecodeConfig"]
