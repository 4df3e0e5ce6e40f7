"""``DecodeConfig``: the decoding configuration shared by every dLLM decoder (LLaDA, Dream, SDAR).

One dataclass carries the fields of every family; each decoder reads the ones it understands. SDAR-specific
options live in a subclass (``spiffy.decoding.sdar.SDARDecodeConfig``). Validation happens at construction and
raises :class:`~spiffy.errors.ConfigError` naming the bad field and the fix.

Conventions:

* ``block_length=None`` means one block covering the whole generation (Dream's ``diffusion_generate``; LLaDA's
  ``generate`` with ``block_length == gen_length``).
* ``steps`` is the *total* number of denoising steps (LLaDA convention), divided evenly over the blocks;
  ``steps=None`` means ``gen_length`` (one token per step).
* ``threshold`` switches to Fast-dLLM dynamic unmasking (every masked in-block position with confidence >= tau,
  and at least the most confident one); the block then ends when no mask is left in it.
* Sampling "off" is one convention, :class:`~spiffy.sampling.SamplingConfig`'s: ``temperature == 0`` is greedy for
  every family, ``top_p == 1.0`` and ``top_k == 0`` disable the filters. ``None`` (the reference generators'
  spelling) is accepted for ``top_p`` / ``top_k`` and stored as ``1.0`` / ``0``.
* ``seed`` seeds the ``torch.Generator`` every random draw of the decoding rule consumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from spiffy.errors import ConfigError
from spiffy.sampling import SamplingConfig

REMASKING: tuple[str, ...] = ("low_confidence", "random")
CACHE_MODES: tuple[str, ...] = ("none", "prefix", "dual")
DREAM_ALGS: tuple[str, ...] = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass
class DecodeConfig:
    """Decoding configuration of one dLLM generation.

    Attributes:
        gen_length: number of generated positions (masked at the start).
        block_length: positions per block (``None`` = ``gen_length``, one block); must divide ``gen_length``.
        steps: total denoising steps over all blocks (``None`` = ``gen_length``); must be a multiple of the
            number of blocks. Under threshold decoding it only bounds nothing: blocks end when fully unmasked.
        threshold: ``None`` (static schedule) or ``0 < tau <= 1`` (Fast-dLLM dynamic unmasking).
        remasking: ``"low_confidence"`` (softmax confidence of the proposed token) or ``"random"``.
        temperature: ``>= 0``; 0 = greedy.
        cfg_scale: classifier-free guidance scale ``>= 0`` (LLaDA; 0 = off).
        logits_eos_inf: LLaDA option: EOS logit set to -inf before choosing tokens.
        confidence_eos_eot_inf: LLaDA option: confidence of EOS/EoT proposals set to -inf.
        cache: ``"none"`` | ``"prefix"`` | ``"dual"`` (Fast-dLLM K/V cache modes for bidirectional models).
        seed: seed of the decoding generator (``None`` = 0).
        alg: Dream unmasking rule (``"origin"``, ``"maskgit_plus"``, ``"topk_margin"``, ``"entropy"``);
            ``None`` = derived from ``remasking`` (``low_confidence`` -> ``maskgit_plus``, ``random`` -> ``origin``).
        alg_temp: Dream confidence temperature (``None`` or 0 = deterministic top-k of the confidence).
        eps: Dream's final timestep (timesteps ``linspace(1, eps, steps + 1)``).
        top_p: nucleus sampling mass in ``(0, 1]``, ``1.0`` = off (Dream/SDAR; ``None`` is read as off).
        top_k: top-k sampling, ``0`` = off (Dream/SDAR; ``None`` is read as off).
        mask_id: override of the family's mask token id (``None`` = from config/tokenizer).
    """

    gen_length: int = 128
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    cache: str = "none"
    seed: int | None = None
    # Dream extras
    alg: str | None = None
    alg_temp: float | None = None
    eps: float = 1e-3
    top_p: float = 1.0
    top_k: int = 0
    # token override
    mask_id: int | None = None

    # fields that do not change the decoding rule (left out of the fingerprint)
    NON_RULE_FIELDS: ClassVar[tuple[str, ...]] = ("gen_length", "seed", "mask_id")
    #: the CLI flag a user changes to recalibrate a draft graph for a differing ``calibrated_for`` field (named in
    #: GraphMismatchError messages; subclasses add their own fields)
    CLI_FLAGS: ClassVar[dict[str, str]] = {
        "block_length": "--block-length",
        "steps_per_block": "--steps",
        "threshold": "--threshold",
        "remasking": "--remasking",
        "alg": "--alg",
        "cache": "--cache",
        "tokens_per_step": "--steps / --threshold",
        "temperature": "--temperature",
    }
    # numeric fields normalised to float in the fingerprint (subclasses may extend)
    FLOAT_FIELDS: ClassVar[tuple[str, ...]] = ("threshold", "temperature", "cfg_scale", "alg_temp", "eps", "top_p")

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field; raises :class:`ConfigError` naming the field and the fix. Subclasses extend it."""
        _int_field("gen_length", self.gen_length, minimum=1)
        if self.block_length is not None:
            _int_field("block_length", self.block_length, minimum=1)
            if self.gen_length % self.block_length != 0:
                raise ConfigError(
                    f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}; "
                    f"fix: choose a block_length dividing gen_length (e.g. {_divisor_hint(self.gen_length, self.block_length)})"
                )
        if self.steps is not None:
            _int_field("steps", self.steps, minimum=1)
            nb = self.num_blocks
            if self.steps % nb != 0:
                raise ConfigError(
                    f"steps={self.steps} is not a multiple of the number of blocks {nb} "
                    f"(gen_length={self.gen_length} / block_length={self.resolved_block_length}); "
                    f"fix: use steps={max(nb, (self.steps // nb) * nb)} or another multiple of {nb}"
                )
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
                raise ConfigError(f"threshold must be a number in (0, 1] or None, got {self.threshold!r}")
            if not (0.0 < float(self.threshold) <= 1.0):
                raise ConfigError(
                    f"threshold={self.threshold} is outside (0, 1]; fix: pass a confidence threshold such as 0.9, "
                    "or None for the static schedule"
                )
        if self.remasking not in REMASKING:
            raise ConfigError(f"remasking={self.remasking!r} is unknown; fix: use one of {', '.join(REMASKING)}")
        _number_field("temperature", self.temperature, "use 0 for greedy decoding or a positive temperature")
        _number_field("cfg_scale", self.cfg_scale, "use 0 to disable classifier-free guidance")
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"cache={self.cache!r} is unknown; fix: use one of {', '.join(CACHE_MODES)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if self.alg is not None and self.alg not in DREAM_ALGS:
            raise ConfigError(f"alg={self.alg!r} is unknown; fix: use one of {', '.join(DREAM_ALGS)} (or None)")
        if self.alg_temp is not None:
            _number_field("alg_temp", self.alg_temp, "use None or 0 for deterministic confidence ranking")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (0.0 <= float(self.eps) < 1.0):
            raise ConfigError(f"eps={self.eps!r} must be in [0, 1); fix: use Dream's default 1e-3")
        if self.top_p is None:  # the reference generators' "off"
            self.top_p = 1.0
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < float(self.top_p) <= 1.0):
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]; fix: pass e.g. 0.95, or 1.0 to disable")
        if self.top_k is None:
            self.top_k = 0
        _int_field("top_k", self.top_k, minimum=0, fix="pass a positive integer, or 0 to disable")
        if self.mask_id is not None:
            _int_field("mask_id", self.mask_id, minimum=0)

    # ------------------------------------------------------------------ derived values
    @property
    def resolved_block_length(self) -> int:
        """Block length with ``None`` resolved to ``gen_length``."""
        return self.gen_length if self.block_length is None else int(self.block_length)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.resolved_block_length

    @property
    def resolved_steps(self) -> int:
        """Total steps with ``None`` resolved to ``gen_length``."""
        return self.gen_length if self.steps is None else int(self.steps)

    @property
    def steps_per_block(self) -> int:
        return self.resolved_steps // self.num_blocks

    @property
    def tokens_per_step(self) -> int | str | None:
        """Tokens unmasked per step of a block: an int for uniform static schedules, ``"dynamic"`` under threshold
        decoding, ``None`` when the static schedule is not uniform (``block_length % steps_per_block != 0``)."""
        if self.threshold is not None:
            return "dynamic"
        bl, spb = self.resolved_block_length, self.steps_per_block
        return bl // spb if bl % spb == 0 else None

    @property
    def resolved_alg(self) -> str:
        """Dream unmasking rule with ``None`` resolved from :attr:`remasking`."""
        if self.alg is not None:
            return self.alg
        return "maskgit_plus" if self.remasking == "low_confidence" else "origin"

    @property
    def resolved_seed(self) -> int:
        return 0 if self.seed is None else int(self.seed)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict, plus ``"type"`` (the class name)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["type"] = type(self).__name__
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DecodeConfig":
        """Inverse of :meth:`to_dict` (unknown keys raise :class:`ConfigError`). A ``"type"`` naming a subclass
        (e.g. ``SDARDecodeConfig``, as graphs record it) builds that subclass."""
        kind = data.get("type")
        if kind and kind != cls.__name__:
            sub = next((c for c in _subclasses(cls) if c.__name__ == kind), None)
            if sub is None:
                raise ConfigError(f"decoding config type {kind!r} is not a {cls.__name__}; fix: pass a dict written by "
                                  f"to_dict() of a {cls.__name__} class")
            return sub.from_dict(data)
        data = {k: v for k, v in data.items() if k != "type"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown decoding field(s) {', '.join(unknown)} for {cls.__name__}; fix: use fields among {', '.join(sorted(names))}"
            )
        return cls(**data)

    @classmethod
    def from_config(cls, config: "DecodeConfig | None" = None, **overrides: Any) -> "DecodeConfig":
        """A ``cls`` configuration (a family's :attr:`~spiffy.decoding.session.DecodeSession.config_class`) from
        ``config`` with ``overrides`` applied: ``None`` gives the defaults, a ``cls`` instance (subclasses included)
        is kept, another configuration gives its fields ``cls`` has (e.g. a plain :class:`DecodeConfig` for SDAR).

        Raises:
            ConfigError: an unknown override or a bad value.
        """
        if config is not None and not isinstance(config, DecodeConfig):
            raise ConfigError(f"config must be a DecodeConfig, got {type(config).__name__}; fix: pass a DecodeConfig")
        if isinstance(config, cls):
            return config.replace(**overrides) if overrides else config
        names = {f.name for f in dataclasses.fields(cls)}
        _check_names(overrides, names, cls.__name__)
        base = {} if config is None else {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        base = {k: v for k, v in base.items() if k in names}
        base.update(overrides)
        return cls(**base)

    def replace(self, **overrides: Any) -> "DecodeConfig":
        """A validated copy with ``overrides`` applied (unknown names raise :class:`ConfigError`)."""
        _check_names(overrides, {f.name for f in dataclasses.fields(self)}, type(self).__name__)
        return dataclasses.replace(self, **overrides)

    @property
    def sampling(self) -> SamplingConfig:
        """Temperature, top-p, top-k and seed as one :class:`~spiffy.sampling.SamplingConfig` (same convention)."""
        return SamplingConfig(float(self.temperature), float(self.top_p), int(self.top_k), self.seed)

    def rule_dict(self) -> dict[str, Any]:
        """The fields that define the decoding rule (what a calibrated graph depends on), resolved.

        Excludes ``gen_length``, ``seed`` and ``mask_id``; includes ``block_length`` and ``steps_per_block``
        resolved, ``alg`` resolved, ``tokens_per_step``.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.NON_RULE_FIELDS}
        d.pop("steps", None)
        d["block_length"] = self.resolved_block_length
        d["steps_per_block"] = self.steps_per_block
        d["tokens_per_step"] = self.tokens_per_step
        d["alg"] = self.resolved_alg
        d["type"] = type(self).__name__
        # "off" is hashed as None, the spelling graph files were fingerprinted with before the one convention
        d["top_p"] = None if float(self.top_p) >= 1.0 else self.top_p
        d["top_k"] = None if int(self.top_k) == 0 else self.top_k
        for k in self.FLOAT_FIELDS:
            if d.get(k) is not None and not isinstance(d[k], bool):
                d[k] = float(d[k])  # 1 and 1.0 hash alike
        return d

    def fingerprint(self) -> str:
        """Stable hex hash (16 chars) of :meth:`rule_dict` (independent of gen_length, seed, mask_id)."""
        payload = json.dumps(self.rule_dict(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def _check_names(overrides: dict[str, Any], names: set[str], owner: str) -> None:
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"unknown decoding option(s) {', '.join(unknown)} for {owner}; fix: use options among {', '.join(sorted(names))}"
        )


def _int_field(name: str, value: Any, *, minimum: int, fix: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}; fix: {fix or f'pass an integer >= {minimum}'}")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}; fix: {fix or f'pass an integer >= {minimum}'}")


def _number_field(name: str, value: Any, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}; fix: {fix}")
    if value != value or value < 0:  # NaN or negative
        raise ConfigError(f"{name}={value} must be >= 0; fix: {fix}")


def _divisor_hint(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), d))


__all__ = ["DecodeConfig", "REMASKING", "CACHE_MODES", "DREAM_ALGS"]


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, recursively (the family configs, e.g. ``SDARDecodeConfig``)."""
    found: list[type] = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
