"""Every AR speculative method and acceptance rule as an object, in one registry (the only place that knows them
by name).

A method says what it is made of: the drafter kind it is defined with (:class:`DrafterKind`, with its capabilities:
whether it reads the target's hidden features, whether rows sharing one drafter model propose in one forward), the
shape of its draft (``none`` / ``chain`` / ``tree``), which knob of :class:`~spiffy.arspec.ARSpecConfig` sizes the
draft, which acceptance rules apply, and how one round's draft structure is built from the drafter's logits
(:meth:`Method.build_tree`). An acceptance rule is an :class:`AcceptSpec`: its rule class and what it guarantees.

Adding a method = one :class:`Method` subclass (or instance) plus one entry in :data:`REGISTRY`; adding an acceptance
rule = one class with the :class:`~spiffy.arspec.rules.AcceptanceRule` signature plus one entry in
:data:`ACCEPT_RULES`. :func:`get_method` and :func:`make_rule` are the factories; every other module (the
generation loop, the command line, the benchmarks) asks these objects instead of comparing names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.rules import AcceptanceRule, CoupledRule
from spiffy.arspec.sampling import tempered
from spiffy.arspec.selector import Draft, SelectorDraft
from spiffy.arspec.selfselect import build_sampled_tree, proposal_probs, sample_drafts
from spiffy.arspec.tree import DraftTree, build_chain, build_ddtree, empty_tree
from spiffy.errors import ConfigError
from spiffy.sampling import SamplingConfig

__all__ = [
    "ACCEPT_RULES",
    "AR",
    "AcceptSpec",
    "CHAIN_BASELINE",
    "DEFAULT_ACCEPT",
    "DEFAULT_METHOD",
    "DDTREE_DLLM",
    "DEER",
    "SPECDIFF",
    "DDTREE",
    "DDTREE_DFLASH2",
    "DFLASH",
    "DFLASH2",
    "DFLASH2_DRAFTER",
    "DFLASH_DRAFTER",
    "DLLM_DRAFTER",
    "DraftKnobs",
    "DrafterKind",
    "METHODS",
    "Method",
    "REGISTRY",
    "get_accept",
    "get_method",
    "make_rule",
    "methods_help",
]


class DraftKnobs(Protocol):
    """The settings a method reads (:class:`~spiffy.arspec.ARSpecConfig` has them all)."""

    budget: int
    chain_length: int | None
    drafts: int
    accept: str
    sampling: SamplingConfig


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter checkpoint (``name`` as :data:`spiffy.models.ar_drafters.DRAFTER_KINDS` spells it).

    Attributes:
        label: how tables name it.
        needs_target_features: the drafter reads hidden states of target layers (forward hooks on the target).
        proposes_batch: rows whose drafters share one model propose in one drafter forward.
        embedded: the embedded checkpoint of this kind (:func:`spiffy.embedded.embedded_model_path`; ``None``: none
            is shipped).
        help: one line for help texts.
    """

    name: str
    label: str
    needs_target_features: bool
    proposes_batch: bool
    embedded: str | None
    help: str


DFLASH_DRAFTER = DrafterKind("dflash", "DFlash", True, True, "ar-drafter",
                             "a DFlash drafter reading the target's hidden states")
DFLASH2_DRAFTER = DrafterKind("dflash2", "DFlash2", True, True, None,
                              "a DFlash2 drafter (DFlash with convolutions and a candidate selector)")
DLLM_DRAFTER = DrafterKind("dllm", "dLLM", False, True, "ar-dllm-drafter",
                           "a diffusion LM sharing the target's tokenizer, conditioned on the committed tokens")


@dataclass(frozen=True)
class AcceptSpec:
    """An acceptance rule: ``rule(sampling)`` builds it.

    Attributes:
        exact_tokens: the output is plain AR's token for token for a seed (otherwise equal in distribution only,
            at ``T > 0``; at ``T = 0`` every rule is the greedy walk).
        samples_from_drafter: at ``T > 0`` the rule needs drafts that are draws from the drafter's distribution
            ``q`` (speculative sampling's ``min(1, p/q)``), so chains sample instead of taking argmaxes.
    """

    name: str
    rule: Callable[[SamplingConfig], AcceptanceRule]
    exact_tokens: bool
    samples_from_drafter: bool
    help: str


#: the acceptance rules by name, the default first
ACCEPT_RULES: dict[str, AcceptSpec] = {
    "coupled": AcceptSpec("coupled", CoupledRule, True, False,
                          "position-keyed coupling: equal to AR token for token"),
    "rejection": AcceptSpec("rejection", RejectionRule, False, True,
                            "speculative sampling min(1, p/q) and the residual: equal to AR in distribution"),
}
#: the acceptance rule used when none is named
DEFAULT_ACCEPT: str = next(iter(ACCEPT_RULES))


def get_accept(name: str) -> AcceptSpec:
    """The acceptance rule called ``name`` (ConfigError naming the choices otherwise)."""
    spec = ACCEPT_RULES.get(name)
    if spec is None:
        raise ConfigError(f"unknown acceptance rule {name!r}; fix: use one of {', '.join(ACCEPT_RULES)}")
    return spec


def make_rule(config: DraftKnobs) -> AcceptanceRule:
    """The acceptance rule ``config.accept`` names, for ``config.sampling``."""
    return get_accept(config.accept).rule(config.sampling)


@dataclass(frozen=True)
class Method:
    """A speculative method for AR targets (this base class is plain AR: no drafter, no drafts).

    Attributes:
        name: the registry key (command-line ``--method``, ``ARSpecConfig.method``, result ``method``).
        label: how reports and tables name it (the papers' spellings).
        help: one line for help texts.
        drafter: the drafter kind the method is defined with (``None``: none); front ends load and embed this
            kind, while the generation loop accepts any :class:`~spiffy.arspec.Drafter`.
        shape: the draft of a round: ``"none"``, ``"chain"`` or ``"tree"``.
        size_knob: the :class:`~spiffy.arspec.ARSpecConfig` field that sizes the draft across runs (``"budget"``,
            ``"drafts"``) or ``None`` (a chain's length follows the drafter's block).
        accepts: the acceptance rules that apply.
    """

    name: str
    label: str
    help: str
    drafter: DrafterKind | None = None
    shape: str = "none"
    size_knob: str | None = None
    accepts: tuple[str, ...] = tuple(ACCEPT_RULES)

    @property
    def needs_drafter(self) -> bool:
        return self.drafter is not None

    def drafts(self, config: DraftKnobs) -> bool:
        """Whether any round drafts under ``config`` (a zero budget or length runs as plain AR)."""
        return False

    def draft_depth(self, config: DraftKnobs, block: int) -> int:
        """Deepest drafted position per round for a block of ``block`` tokens (before the ``max_new_tokens`` cap)."""
        return 0

    def draft_nodes(self, config: DraftKnobs, block: int) -> int:
        """Draft nodes per round as results report them (``ARGenerationResult.budget``)."""
        return 0

    def samples(self, config: DraftKnobs) -> bool:
        """Whether draft tokens are sampled from the drafter (rather than chosen by rank)."""
        return False

    def build_tree(self, config: DraftKnobs, draft_logits: Draft | None, root_position: int) -> DraftTree:
        """The draft structure of one round from the drafter's ``[L, V]`` logits, or from a DFlash2 selector's
        :class:`~spiffy.arspec.selector.SelectorDraft` (``None``: an empty tree)."""
        return empty_tree()


@dataclass(frozen=True)
class Chain(Method):
    """One drafted token per depth: the drafter's argmax (DFlash, DEER), or one draft sampled from the drafter
    when the acceptance rule needs draws from ``q`` at ``T > 0``."""

    shape: str = "chain"

    def drafts(self, config: DraftKnobs) -> bool:
        return config.chain_length is None or int(config.chain_length) > 0

    def draft_depth(self, config: DraftKnobs, block: int) -> int:
        if not self.drafts(config):
            return 0
        depth = block - 1
        return depth if config.chain_length is None else min(depth, int(config.chain_length))

    def draft_nodes(self, config: DraftKnobs, block: int) -> int:
        return self.draft_depth(config, block) if config.chain_length is not None else block - 1

    def samples(self, config: DraftKnobs) -> bool:
        return get_accept(config.accept).samples_from_drafter and not config.sampling.greedy

    def sample_count(self, config: DraftKnobs) -> int:
        return 1

    def build_tree(self, config: DraftKnobs, draft_logits: Draft | None, root_position: int) -> DraftTree:
        if draft_logits is None:
            return empty_tree()
        if isinstance(draft_logits, SelectorDraft):  # the selector's own chain, or drafts walked through it
            if self.samples(config):
                return draft_logits.sample_tree(self.sample_count(config), config.sampling, root_position)
            return draft_logits.chain()
        if self.samples(config):
            probs = proposal_probs(draft_logits, config.sampling)
            draws = sample_drafts(probs, self.sample_count(config), config.sampling, root_position)
            return build_sampled_tree(probs, draws)
        return build_chain(draft_logits)


@dataclass(frozen=True)
class SampledDrafts(Chain):
    """SpecDiff-2: ``drafts`` joint drafts sampled from the drafter's position-wise marginals, merged into one tree
    (:mod:`spiffy.arspec.selfselect`; the draws are keyed by the root position)."""

    shape: str = "tree"
    size_knob: str | None = "drafts"

    def drafts(self, config: DraftKnobs) -> bool:
        return int(config.drafts) > 0 and super().drafts(config)

    def draft_nodes(self, config: DraftKnobs, block: int) -> int:
        """The chain length times the number of drafts: an upper bound (common prefixes are merged)."""
        return super().draft_nodes(config, block) * int(config.drafts)

    def samples(self, config: DraftKnobs) -> bool:
        return True

    def sample_count(self, config: DraftKnobs) -> int:
        return int(config.drafts)


@dataclass(frozen=True)
class BestTree(Method):
    """DDTree: the optimal ``budget``-node tree of the drafter's distribution at the sampling temperature
    (:func:`~spiffy.arspec.tree.build_ddtree` over :func:`~spiffy.arspec.sampling.tempered` log-probabilities)."""

    shape: str = "tree"
    size_knob: str | None = "budget"

    def drafts(self, config: DraftKnobs) -> bool:
        return int(config.budget) > 0

    def draft_depth(self, config: DraftKnobs, block: int) -> int:
        return block - 1 if self.drafts(config) else 0

    def draft_nodes(self, config: DraftKnobs, block: int) -> int:
        return int(config.budget)

    def build_tree(self, config: DraftKnobs, draft_logits: Draft | None, root_position: int) -> DraftTree:
        if draft_logits is None:
            return empty_tree()
        if isinstance(draft_logits, SelectorDraft):  # ranked by the selector's transitions from each node's token
            return draft_logits.best_tree(int(config.budget), float(config.sampling.temperature))
        scores = tempered(draft_logits, float(config.sampling.temperature))
        return build_ddtree(torch.log_softmax(scores, dim=-1), int(config.budget))


AR = Method("ar", "AR", "plain autoregressive decoding: one token per target forward, no drafter")
DFLASH = Chain("dflash", "DFlash", "the chain of the DFlash drafter's argmaxes, one per block position",
               drafter=DFLASH_DRAFTER)
DDTREE = BestTree("ddtree", "DDTree", "the optimal draft tree of --budget nodes from the DFlash drafter",
                  drafter=DFLASH_DRAFTER)
DFLASH2 = Chain("dflash2", "DFlash2", "the chain a DFlash2 drafter's candidate selector picks left to right from the "
                "root (drafts walked through its proposal under the rejection rule at T > 0)", drafter=DFLASH2_DRAFTER)
DDTREE_DFLASH2 = BestTree("ddtree-dflash2", "DDTree", "the optimal draft tree of --budget nodes over a DFlash2 "
                          "drafter's candidates, each node's children ranked by the selector given its token",
                          drafter=DFLASH2_DRAFTER)
DDTREE_DLLM = BestTree("ddtree-dllm", "DDTree", "the optimal draft tree of --budget nodes from a dLLM drafter's "
                       "per-position distributions", drafter=DLLM_DRAFTER)
DEER = Chain("deer", "DEER", "the chain from a dLLM drafter (sampled from it under the rejection rule at T > 0)",
             drafter=DLLM_DRAFTER)
SPECDIFF = SampledDrafts("specdiff", "SpecDiff-2", "--drafts K joint drafts sampled from a dLLM drafter, verified "
                         "together as one tree", drafter=DLLM_DRAFTER)

#: every method by name, in the order reports list them
REGISTRY: dict[str, Method] = {m.name: m for m in (AR, DFLASH, DDTREE, DFLASH2, DDTREE_DFLASH2, DDTREE_DLLM, DEER,
                                                   SPECDIFF)}
#: the method names
METHODS: tuple[str, ...] = tuple(REGISTRY)
#: the chain method that ``speedup_vs_dflash`` compares against
CHAIN_BASELINE = DFLASH
#: the method run when none is named (with a drafter; without one: :data:`AR`)
DEFAULT_METHOD = DDTREE


def get_method(name: str | Method) -> Method:
    """The method called ``name`` (a :class:`Method` is returned as is; ConfigError naming the choices otherwise)."""
    if isinstance(name, Method):
        return name
    method = REGISTRY.get(name)
    if method is None:
        raise ConfigError(f"unknown method {name!r}; fix: use one of {', '.join(METHODS)}")
    return method


def methods_help() -> str:
    """One help line listing every method: ``name (help)``."""
    return "; ".join(f"{m.name}: {m.help}" for m in REGISTRY.values())
