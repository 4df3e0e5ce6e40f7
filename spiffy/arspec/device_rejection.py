"""The rejection rule (:mod:`spiffy.arspec.rejection`) as a tensor program: every batch row's walk at once, with
static shapes and no host read, so a captured round under ``accept="rejection"`` at ``T > 0`` keeps its one host read.

The eager rule calls the same program on its one tree (:meth:`~spiffy.arspec.rejection.RejectionRule.accept`), so
the two paths share one arithmetic and one stream of coins.

**Inputs.** A round's verification rows (row 0 the root, row ``i + 1`` node ``i``) and, per row, what its children
were proposed from (:class:`Proposals`): the draws below it in draw order (``[B, R, K]``, ``-1`` padded) and either
the distributions ``q`` they were drawn from (sampled drafts: DEER, DFlash and SpecDiff-2 under this rule, a DFlash2
selector's drafts) or ``None`` (point-mass proposals: the children's tokens in node order, DDTree's top-B tree). A
batch whose rows mix the two kinds gives ``q`` and :attr:`Proposals.point_rows`: those rows take the point-mass
rule, the others the sampled one (both are computed for every row, and each row keeps its own).

**The walk** runs ``max_depth + 1`` vectorised steps (a walk that reaches the deepest node draws its bonus on the
last one). At each step every live row reads the target's distribution ``p`` at its current node
(:func:`target_probs_rows`' rule) and the coins of that position (:func:`rejection_coins`):

* point-mass proposals: child ``i`` (mass ``p_i``) is accepted with probability ``p_i / left_i``, where
  ``left_i = sum(p) - sum_{j < i} p_j`` is the mass not yet rejected: the sequential rule's ``r(x_i)`` after each
  rejected child is zeroed and ``r`` renormalised, without touching ``V`` entries per child. A child that holds all
  of the mass left (``left_i - p_i <= 1e-12 left_i``) is accepted. Vectorised over the ``K`` children.
* sampled proposals: draw ``i`` is accepted with probability ``min(1, r(x_i) / q(x_i))`` (never when
  ``q(x_i) = 0``), else ``r = norm(max(0, r - q))`` (unchanged when nothing is left, only by rounding): ``K``
  sequential updates of ``[B, V]``.

A row that accepts moves to the child holding the accepted token; one that does not draws its bonus from what is
left (``p`` without the rejected children, or the last ``r``) by :func:`~spiffy.arspec.sampling.inverse_cdf` with
the coin after the node's draws. Coins are keyed by ``(seed, REJECTION_STREAM, absolute position)`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spiffy.arspec.device_draws import SampledDeviceTree
from spiffy.arspec.device_tree import DeviceTree, WalkResult
from spiffy.arspec.sampling import inverse_cdf, keyed_seed, keyed_uniforms, position_key, tempered
from spiffy.sampling import SamplingConfig, filter_logits
from spiffy.torch_utils import on_device

__all__ = ["REJECTION_STREAM", "Proposals", "RejectionWalk", "SamplingGroups", "children_draws", "rejection_coins",
           "rejection_walk", "round_proposals", "sampling_groups", "target_probs_rows"]

#: stream tag mixed into the seed of the acceptance coins
REJECTION_STREAM = 0x3E1EC7
#: mass below which what is left counts as nothing (rounding)
EPS = 1e-12


@dataclass
class Proposals:
    """How the children of every verification row were proposed.

    Attributes:
        draws: ``[B, R, K]`` long: below each row, its draws in draw order (sampled) or its children's tokens in
            node order (point mass); ``-1`` padding.
        q: ``[B, Q, V]`` float64 distributions the draws came from, ``None`` for point-mass proposals.
        q_row: ``[B, R]`` long: the row of ``q`` each verification row's draws came from (with ``q``).
        point_rows: with ``q``, ``[B]`` bool: the batch rows whose draws are point-mass children (a round whose rows
            mix the two kinds: each row is walked by its own kind's rule), else ``None``.
        sampled_width: with ``point_rows``, how many leading columns of ``draws`` hold the sampled rows' draws (the
            point-mass rows' children may take more).
    """

    draws: torch.Tensor
    q: torch.Tensor | None = None
    q_row: torch.Tensor | None = None
    point_rows: torch.Tensor | None = None
    sampled_width: int = 0


@dataclass
class RejectionWalk(WalkResult):
    """:class:`~spiffy.arspec.device_tree.WalkResult` plus what near-tie proofs read back (eager, one row).

    Attributes:
        thresholds: ``[B, S, K]`` float64, the acceptance threshold of each draw tested at step ``s`` (a draw is
            accepted when its coin is below it); tested: ``[B, S, K]`` bool, the draws that were tested.
        left: ``[B, V]`` float64, what the bonus was drawn from (unnormalised); bonus_coin: ``[B]`` its coin;
            ended: ``[B]`` long, the step that drew it.
    """

    thresholds: torch.Tensor
    tested: torch.Tensor
    left: torch.Tensor
    bonus_coin: torch.Tensor
    ended: torch.Tensor


def rejection_coins(samplings: Sequence[SamplingConfig], root_positions: Sequence[int], steps: int, width: int,
                    device: torch.device | str) -> torch.Tensor:
    """``[B, steps, width]`` float64 coins: row ``b``, step ``s`` holds the first ``width`` coins of position
    ``root + s + 1`` (the draws' tests in order, then the bonus). Made on the host from the keys alone (no device
    read) and moved with one non-blocking copy; greedy rows get zeros (never read)."""
    out = torch.zeros(len(samplings), int(steps), int(width), dtype=torch.float64)
    for b, (s, root) in enumerate(zip(samplings, root_positions)):
        if float(s.temperature) > 0:
            key = keyed_seed(s) ^ REJECTION_STREAM
            for step in range(int(steps)):
                out[b, step] = keyed_uniforms(position_key(key, int(root) + step + 1), int(width))
    return on_device(out, device)


#: the rows of a batch that share a sampling rule: ``(temperature, top_k, top_p, rows)``, rows as a slice (one row)
#: or a device index
SamplingGroups = list[tuple[float, int, float, "slice | torch.Tensor"]]


def sampling_groups(samplings: Sequence[SamplingConfig], device: torch.device | str) -> SamplingGroups:
    """The batch rows of each distinct ``(temperature, top_k, top_p)``, in first-seen order (one index copy per
    group: a walk makes them once, not at every step)."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for b, s in enumerate(samplings):
        groups.setdefault((float(s.temperature), int(s.top_k), float(s.top_p)), []).append(b)
    return [(t, k, p, slice(rows[0], rows[0] + 1) if len(rows) == 1 else on_device(torch.tensor(rows), device))
            for (t, k, p), rows in groups.items()]


def target_probs_rows(logits: torch.Tensor, samplings: Sequence[SamplingConfig],
                      groups: SamplingGroups | None = None) -> torch.Tensor:
    """``[B, ..., V]`` float64: the distribution the target samples from (tempered in float64, top-k / top-p
    filtered, softmax; a greedy sampling's rows: the softmax of the raw logits) of every row of ``logits``
    ``[B, ..., V]``. Rows sharing a rule are computed together (``groups``: :func:`sampling_groups` of
    ``samplings``, made here when not given)."""
    out = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    for temperature, top_k, top_p, pick in groups if groups is not None else sampling_groups(samplings, logits.device):
        scores = filter_logits(tempered(logits[pick].double(), temperature), top_k, top_p, nucleus="reaches")
        out[pick] = torch.softmax(scores, dim=-1)
    return out


def children_draws(ids: torch.Tensor, parents: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, R, width]`` point-mass proposals of padded trees: below each verification row, its children's tokens in
    node order (``ids [B, R]``, ``parents [B, N]``, ``counts [B]`` real nodes; ``width``: at least the most
    children of any node), ``-1`` padded. No host read."""
    rows, n = int(parents.shape[0]), int(parents.shape[1])
    dev = ids.device
    out = torch.full((rows, n + 1, int(width) + 1), -1, dtype=torch.long, device=dev)  # column width: padding
    if n == 0:
        return out[:, :, : int(width)]
    real = torch.arange(n, device=dev).unsqueeze(0) < counts.view(-1, 1)  # [B, N]
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & real.unsqueeze(1)  # [B, i, j]: j a sibling of i
    earlier = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)  # j < i
    rank = (same & earlier).sum(dim=2)  # [B, N] place among the siblings
    col = torch.where(real, rank, int(width))
    out.view(rows, -1).scatter_(1, (parents + 1) * (int(width) + 1) + col, ids[:, 1:])
    return out[:, :, : int(width)]


def round_proposals(trees: Sequence[DeviceTree | SampledDeviceTree | None], ids: torch.Tensor,
                    parents: torch.Tensor, counts: torch.Tensor, row_depths: torch.Tensor) -> Proposals:
    """A captured round's :class:`Proposals` (``ids``, ``row_depths [B, R]``, ``parents [B, N]``, ``counts [B]``:
    the filled round buffers): the children of every row when no tree is sampled (DDTree, the chain), else each
    sampled tree's draws (:class:`~spiffy.arspec.device_draws.SampledDeviceTree`) with its per-depth ``q`` (the
    draws below a depth-``d`` row came from ``q[d]``) or its per-node ``q`` (``proposal_rows``). Trees of both kinds
    in one round are not supported here."""
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    sampled = [(b, t) for b, t in enumerate(trees) if isinstance(t, SampledDeviceTree)]
    if not sampled:
        return Proposals(children_draws(ids, parents, counts, max(width - 1, 1)))
    k = max(int(t.draws.shape[1]) for _b, t in sampled)
    depth = max(int(t.proposal.shape[0]) for _b, t in sampled)
    vocab = int(sampled[0][1].proposal.shape[1])
    draws = torch.full((rows, width, k), -1, dtype=torch.long, device=ids.device)
    q = torch.zeros(rows, depth, vocab, dtype=torch.float64, device=ids.device)
    for b, t in sampled:
        draws[b, : t.draws.shape[0], : t.draws.shape[1]] = t.draws
        q[b, : t.proposal.shape[0]] = t.proposal
    # a leaf's depth may be past the last q row: it draws nothing, so any row of q serves
    q_row = row_depths.clamp(max=depth - 1)
    for b, t in sampled:
        if t.proposal_rows is not None:  # per-node proposals (a DFlash2 selector's drafts)
            q_row[b, : t.proposal_rows.shape[0]] = t.proposal_rows
    return Proposals(draws, q, q_row)


def _row(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b]]`` for ``values [B, R, ...]`` and ``index [B]``."""
    shape = (int(values.shape[0]), 1) + tuple(values.shape[2:])
    return values.gather(1, index.view((-1, 1) + (1,) * (values.dim() - 2)).expand(shape)).squeeze(1)


def rejection_walk(logits: torch.Tensor, samplings: Sequence[SamplingConfig], ids: torch.Tensor,
                   parents: torch.Tensor, counts: torch.Tensor, proposals: Proposals, coins: torch.Tensor,
                   max_depth: int, stop_early: bool = False, groups: SamplingGroups | None = None
                   ) -> RejectionWalk:
    """The rejection rule on every row at once (see the module docstring).

    Args:
        logits: ``[B, R, V]`` the target's logits at every verification row; samplings: per row (all ``T > 0``).
        ids: ``[B, R]`` verification rows' tokens; parents: ``[B, N]`` (``N = R - 1``); counts: ``[B]`` real nodes.
        proposals: the draws below every row (:class:`Proposals`, ``K >= 1`` draws per row, padding included).
        coins: ``[B, S, K + 1]`` (:func:`rejection_coins`, ``S >= max_depth + 1``).
        max_depth: the deepest node (static).
        stop_early: stop once every row has drawn its bonus (a host read per step: the eager rule's choice, which
            then pays for the visited nodes only; the captured round runs every step and reads nothing).
        groups: :func:`sampling_groups` of ``samplings``, when made beforehand (a captured step's are made once per
            bucket: their index tensors are host copies); made here when ``None``.
    """
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    draws = proposals.draws
    k = int(draws.shape[2])
    steps = int(max_depth) + 1
    dev = ids.device
    vocab = int(logits.shape[-1])
    real = torch.arange(width - 1, device=dev).unsqueeze(0) < counts.view(-1, 1)  # [B, N]
    cur = torch.zeros(rows, dtype=torch.long, device=dev)  # the current node's verification row
    live = torch.ones(rows, dtype=torch.bool, device=dev)
    path = torch.zeros(rows, steps, dtype=torch.long, device=dev)  # verification row accepted at depth s + 1
    bonus = torch.zeros(rows, dtype=torch.long, device=dev)
    left_out = torch.zeros(rows, vocab, dtype=torch.float64, device=dev)
    bonus_coin = torch.zeros(rows, dtype=torch.float64, device=dev)
    ended = torch.zeros(rows, dtype=torch.long, device=dev)
    thresholds = torch.zeros(rows, steps, k, dtype=torch.float64, device=dev)
    tested = torch.zeros(rows, steps, k, dtype=torch.bool, device=dev)
    if groups is None:
        groups = sampling_groups(samplings, dev)
    for step in range(steps):
        p = target_probs_rows(_row(logits, cur), samplings, groups)  # [B, V]
        x = _row(draws, cur)  # [B, K]
        valid = x >= 0
        u = coins[:, step, : k + 1]
        if proposals.q is None:
            ok, thr, test, left = _point_mass(p, x, valid, u)
        else:
            assert proposals.q_row is not None
            q = _row(proposals.q, proposals.q_row.gather(1, cur.view(-1, 1)).view(-1))
            ok, thr, test, left = _sampled(p, q, x, valid, u, proposals.sampled_width or k)
            if proposals.point_rows is not None:  # rows of point-mass children: their own rule, row by row
                point = proposals.point_rows.view(-1, 1)
                ok, thr, test, left = (torch.where(point, a, b) for a, b in
                                       zip(_point_mass(p, x, valid, u), (ok, thr, test, left)))
        accepts = ok.any(dim=1)
        first = ok.to(torch.uint8).argmax(dim=1)  # the first accepted draw
        token = x.gather(1, first.view(-1, 1)).view(-1)
        holds = real & (parents + 1 == cur.view(-1, 1)) & (ids[:, 1:] == token.view(-1, 1))  # [B, N]
        child = holds.to(torch.uint8).argmax(dim=1) + 1 if width > 1 else cur  # no nodes: nothing is accepted
        moving = live & accepts
        ending = live & ~accepts
        coin = u.gather(1, valid.sum(dim=1, keepdim=True)).view(-1)  # the coin after the node's draws
        drawn = inverse_cdf(left, coin)
        bonus = torch.where(ending, drawn, bonus)
        left_out = torch.where(ending.view(-1, 1), left, left_out)
        bonus_coin = torch.where(ending, coin, bonus_coin)
        ended = torch.where(ending, step, ended)
        thresholds[:, step] = thr
        tested[:, step] = test & live.view(-1, 1)
        path[:, step] = torch.where(moving, child, 0)
        cur = torch.where(moving, child, cur)
        live = moving
        if stop_early and not bool(live.any()):
            break
    accepted = (path > 0).sum(dim=1)
    keep = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=dev), path[:, : steps - 1]], dim=1)
    return RejectionWalk(accepted, bonus, keep, ids.gather(1, keep), thresholds, tested, left_out, bonus_coin, ended)


def _point_mass(p: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, u: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequential rejection with point-mass proposals, vectorised over the ``K`` children: ``(accepted [B, K],
    thresholds [B, K], tested [B, K], what the bonus is drawn from [B, V])``."""
    k = int(x.shape[1])
    mass = p.gather(1, x.clamp(min=0)) * valid  # [B, K]
    before = torch.cumsum(mass, dim=1) - mass
    left = p.sum(dim=1, keepdim=True) - before  # mass not yet rejected when child i is tested
    positive = left > 0
    thr = torch.where(positive, mass / torch.where(positive, left, 1.0), 0.0)
    certain = left - mass <= EPS * left
    ok = valid & ((u[:, :k] < thr) | certain)
    accepted_before = (torch.cumsum(ok.to(torch.long), dim=1) - ok.to(torch.long)) > 0
    test = valid & ~accepted_before
    # what is left: p without the rejected children (all valid ones when the row ends here)
    rejected = torch.zeros(p.shape, dtype=torch.long, device=p.device).scatter_add_(1, x.clamp(min=0), valid.long())
    return ok, thr, test, p.masked_fill(rejected > 0, 0.0)


def _sampled(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, u: torch.Tensor, width: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over the draws in order (the first ``width`` columns: the rest hold no draw):
    ``(accepted [B, K], thresholds [B, K], tested [B, K], the residual [B, V])``."""
    k = int(width)
    r = p
    done = torch.zeros(int(x.shape[0]), dtype=torch.bool, device=x.device)
    ok = torch.zeros_like(valid)
    thr = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    test = torch.zeros_like(valid)
    for i in range(k):
        xi = x[:, i : i + 1].clamp(min=0)
        act = valid[:, i] & ~done
        rx, qx = r.gather(1, xi).view(-1), q.gather(1, xi).view(-1)
        has_q = qx > 0
        thr[:, i] = torch.where(has_q, torch.clamp(rx / torch.where(has_q, qx, 1.0), max=1.0), 0.0)
        test[:, i] = act & has_q
        ok[:, i] = act & has_q & (u[:, i] < thr[:, i])
        done = done | ok[:, i]
        rejected = act & ~ok[:, i]
        rest = (r - q).clamp_min(0.0)
        total = rest.sum(dim=1, keepdim=True)
        step = torch.where(total > EPS, rest / torch.where(total > EPS, total, 1.0), r)
        r = torch.where(rejected.view(-1, 1), step, r)
    return ok, thr, test, r
