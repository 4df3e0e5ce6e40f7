"""Sampled drafts: the DEER chain under speculative sampling and SpecDiff-2's K joint drafts as one tree.

A dLLM drafter gives, in one pass, position-wise marginals ``q_d`` for the next ``D`` positions. A *joint draft* is
one token per depth, each drawn independently from its ``q_d`` (SpecDiff-2 §3). :func:`build_sampled_tree` draws
``K`` of them and merges their common prefixes into one :class:`~spiffy.arspec.tree.DraftTree`, which the target
verifies in ONE forward (tree attention). The tree records, below each node, the draws in draft order with
duplicates (``DraftTree.samples``) and the distributions they came from (``DraftTree.proposal``).

**Selection, and why it is exact.** SpecDiff-2 has the verifier score each draft's expected accepted streak
(:func:`expected_streaks`: ``sum_j prod_{i<=j} min(1, p_i / q_i)``) and then runs speculative sampling on the best
draft. Choosing the draft with the verifier's probabilities *before* the accept/reject coins biases the output:
the chosen token at a position is no longer a draw from ``q`` but from a ``p``-tilted selection of ``K`` draws,
so ``min(1, p/q)`` with the residual ``max(0, p - q)`` no longer reproduces ``p`` (the statistical test in
``tests/test_arspec_rejection.py`` keeps such a variant and shows it fails). Here the selection *is* the
acceptance walk:

* rejection rule (:class:`~spiffy.arspec.rejection.RejectionRule`): recursive rejection sampling over the children
  of each node (SpecInfer's multi-draft speculative sampling): the draws below a node are tried in draft order,
  accepting draw ``x`` with ``min(1, r(x) / q(x))`` and otherwise replacing ``r`` by ``norm(max(0, r - q))``. This
  is exact because the draws below a node are i.i.d. from one fixed ``q_d`` given everything decided above them
  (the marginals do not depend on the drafted prefix, and which drafts pass through a node depends only on shallower
  draws), and the draft order is fixed before the target is consulted. The accepted path ends inside one draft's
  branch: that draft is the selected one, and the walk picks the longest accepted streak among all ``K`` drafts
  that the coins allow.
* coupled rule: the target's position-keyed sample decides every position (the tree only offers candidates), so the
  output equals AR decoding token for token whatever drafts are offered; the selected draft is the one agreeing
  with the target longest.

Randomness is keyed: the draws of a round are inverse-CDF draws (:func:`~spiffy.arspec.sampling.inverse_cdf`) with
host uniforms from a generator seeded by ``(seed, root position)`` on a stream of their own
(:func:`~spiffy.arspec.sampling.keyed_uniforms`), so a run is reproducible for a seed and independent of the target's
acceptance coins. The uniforms are made on the host and copied without waiting, and the draw is a tensor program on
the proposal's device: sampling reads nothing back, so the captured path can draw on the device
(:func:`~spiffy.arspec.device_draws.sampled_tree_device` builds this module's tree there).
"""

from __future__ import annotations

import math

import torch

from spiffy.arspec.device_rejection import target_probs_rows
from spiffy.arspec.rules import TargetLogits
from spiffy.arspec.sampling import inverse_cdf, keyed_seed, keyed_uniforms, position_key, tempered
from spiffy.arspec.tree import DraftTree, empty_tree
from spiffy.sampling import SamplingConfig, filter_logits
from spiffy.torch_utils import on_device

__all__ = [
    "DRAFT_STREAM",
    "draft_paths",
    "draft_temperature",
    "draft_uniforms",
    "drafts_from_uniforms",
    "expected_streaks",
    "proposal_probs",
    "sample_drafts",
    "build_sampled_tree",
    "target_probs",
]

#: stream tag mixed into the seed of the draft draws (keeps them apart from the acceptance coins)
DRAFT_STREAM = 0x5D2AF7


def draft_temperature(sampling: SamplingConfig) -> float:
    """Temperature drafts are sampled at: the target's, or 1 for a greedy target (a greedy rule accepts any draft
    that matches the argmax, so the drafts only need to be diverse)."""
    t = float(sampling.temperature)
    return t if t > 0 else 1.0


def proposal_probs(draft_logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[D, V]`` float64 probabilities drafts are sampled from, on the drafter's device (kept there so the draws
    need no host read): the drafter's logits at :func:`draft_temperature`, filtered by the target's top-k / top-p (so
    ``q`` covers what ``p`` can emit)."""
    scores = filter_logits(
        tempered(draft_logits.double(), draft_temperature(sampling)), int(sampling.top_k), float(sampling.top_p),
        nucleus="reaches",
    )
    return torch.softmax(scores, dim=-1)


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[V]`` float64 CPU probabilities the target samples from at ``T > 0`` (``logits``: ``[1, V]`` or ``[V]``):
    :func:`~spiffy.arspec.device_rejection.target_probs_rows`' rule on one row."""
    return target_probs_rows(logits.reshape(-1, logits.shape[-1])[:1], [sampling])[0].cpu()


def draft_uniforms(sampling: SamplingConfig, num_drafts: int, depth: int, root_position: int) -> torch.Tensor:
    """``[D, K]`` float64 host uniforms of a round's draws (row ``d``: depth ``d``'s ``K`` draws, in draft order):
    the first ``D * K`` of :func:`~spiffy.arspec.sampling.keyed_uniforms` keyed by ``(seed, DRAFT_STREAM,
    root_position)``. Host work only; a captured round copies them into its static buffer before replaying."""
    key = position_key(keyed_seed(sampling) ^ DRAFT_STREAM, root_position)
    return keyed_uniforms(key, depth * num_drafts).view(depth, num_drafts)


def drafts_from_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[K, D]`` long on ``probs.device``: the inverse-CDF draw (:func:`~spiffy.arspec.sampling.inverse_cdf`) of
    ``probs`` ``[D, V]`` at depth ``d`` with uniform ``u[d, k]`` (``u``: ``[D, K]``, on ``probs.device``) for draft
    ``k``. A tensor program: nothing is read to the host, and a token without mass is never drawn."""
    # one draw per draft: inverse_cdf takes one uniform per row of [..., V], and expanding probs to [D, K, V] would
    # materialise K copies of the cumulative sums (hundreds of MB at a real vocabulary)
    return torch.stack([inverse_cdf(probs, u[:, j]) for j in range(int(u.shape[1]))])


def sample_drafts(probs: torch.Tensor, num_drafts: int, sampling: SamplingConfig, root_position: int) -> torch.Tensor:
    """``[K, D]`` long on ``probs.device``: ``K`` joint drafts, token ``d`` of each drawn independently from
    ``probs[d]`` (``probs``: ``[D, V]``, nonnegative; a token without mass is never drawn).

    Each token is an inverse-CDF draw (:func:`drafts_from_uniforms`) with a host uniform keyed by ``(seed,
    DRAFT_STREAM, root_position)`` (:func:`draft_uniforms`): the same run draws the same drafts, and nothing is
    read back from the device (the uniforms travel by a non-blocking copy).
    """
    depth = int(probs.shape[0])
    if num_drafts <= 0 or depth == 0:
        return torch.zeros(max(num_drafts, 0), depth, dtype=torch.long, device=probs.device)
    u = draft_uniforms(sampling, int(num_drafts), depth, root_position)
    return drafts_from_uniforms(probs, on_device(u, probs.device))


def build_sampled_tree(probs: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """Merge joint drafts ``[K, D]`` (drawn from ``probs`` ``[D, V]``) into one tree (common prefixes shared).

    Node order is creation order (draft by draft, shallow to deep), so parents precede children. ``samples``
    lists, below each node, the depth-``d + 1`` tokens of the drafts passing through it, in draft order. The
    eager path's builder: it reads ``probs`` and ``drafts`` to the host (two reads) and returns a host tree
    (``proposal`` on the CPU); :func:`~spiffy.arspec.device_draws.sampled_tree_device` builds the same tree on the
    device.
    """
    k, depth = int(drafts.shape[0]), int(drafts.shape[1]) if drafts.dim() == 2 else 0
    if k == 0 or depth == 0:
        return empty_tree()
    probs = probs.cpu()  # one read of the device's q; the per-token lookups below then stay on the host
    logq = torch.log(probs.clamp_min(1e-300))
    rows = drafts.tolist()
    lookup: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    samples: dict[int, list[int]] = {}
    for draft in rows:
        node = -1
        score = 0.0
        for d, tok in enumerate(draft):
            samples.setdefault(node, []).append(int(tok))
            score += float(logq[d, tok])
            child = lookup.get((node, int(tok)))
            if child is None:
                child = len(tokens)
                lookup[(node, int(tok))] = child
                tokens.append(int(tok))
                parents.append(node)
                depths.append(d + 1)
                scores.append(score)
            node = child
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        torch.tensor(scores, dtype=torch.float64),
        samples=samples,
        proposal=probs,
    )


def draft_paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-leaf path of ``tree`` as node indices (one per distinct draft)."""
    parents = tree.parents.tolist()
    has_child = set(parents)
    paths: list[list[int]] = []
    for leaf in range(tree.num_nodes):
        if leaf in has_child:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def expected_streaks(tree: DraftTree, target: TargetLogits, sampling: SamplingConfig) -> list[float]:
    """SpecDiff-2's self-selection score of each path of :func:`draft_paths`: the expected number of accepted
    tokens ``sum_j prod_{i<=j} min(1, p_i(x_i) / q_i(x_i))`` under single-draft speculative sampling.

    Needs ``tree.proposal`` (a sampled tree). Using this score to pick the draft before rejection sampling is
    biased (see the module docstring); it is reported, never used to accept.
    """
    if tree.proposal is None:
        raise ValueError("expected_streaks needs a tree of sampled drafts (DraftTree.proposal)")
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    out: list[float] = []
    for path in draft_paths(tree):
        streak, total = 1.0, 0.0
        for node in path:
            p = target_probs(target.logits(parents[node]), sampling)
            q = float(tree.proposal_below(parents[node], depths[node] - 1)[tokens[node]])  # type: ignore[index]
            streak *= min(1.0, float(p[tokens[node]]) / q) if q > 0 else 0.0
            total += streak
            if streak == 0.0 or math.isnan(streak):
                break
        out.append(total)
    return out
