"""One configuration object for AR speculative generation (method, draft sizes, limits, sampling), validated once
where it enters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from spiffy.arspec.methods import DEFAULT_ACCEPT, DEFAULT_METHOD, Method, get_accept, get_method
from spiffy.errors import ConfigError
from spiffy.sampling import SamplingConfig

__all__ = ["ARSpecConfig", "DEFAULT_BUDGET", "DEFAULT_DRAFTS", "DEFAULT_MAX_NEW_TOKENS", "stop_id_tuple"]

#: tree nodes verified per round (root excluded) when no budget is given
DEFAULT_BUDGET = 64
#: SpecDiff-2 joint drafts per round when no count is given
DEFAULT_DRAFTS = 4
#: generated tokens at most when no limit is given
DEFAULT_MAX_NEW_TOKENS = 128


def stop_id_tuple(stop_token_ids: int | Iterable[int] | None) -> tuple[int, ...]:
    """``None`` -> ``()``; one id -> ``(id,)``; an iterable -> a tuple of ints."""
    if stop_token_ids is None:
        return ()
    if isinstance(stop_token_ids, int):
        return (int(stop_token_ids),)
    return tuple(int(t) for t in stop_token_ids)


@dataclass(frozen=True)
class ARSpecConfig:
    """How :func:`spiffy.arspec.speculative_generate` decodes.

    Attributes:
        method: a name of :data:`spiffy.arspec.methods.METHODS` (what it drafts: :attr:`spec`).
        budget: tree methods (``ddtree``, ``ddtree-dllm``): draft-tree nodes verified per round (root excluded);
            ``0`` = no drafts.
        chain_length: chain methods (``dflash``, ``deer``, ``specdiff``): drafted tokens per draft and round;
            ``None`` = ``block_size - 1`` (a whole block); ``0`` = no drafts.
        drafts: ``specdiff`` only: joint drafts sampled per round (``K``; ``0`` = no drafts).
        accept: the acceptance rule, a name of :data:`spiffy.arspec.methods.ACCEPT_RULES`.
        max_new_tokens: hard cap on generated tokens.
        stop_token_ids: generation ends right after the first generated one of these (it is kept in the output).
        block_size: drafted block length including the root (bonus) token; ``None`` = the drafter's own.
        sampling: the target's decoding rule (temperature, top-p, top-k, seed; ``seed=None`` means 0; "off" is
            ``top_p=1.0`` / ``top_k=0`` as everywhere in :class:`~spiffy.sampling.SamplingConfig`). Every method
            draws the token at absolute position ``p`` with noise keyed by ``(seed, p)``.
    """

    method: str = DEFAULT_METHOD.name
    budget: int = DEFAULT_BUDGET
    chain_length: int | None = None
    drafts: int = DEFAULT_DRAFTS
    accept: str = DEFAULT_ACCEPT
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        spec = get_method(self.method)
        object.__setattr__(self, "method", spec.name)
        if int(self.budget) < 0:
            raise ConfigError(f"budget must be >= 0, got {self.budget}; fix: pass a node budget such as "
                              f"{DEFAULT_BUDGET} (0 = no drafts)")
        if self.chain_length is not None and int(self.chain_length) < 0:
            raise ConfigError(f"chain_length must be >= 0, got {self.chain_length}; fix: pass None for a whole block")
        if int(self.drafts) < 0:
            raise ConfigError(f"drafts must be >= 0, got {self.drafts}; fix: pass --drafts K with K >= 1 (e.g. 4)")
        if get_accept(self.accept).name not in spec.accepts:
            raise ConfigError(f"method {spec.name} does not take the {self.accept} rule; fix: use one of "
                              f"{', '.join(spec.accepts)}")
        if int(self.max_new_tokens) < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.block_size is not None and int(self.block_size) < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a spiffy.sampling.SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "stop_token_ids", stop_id_tuple(self.stop_token_ids))

    def block_for(self, drafter: Any) -> int:
        """The drafted block length (root included) this config runs with ``drafter``: 1 for a method without a
        drafter (plain AR), else
        ``block_size`` or the drafter's own ``block_size``.

        Raises:
            ConfigError: ``block_size`` exceeds the drafter's block (it drafts at most ``its block - 1`` positions
                per round, so the deeper ones would have no distribution).
        """
        if not self.spec.needs_drafter:
            return 1
        own = getattr(drafter, "block_size", None)
        if self.block_size is None:
            if own is None:
                raise ConfigError(
                    f"the drafter {type(drafter).__name__} has no block_size and the config gives none; "
                    "fix: pass ARSpecConfig(block_size=N)"
                )
            return int(own)
        if own is not None and int(self.block_size) > int(own):
            raise ConfigError(
                f"block_size={self.block_size} exceeds the drafter's block of {int(own)} (it drafts at most "
                f"{int(own) - 1} positions per round); fix: pass block_size <= {int(own)} (or None for the "
                f"drafter's own), or wrap the drafter model with that block: DFlashDrafter(model, "
                f"block_size={self.block_size})"
            )
        return int(self.block_size)

    @property
    def spec(self) -> Method:
        """The method object :attr:`method` names (:mod:`spiffy.arspec.methods`)."""
        return get_method(self.method)

    @property
    def uses_drafter(self) -> bool:
        """Whether any round drafts (a zero budget, chain length or draft count runs as plain AR)."""
        return self.spec.drafts(self)

    def draft_depth(self, block: int) -> int:
        """Deepest drafted position per round for a block of ``block`` tokens (before the ``max_new_tokens`` cap)."""
        return self.spec.draft_depth(self, block)

    def draft_nodes(self, block: int) -> int:
        """Draft nodes per round as results report them (``ARGenerationResult.budget``): the budget of a tree
        method, the chain length (times the number of drafts for specdiff: an upper bound), 0 for AR."""
        return self.spec.draft_nodes(self, block)

    @property
    def samples_drafts(self) -> bool:
        """Whether draft tokens are sampled from the drafter (specdiff always; the chain methods under the
        rejection rule at T > 0, where sampling from ``q`` is what makes ``min(1, p/q)`` the acceptance)."""
        return self.spec.samples(self)
