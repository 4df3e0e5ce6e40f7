"""The speculative-sampling acceptance rule (DEER Eq. 5-6, generalised to trees): :class:`RejectionRule`.

At each visited node the target's distribution ``p`` (temperature, top-k / top-p applied) is compared with how the
node's children were proposed, and the walk either moves to an accepted child or stops with a bonus token drawn
from what is left (the residual):

* **sampled children** (``DraftTree.samples``: i.i.d. draws ``x_1..x_n`` from ``q``; the DEER chain has one,
  SpecDiff-2's K-draft tree up to K; ``q`` is the depth's, or the node's own for a DFlash2 selector's drafts:
  :meth:`~spiffy.arspec.tree.DraftTree.proposal_below`): recursive rejection sampling (SpecInfer's multi-draft
  speculative sampling).
  ``r = p``; for each draw in order: accept ``x_i`` with probability ``min(1, r(x_i) / q(x_i))``, else
  ``r = norm(max(0, r - q))``; when every draw is rejected the bonus is drawn from ``r``. For one draw this is
  exactly DEER's Eq. 5 (accept with ``min(1, p/q)``) and Eq. 6 (resample from ``max(0, p - q)``). Exact: by induction
  on ``n``, step one emits ``x`` with probability ``min(p, q)(x)``, rejects with probability
  ``beta = sum max(0, p - q)``, and given a rejection the remaining draws are still i.i.d. from ``q`` and
  independent of it, so they emit ``norm(max(0, p - q))``; in total ``min(p, q) + beta * norm(max(0, p - q)) = p``.
  A duplicate of a rejected token has ``r = 0`` there and is rejected again, but its residual update still happens.
* **deterministic children** (argmax chain, DDTree's top-B tree: no ``samples``): sequential rejection sampling
  with point-mass proposals, children in node order: accept child ``c`` with probability ``r(c)``, else set
  ``r(c) = 0`` and renormalise; the bonus comes from the final ``r``. Exact by the same argument (a point mass
  ``q = delta_c`` gives ``min(1, r(c)/1)`` and ``norm(max(0, r - delta_c))``), and ``P(accept some child) =
  sum_c p(c)``, the best any deterministic set of candidates can do.

At ``T == 0`` ``p`` is a point mass on the argmax, so both reduce to "accept the child holding the target's argmax,
else emit the argmax": the output equals greedy AR decoding token for token.

Coins are keyed by ``(seed, REJECTION_STREAM, absolute position)``; every absolute position is decided in exactly
one round, so each decision uses fresh randomness and a run is reproducible for a seed.

The walk itself is one tensor program (:func:`~spiffy.arspec.device_rejection.rejection_walk`), which the captured
path runs on every batch row's device tree at once; this rule runs it on one host-built tree, so both paths share
the arithmetic and the coins. With point-mass proposals it tests child ``i`` against ``p_i / (sum(p) - sum_{j<i}
p_j)``, which is the renormalised ``r(x_i)`` above without rewriting ``V`` entries per child.
"""

from __future__ import annotations

import torch

from spiffy.arspec.device_rejection import (REJECTION_STREAM, Proposals, RejectionWalk, children_draws,
                                            rejection_coins, rejection_walk)
from spiffy.arspec.rules import Acceptance, CoupledRule, TargetLogits
from spiffy.arspec.sampling import inverse_cdf
from spiffy.arspec.tree import DraftTree
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import device_tensor, on_device

__all__ = ["REJECTION_STREAM", "RejectionRule", "sample_from", "tree_proposals"]


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from ``probs`` ``[V]`` (nonnegative, not necessarily normalised) with uniform ``u``
    (:func:`~spiffy.arspec.sampling.inverse_cdf`, the walk's own draw)."""
    idx = int(inverse_cdf(probs, device_tensor(float(u), torch.float64, probs.device)))
    if idx < 0:
        raise ValueError("cannot sample from an all-zero distribution")
    return idx


def tree_proposals(tree: DraftTree, device: torch.device) -> Proposals:
    """One host tree of sampled drafts as :class:`~spiffy.arspec.device_rejection.Proposals` (batch of one): its
    ``samples`` and the ``q`` of every node they hang below (:meth:`DraftTree.proposal_below`). A tree of point-mass
    children needs none of this: :func:`~spiffy.arspec.device_rejection.children_draws` reads them off its parents."""
    if tree.samples is None:
        raise ValueError("tree_proposals needs a tree of sampled drafts (DraftTree.samples)")
    n = tree.num_nodes
    depths = tree.depths.tolist()
    below = {node: list(draws) for node, draws in tree.samples.items() if draws}
    width = max((len(v) for v in below.values()), default=1)  # at least one (padding) column
    draws = torch.full((1, n + 1, width), -1, dtype=torch.long)
    q_rows: list[torch.Tensor] = []
    q_row = torch.zeros(1, n + 1, dtype=torch.long)
    for node, toks in below.items():
        draws[0, node + 1, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        q = tree.proposal_below(node, 0 if node < 0 else depths[node])
        assert q is not None, "a sampled tree names the proposal of every node it draws below"
        q_row[0, node + 1] = len(q_rows)
        q_rows.append(on_device(q.double(), device))
    q_all = torch.stack(q_rows).unsqueeze(0) if q_rows else None
    return Proposals(on_device(draws, device), q_all, on_device(q_row, device))


class RejectionRule:
    """Speculative sampling on any draft tree (see the module docstring): exact in distribution, not coupled to
    plain AR's random stream.

    Args:
        sampling: the target's decoding rule (temperature, top-k, top-p, seed).
    """

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        #: when a list, :meth:`accept` appends each random decision: ``("test", coin, threshold)`` (accepted when
        #: ``coin < threshold``) or ``("draw", coin, probs)`` (inverse-CDF draw from ``probs``); near-tie proofs
        #: (:mod:`spiffy.bench.batch_fidelity`) read it
        self.trace: list[tuple[str, float, object]] | None = None

    def accept(
        self,
        tree: DraftTree,
        target: TargetLogits,
        draft_logits: torch.Tensor | None,
        root_position: int,
    ) -> Acceptance:
        if float(self.sampling.temperature) == 0:
            # T = 0: both rules are the greedy walk (the coupled rule draws the argmax at every node)
            return CoupledRule(self.sampling).accept(tree, target, draft_logits, root_position)
        n = tree.num_nodes
        if isinstance(target, TargetLogits):
            logits = target.all_rows(n + 1)
        else:  # any object with the same logits(node) (recorded rounds, tables)
            logits = torch.cat([target.logits(node).reshape(1, -1) for node in range(-1, n)])
        dev = logits.device
        ids = on_device(torch.cat([torch.zeros(1, dtype=torch.long), tree.tokens]).view(1, -1), dev)
        parents, counts = on_device(tree.parents.view(1, -1), dev), on_device(torch.tensor([n]), dev)
        if tree.samples is None:  # point-mass children, as a captured round lists them
            proposals = Proposals(children_draws(ids, parents, counts, max(n, 1)))
        else:
            proposals = tree_proposals(tree, dev)
        depth = tree.max_depth()
        coins = rejection_coins([self.sampling], [root_position], depth + 1, int(proposals.draws.shape[2]) + 1, dev)
        walk = rejection_walk(logits.unsqueeze(0), [self.sampling], ids, parents, counts, proposals, coins, depth,
                              stop_early=True)
        if self.trace is not None:
            self._record(walk, coins)
        accepted = int(walk.accepted[0])
        return Acceptance([r - 1 for r in walk.keep[0, 1 : accepted + 1].tolist()], int(walk.bonus[0]))

    def _record(self, walk: RejectionWalk, coins: torch.Tensor) -> None:
        """The walk's decisions in order into :attr:`trace` (``coins [1, S, K + 1]``): each tested draw, then the
        bonus draw."""
        assert self.trace is not None
        for step in range(int(walk.ended[0]) + 1):
            for i, on in enumerate(walk.tested[0, step].tolist()):
                if on:
                    self.trace.append(("test", float(coins[0, step, i]), float(walk.thresholds[0, step, i])))
        self.trace.append(("draw", float(walk.bonus_coin[0]), walk.left[0].cpu()))
