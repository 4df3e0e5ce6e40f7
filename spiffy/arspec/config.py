"""One configuration object for AR speculative generation (method, draft sizes, limits, sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from spiffy.errors import ConfigError
from spiffy.sampling import SamplingConfig

__all__ = ["ARSpecConfig", "ACCEPT_RULES", "CHAIN_METHODS", "METHODS", "METHOD_LABELS", "DEFAULT_TREE_BUDGET", "stop_id_tuple"]

#: ``ddtree``: the optimal draft tree; ``dflash``: the chain of the drafter's argmaxes (DFlash paper); ``deer``: the
#: same chain, from a dLLM drafter (DEER paper; sampled from the drafter under the rejection rule at T > 0);
#: ``specdiff``: ``drafts`` joint drafts sampled from the drafter's position-wise marginals, verified together as
#: one tree (SpecDiff-2 self-selection); ``ar``: no drafts
METHODS: tuple[str, ...] = ("ddtree", "dflash", "deer", "specdiff", "ar")
#: how reports and tables name each method (the papers' spellings)
METHOD_LABELS: dict[str, str] = {"ddtree": "DDTree", "dflash": "DFlash", "deer": "DEER", "specdiff": "SpecDiff-2", "ar": "AR"}
#: methods that verify one chain per round
CHAIN_METHODS: tuple[str, ...] = ("dflash", "deer")
#: ``coupled``: position-keyed coupling (equal to AR token for token); ``rejection``: speculative sampling
#: (min(1, p/q) and the residual; equal to AR in distribution)
ACCEPT_RULES: tuple[str, ...] = ("coupled", "rejection")
#: DDTree nodes per round (root excluded) when none is given
DEFAULT_TREE_BUDGET = 64


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
        method: one of :data:`METHODS`.
        tree_budget: ``ddtree`` only: draft-tree nodes verified per round (root excluded); ``0`` = no drafts.
        chain_length: ``dflash``, ``deer``, ``specdiff``: drafted tokens per draft and round; ``None`` =
            ``block_size - 1`` (a whole block); ``0`` = no drafts.
        drafts: ``specdiff`` only: joint drafts sampled per round (``K``; ``0`` = no drafts).
        accept: the acceptance rule, one of :data:`ACCEPT_RULES`.
        max_new_tokens: hard cap on generated tokens.
        stop_token_ids: generation ends right after the first generated one of these (it is kept in the output).
        block_size: drafted block length including the root (bonus) token; ``None`` = the drafter's own.
        sampling: the target's decoding rule (temperature, top-p, top-k, seed; ``seed=None`` means 0). Every method
            draws the token at absolute position ``p`` with noise keyed by ``(seed, p)``.
    """

    method: str = "ddtree"
    tree_budget: int = DEFAULT_TREE_BUDGET
    chain_length: int | None = None
    drafts: int = 1
    accept: str = "coupled"
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; fix: use one of {', '.join(METHODS)}")
        if int(self.tree_budget) < 0:
            raise ConfigError(
                f"tree budget must be >= 0, got {self.tree_budget}; fix: pass a node budget such as 64 (0 = no drafts)"
            )
        if self.chain_length is not None and int(self.chain_length) < 0:
            raise ConfigError(f"chain_length must be >= 0, got {self.chain_length}; fix: pass None for a whole block")
        if int(self.drafts) < 0:
            raise ConfigError(f"drafts must be >= 0, got {self.drafts}; fix: pass --drafts K with K >= 1 (e.g. 4)")
        if self.accept not in ACCEPT_RULES:
            raise ConfigError(f"unknown acceptance rule {self.accept!r}; fix: use one of {', '.join(ACCEPT_RULES)}")
        if int(self.max_new_tokens) < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.block_size is not None and int(self.block_size) < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a spiffy.sampling.SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "stop_token_ids", stop_id_tuple(self.stop_token_ids))

    def block_for(self, drafter: Any) -> int:
        """The drafted block length (root included) this config runs with ``drafter``: 1 for ``ar``, else
        ``block_size`` or the drafter's own ``block_size``.

        Raises:
            ConfigError: ``block_size`` exceeds the drafter's block (it drafts at most ``its block - 1`` positions
                per round, so the deeper ones would have no distribution).
        """
        if self.method == "ar":
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
    def uses_drafter(self) -> bool:
        """Whether any round drafts (DDTree with budget 0 and a chain of length 0 run as plain AR)."""
        if self.method == "ddtree":
            return int(self.tree_budget) > 0
        if self.method == "specdiff" and int(self.drafts) == 0:
            return False
        if self.method in CHAIN_METHODS or self.method == "specdiff":
            return self.chain_length is None or int(self.chain_length) > 0
        return False

    def draft_depth(self, block: int) -> int:
        """Deepest drafted position per round for a block of ``block`` tokens (before the ``max_new_tokens`` cap)."""
        if not self.uses_drafter:
            return 0
        depth = block - 1
        if self.method != "ddtree" and self.chain_length is not None:
            depth = min(depth, int(self.chain_length))
        return depth

    def reported_budget(self, block: int) -> int:
        """Draft nodes per round as reported in results: the tree budget, the chain length (times the number of
        drafts for specdiff: an upper bound, common prefixes are merged), or 0 for AR."""
        if self.method == "ddtree":
            return int(self.tree_budget)
        if self.method in CHAIN_METHODS or self.method == "specdiff":
            length = self.draft_depth(block) if self.chain_length is not None else block - 1
            return length * (int(self.drafts) if self.method == "specdiff" else 1)
        return 0

    @property
    def samples_drafts(self) -> bool:
        """Whether draft tokens are sampled from the drafter (specdiff always; the chain methods under the
        rejection rule at T > 0, where sampling from ``q`` is what makes ``min(1, p/q)`` the acceptance)."""
        if self.method == "specdiff":
            return True
        return self.method in CHAIN_METHODS and self.accept == "rejection" and float(self.sampling.temperature) > 0
