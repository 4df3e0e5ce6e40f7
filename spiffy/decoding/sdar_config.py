"""SDAR's decoding configuration: :class:`SDARDecodeConfig` (a :class:`~spiffy.decoding.config.DecodeConfig` plus
SDAR's strategy, per-block steps, entropy budget, stop tokens). The decoder is :mod:`spiffy.decoding.sdar`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from spiffy.decoding.config import DecodeConfig
from spiffy.errors import ConfigError

STRATEGIES: tuple[str, ...] = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")
DEFAULT_CONFIDENCE_THRESHOLD = 0.85  # the reference's default for low_confidence_dynamic
DEFAULT_EB_THRESHOLD = 0.35  # JetEngine's default entropy budget



# ---------------------------------------------------------------------------------------------------- config
@dataclass
class SDARDecodeConfig(DecodeConfig):
    """:class:`~spiffy.decoding.config.DecodeConfig` plus SDAR's options.

    Shared fields keep their meaning; for SDAR: ``block_length`` defaults to 4 (SDAR's training block);
    ``threshold`` is the ``low_confidence_dynamic`` confidence threshold (strictly ``>``, as the reference);
    ``cache`` is always SDAR's block-causal ``store_kv`` cache (``"none"``/``"prefix"`` are both normalised to
    ``"prefix"``; ``"dual"`` is an error); ``remasking``/``cfg_scale``/Dream fields are ignored.

    Attributes:
        strategy: ``"sequential"``, ``"low_confidence_static"``, ``"low_confidence_dynamic"`` or
            ``"entropy_bounded"``; ``None`` = dynamic when ``threshold`` is set, else static.
        denoising_steps: steps per block (the reference's ``denoising_steps``); ``None`` = ``steps // num_blocks``
            when ``steps`` is given, else ``block_length``. Must be in ``[1, block_length]``.
        eb_threshold: entropy budget of ``entropy_bounded`` (nats, summed over the rows unmasked in a step).
        overwrite_quirk: reproduce the reference's over-selection when a step's count exceeds the masks left.
        fuse_commit: fuse each commit forward with the next block's first denoising forward (same tokens,
            one call fewer per block).
        stop_token_ids: stop after the block in which one of these ids appears (``None`` = never).
    """

    block_length: int | None = 4
    cache: str = "prefix"
    strategy: str | None = None
    denoising_steps: int | None = None
    eb_threshold: float = DEFAULT_EB_THRESHOLD
    overwrite_quirk: bool = False
    fuse_commit: bool = False
    stop_token_ids: tuple[int, ...] | None = None

    NON_RULE_FIELDS: ClassVar[tuple[str, ...]] = ("gen_length", "seed", "mask_id", "fuse_commit", "stop_token_ids")
    FLOAT_FIELDS: ClassVar[tuple[str, ...]] = DecodeConfig.FLOAT_FIELDS + ("eb_threshold",)
    CLI_FLAGS: ClassVar[dict[str, str]] = {**DecodeConfig.CLI_FLAGS, "strategy": "--strategy"}

    def validate(self) -> None:
        if self.cache in ("none", "prefix"):
            self.cache = "prefix"
        elif self.cache == "dual":
            raise ConfigError(
                "cache='dual' does not apply to SDAR (a block-causal model never reads future K/V); "
                "fix: use cache='prefix' (SDAR's store_kv cache, the default)"
            )
        super().validate()
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} is unknown; fix: use one of {', '.join(STRATEGIES)}")
        if self.denoising_steps is not None:
            if isinstance(self.denoising_steps, bool) or not isinstance(self.denoising_steps, int):
                raise ConfigError(f"denoising_steps must be an integer, got {self.denoising_steps!r}")
            if self.steps is not None and self.steps != self.denoising_steps * self.num_blocks:
                raise ConfigError(
                    f"steps={self.steps} (total) contradicts denoising_steps={self.denoising_steps} per block "
                    f"x {self.num_blocks} blocks; fix: pass only one of them"
                )
        spb = self.steps_per_block
        bl = self.resolved_block_length
        if not 1 <= spb <= bl:
            raise ConfigError(
                f"SDAR needs 1 <= denoising steps per block <= block_length, got {spb} steps for block_length={bl}; "
                f"fix: pass denoising_steps between 1 and {bl}"
            )
        if isinstance(self.eb_threshold, bool) or not isinstance(self.eb_threshold, (int, float)) or not (
            float(self.eb_threshold) >= 0.0
        ):
            raise ConfigError(f"eb_threshold={self.eb_threshold!r} must be a number >= 0; fix: use e.g. 0.35")
        if self.stop_token_ids is not None:
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ConfigError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids

    # ------------------------------------------------------------------ derived values
    @property
    def steps_per_block(self) -> int:
        if self.denoising_steps is not None:
            return int(self.denoising_steps)
        if self.steps is not None:
            return int(self.steps) // self.num_blocks
        return self.resolved_block_length

    @property
    def resolved_steps(self) -> int:
        return self.steps_per_block * self.num_blocks

    @property
    def resolved_strategy(self) -> str:
        if self.strategy is not None:
            return self.strategy
        return "low_confidence_dynamic" if self.threshold is not None else "low_confidence_static"

    @property
    def resolved_threshold(self) -> float:
        """Confidence threshold of ``low_confidence_dynamic`` (``threshold`` or the reference's 0.85)."""
        return DEFAULT_CONFIDENCE_THRESHOLD if self.threshold is None else float(self.threshold)

    @property
    def tokens_per_step(self) -> int | str | None:
        strategy = self.resolved_strategy
        if strategy in ("low_confidence_dynamic", "entropy_bounded"):
            return "dynamic"
        bl, spb = self.resolved_block_length, self.steps_per_block
        return bl // spb if bl % spb == 0 else None

    def rule_dict(self) -> dict[str, Any]:
        d = super().rule_dict()
        d.pop("denoising_steps", None)
        d["strategy"] = self.resolved_strategy
        # only the parameters the strategy reads are part of the rule
        d["threshold"] = self.resolved_threshold if d["strategy"] == "low_confidence_dynamic" else None
        if d["strategy"] != "entropy_bounded":
            d["eb_threshold"] = None
        for name in ("remasking", "cfg_scale", "logits_eos_inf", "confidence_eos_eot_inf", "alg", "alg_temp", "eps"):
            d.pop(name, None)  # not part of SDAR's rule
        return d


__all__ = ["DEFAULT_CONFIDENCE_THRESHOLD", "DEFAULT_EB_THRESHOLD", "STRATEGIES", "SDARDecodeConfig"]
