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
"""

from __future__ import annotations

import torch

from spiffy.arspec.rules import Acceptance, CoupledRule, TargetLogits
from spiffy.arspec.sampling import keyed_seed, position_key
from spiffy.arspec.selfselect import target_probs
from spiffy.arspec.tree import DraftTree
from spiffy.errors import StepLimitError
from spiffy.sampling import SamplingConfig

__all__ = ["REJECTION_STREAM", "RejectionRule", "residual_step", "sample_from"]

#: stream tag mixed into the seed of the acceptance coins
REJECTION_STREAM = 0x3E1EC7
_EPS = 1e-12


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from ``probs`` ``[V]`` (nonnegative, not necessarily normalised) with uniform ``u``."""
    cdf = torch.cumsum(probs, dim=0)
    total = float(cdf[-1])
    if total <= 0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, probs.numel() - 1)
    while float(probs[idx]) <= 0 and idx > 0:  # u * total on the edge of a zero-mass token's empty interval
        idx -= 1
    return idx


def residual_step(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, r - q))``; when nothing is left (``r <= q`` everywhere, only by rounding since a rejection
    needs ``r(x) < q(x)`` somewhere) ``r`` is returned unchanged."""
    left = (r - q).clamp_min(0.0)
    total = float(left.sum())
    return left / total if total > _EPS else r


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

    def _coins(self, position: int, count: int) -> list[float]:
        gen = torch.Generator().manual_seed(position_key(keyed_seed(self.sampling) ^ REJECTION_STREAM, position))
        return torch.rand(count, generator=gen, dtype=torch.float64).tolist()

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
        lookup = tree.children_lookup()
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(tree.parents.tolist()):
            children.setdefault(parent, []).append(i)
        node_tokens = tree.tokens.tolist()
        depths = tree.depths.tolist()
        node, accepted = -1, []
        for _ in range(tree.num_nodes + 1):  # each pass accepts a strictly deeper node or returns
            depth = 0 if node < 0 else depths[node]
            position = root_position + depth + 1
            r = target_probs(target.logits(node), self.sampling)
            if tree.samples is not None:
                draws = tree.samples.get(node, [])
                q = tree.proposal_below(node, depth) if draws else None
            else:
                draws = [node_tokens[c] for c in children.get(node, [])]
                q = None
            coins = self._coins(position, len(draws) + 1)
            chosen = None
            for x, u in zip(draws, coins):
                if q is None:  # point-mass proposal
                    if self.trace is not None:
                        self.trace.append(("test", u, float(r[x])))
                    if u < float(r[x]):
                        chosen = x
                        break
                    rest = r.clone()
                    rest[x] = 0.0
                    total = float(rest.sum())
                    if total <= _EPS:  # r(x) was 1 up to rounding: the child is certain
                        chosen = x
                        break
                    r = rest / total
                else:
                    qx = float(q[x])
                    if self.trace is not None and qx > 0:
                        self.trace.append(("test", u, min(1.0, float(r[x]) / qx)))
                    if qx > 0 and u < min(1.0, float(r[x]) / qx):
                        chosen = x
                        break
                    r = residual_step(r, q)
            if chosen is None:
                if self.trace is not None:
                    self.trace.append(("draw", coins[-1], r))
                return Acceptance(accepted, sample_from(r, coins[-1]))
            child = lookup[(node, chosen)]
            accepted.append(child)
            node = child
        raise StepLimitError(f"the rejection walk accepted {len(accepted)} nodes of a {tree.num_nodes}-node tree "
                             "without ending; the tree's parent links form a cycle; fix: build it with build_tree")
