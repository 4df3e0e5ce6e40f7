"""Speculative decoding for autoregressive targets (SPEC §7): drafter and acceptance-rule interfaces, the stages of
a round, the DDTree tree builder and the generation loop. Holds no model (those are in :mod:`spiffy.models`) and no
command line (:mod:`spiffy.cli`).

Public API::

    from spiffy.arspec import ddtree_generate
    from spiffy.models import load_drafter
    drafter = load_drafter("path/to/Qwen3-8B-DFlash-b16", dtype="bf16", device="cuda")
    res = ddtree_generate(target, drafter, input_ids, method="ddtree", budget=256, max_new_tokens=512)
    res.tokens, res.tau, res.stage_times

or, with any :class:`Drafter` and :class:`AcceptanceRule`::

    cfg = ARSpecConfig(method="ddtree", budget=256, max_new_tokens=512, sampling=SamplingConfig(temperature=1.0, seed=0))
    res = speculative_generate(target, DFlashDrafter(drafter), input_ids, cfg, rule=CoupledRule(cfg.sampling))

Batches are the implementation: ``ddtree_generate_batch(target, drafter, [ids_a, ids_b, ...], seed=[...])`` (one
target forward per round for every row; row ``b`` equals ``ddtree_generate`` of prompt ``b`` alone, which is a
batch of one).

The methods are objects in one registry (:mod:`spiffy.arspec.methods`: ``REGISTRY``, ``get_method``):
``method="dflash"`` is the vanilla DFlash chain and ``method="ar"`` plain AR decoding, on the same code path.
A standalone diffusion LM drafts too (:class:`DLLMDrafter`; ``load_ar_drafter`` + :func:`as_drafter` pick the kind
from the checkpoint): ``method="deer"`` (its chain) and ``method="specdiff"`` (``drafts`` sampled joint drafts as
one tree); a DFlash2 drafter (:class:`DFlash2Drafter`) drafts with its candidate selector: ``method="dflash2"``
(the selector's chain) and ``method="ddtree-dflash2"`` (DDTree over its candidates); ``accept="rejection"`` switches to speculative sampling (:class:`RejectionRule`)::

    drafter = as_drafter(load_ar_drafter("path/to/sdar-drafter", dtype="float32"))
    cfg = ARSpecConfig(method="specdiff", drafts=4, accept="rejection", sampling=SamplingConfig(temperature=1.0, seed=0))
    res = speculative_generate(target, drafter, input_ids, cfg)
"""

from __future__ import annotations

from spiffy.arspec.batch import ddtree_generate_batch, speculative_generate_batch
from spiffy.arspec.config import DEFAULT_BUDGET, ARSpecConfig
from spiffy.arspec.dllm_drafter import DLLMDrafter, as_drafter
from spiffy.arspec.drafter import BatchDrafter, ContextUpdate, DFlash2Drafter, DFlashDrafter, Drafter
from spiffy.arspec.generate import ddtree_generate, speculative_generate
from spiffy.arspec.methods import ACCEPT_RULES, METHODS, REGISTRY, AcceptSpec, DrafterKind, Method, get_method, make_rule
from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.result import ARGenerationResult
from spiffy.arspec.rules import Acceptance, AcceptanceRule, CoupledRule, TargetLogits
from spiffy.arspec.selector import SelectorDraft
from spiffy.arspec.sampling import sample_keyed, sample_tokens
from spiffy.arspec.stages import STAGES
from spiffy.arspec.tree import DraftTree, build_chain, build_ddtree, empty_tree
from spiffy.sampling import SamplingConfig

__all__ = [
    "ACCEPT_RULES",
    "ARGenerationResult",
    "ARSpecConfig",
    "AcceptSpec",
    "Acceptance",
    "AcceptanceRule",
    "BatchDrafter",
    "ContextUpdate",
    "CoupledRule",
    "DEFAULT_BUDGET",
    "DFlash2Drafter",
    "DFlashDrafter",
    "DLLMDrafter",
    "DraftTree",
    "Drafter",
    "DrafterKind",
    "METHODS",
    "Method",
    "REGISTRY",
    "RejectionRule",
    "STAGES",
    "SamplingConfig",
    "SelectorDraft",
    "TargetLogits",
    "as_drafter",
    "build_chain",
    "build_ddtree",
    "ddtree_generate",
    "ddtree_generate_batch",
    "empty_tree",
    "get_method",
    "make_rule",
    "sample_keyed",
    "sample_tokens",
    "speculative_generate",
    "speculative_generate_batch",
]
