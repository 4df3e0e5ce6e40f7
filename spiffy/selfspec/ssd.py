"""SSD (Self Speculative Decoding for diffusion LLMs, arXiv 2510.04147) expressed as a Spiffy draft graph.

SSD (Gao, Ji, Wang, Qi, Xu, Zhang, 2025; no public code) makes the dLLM its own drafter and verifier:

* **Self-drafting.** The forward that decides the current step already predicts a token (the argmax) and a confidence
  for every masked position of the block. SSD keeps the ``N`` most confident of the positions the step leaves
  masked, with their argmax tokens, as the drafts of the next ``N`` steps of *stepwise* decoding (one token per
  step): the ``d``-th most confident draft is the token stepwise decoding is predicted to unmask ``d`` steps ahead.
  No extra model call, no auxiliary drafter.
* **Hierarchical verification tree.** Node ``d`` (depth ``d = 1..N``) is the current state plus the first ``d``
  drafts, in confidence order; node ``d`` is node ``d - 1`` plus one token, so the tree is a path of ``N`` nodes
  below the real state. A node is checked only after its parent passed: it counts when stepwise decoding, applied
  to its parent with the parent's own logits, produces exactly its state.
* **One batched forward.** The real state and all ``N`` nodes are the ``N + 1`` rows of one forward; from their
  logits the verification walks down the tree and keeps the deepest node whose every ancestor passed. One forward
  thus advances at most ``N + 1`` steps (the ``N`` nodes plus the step taken on the deepest accepted node's logits).
* **Lossless.** Every row's logits are what the model computes on that exact state, and a node is used only when
  stepwise decoding reaches exactly its state, so the states, and the output, are stepwise decoding's.

In Spiffy's (i, j) format (:mod:`spiffy.selfspec.formulas`: positions ranked by the confidence of the distribution
``P`` that produced the current state, ties the baseline's own way) SSD's tree with ``K`` states per forward is the
graph with one node per level::

    level d = {(1, 1), (2, 1), ..., (d * S, 1)}        d = 1 .. K - 1

run at budget ``K - 1`` (every node verified every forward), on the runtime of :mod:`spiffy.selfspec.runtime`: one
forward for the real state and every node, computed exactly as the baseline computes it, then the baseline's own
transition; a node is used only when the transition produces exactly its state.

Sources and what is assumed. The paper's text beyond its abstract could not be read here. What is stated above
comes from: the abstract (arXiv 2510.04147: self-drafting "for multiple positions", "hierarchical verification trees
in a single forward pass", "progressively verify and accept multiple tokens", output identical to stepwise decoding,
up to 3.46x on LLaDA and Dream); the paper's TL;DR on sciencestack.ai ("self-drafting for multiple masked positions
in parallel", "verifies drafts through a hierarchical tree within a single forward pass", "trade-offs between
verification-tree size and speed"); a Chinese summary of the method (blog.youkuaiyun.com, c_cpp_csharp, article
154016808, a CSDN mirror: candidate tokens and confidences for several positions from the model itself; a
verification tree whose child is verified only after its parent passed, "consistent with stepwise decoding"; all
nodes batched in one forward; at most ``N + 1`` tokens per iteration for a draft length ``N``); and PSD (arXiv
2605.15609), a follow-up that describes the same structure as "multi-depth speculative drafts" with "hierarchical
acceptance, keeping the deepest draft that remains consistent". Assumptions, labelled:

* **(A1) the tree is a path.** Each level adds the next draft; no level holds alternatives. A branching tree would
  need a rule for choosing the branches that none of the sources gives; if the paper's tree branches, this is not
  it.
* **(A2) the drafts are the top-confidence positions with their argmax tokens, in confidence order** (the sources
  say "confidence scores" and "stepwise decoding"; stepwise low-confidence decoding unmasks the most confident
  position next). Ties fall as the baseline's own ``torch.topk`` breaks them, as for every Spiffy graph.
* **(A3) beyond stepwise decoding** (the only setting the sources name): under a uniform static schedule of ``S``
  tokens per step each level adds the next ``S`` drafts (one level = one step); under a non-uniform schedule (Dream's,
  or a block length that is not a multiple of the steps per block) and under threshold decoding each level adds
  one draft.
* **(A4) inside the current block**, at equal states per forward ``K`` = the real state plus ``K - 1`` nodes (the
  batch of ``N + 1`` rows above, ``N = K - 1``).

Consequence: under these assumptions SSD drafts exactly the states of FreeDave (arXiv 2510.00294, the top-k chain
of :mod:`spiffy.selfspec.freedave`) at the same width, so on the same exact runtime the two spend the same forwards
on every prompt; the papers differ in what lies outside the draft states (FreeDave's official code takes draft
``k``'s positions from one ``torch.topk(k)`` call and drafts into later blocks; SSD's experiments run on the
authors' approximate caches). :func:`ssd_graph` builds its own graph, recorded as ``method: "ssd"`` and tuned for
its width, from the same formulas (:func:`~spiffy.selfspec.freedave.chain_formulas`: one home for the path).
"""

from __future__ import annotations

from typing import Any

from spiffy.selfspec.freedave import chain_graph_for, parse_width
from spiffy.selfspec.graph import DraftGraph

#: how an SSD comparison is named on the command line: ``ssd:K`` (K states per verification forward)
SSD_PREFIX = "ssd:"


def ssd_graph(model: Any, config: Any, states_per_forward: int, **overrides: Any) -> DraftGraph:
    """SSD's verification tree with ``states_per_forward`` (``K``) states per forward as a draft graph: the path of
    ``K - 1`` self-drafted nodes below the real state (see the module docstring), tuned for budget ``K - 1`` so the
    runtime verifies the whole tree every forward.

    Args:
        model: the loaded diffusion LM; config: its :class:`~spiffy.decoding.DecodeConfig`.
        states_per_forward: ``K >= 2`` (an int, ``"K"`` or ``"ssd:K"``).
        overrides: family options such as SDAR ``strategy``, as passed to ``generate``.
    Raises:
        ConfigError: ``K < 2`` or not an integer.
    """
    k = parse_ssd_states(states_per_forward)
    return chain_graph_for(model, config, k - 1, method="ssd", budget=k - 1,
                           note="SSD's verification tree (arXiv 2510.04147): level d adds the d-th most confident "
                                "masked position with its argmax token, verified in one forward", **overrides)


def parse_ssd_states(value: Any) -> int:
    """SSD's states per forward ``K`` (``>= 2``) from an int, ``"K"`` or ``"ssd:K"``."""
    return parse_width(value, SSD_PREFIX, "SSD")


def is_ssd_spec(value: Any) -> bool:
    """Whether a ``--graph`` value names SSD (``ssd:K``) rather than a file."""
    return isinstance(value, str) and value.startswith(SSD_PREFIX)


__all__ = ["SSD_PREFIX", "ssd_graph", "parse_ssd_states", "is_ssd_spec"]
