"""Sampled drafts merged into a tree on the device: :func:`sampled_tree_device`, the tensor-program twin of
:func:`~spiffy.arspec.selfselect.build_sampled_tree` (the DEER / DFlash chain under the rejection rule for ``K = 1``,
SpecDiff-2's ``K`` joint drafts otherwise) for the captured path: static shapes, nothing read to the host.

**The merge** (:func:`merged_drafts`, shared with DFlash2's drafts sampled through its selector:
:func:`~spiffy.arspec.device_selector.selector_sampled_device`). The host builder walks the drafts ``[K, D]`` in
order, shallow to deep, and creates a node for
``(draft k, depth d)`` unless an earlier draft already created one for the same prefix. Here the same decision is
taken for every ``(k, d)`` at once:

* ``same[j, k, d]``: drafts ``j`` and ``k`` agree on depths ``0..d`` (a cumulative product of token equality over
  depth, ``[K, K, D]``);
* ``first[k, d]``: the first draft ``j <= k`` with ``same[j, k, d]``; ``(k, d)`` is *new* when ``first[k, d] == k``;
* node ids: the running count of new flags in ``(k, d)`` row-major order, which is the host's creation order; a
  duplicate ``(k, d)`` takes the node of ``(first[k, d], d)``.

The tree is padded to ``N = K * D`` nodes (the most ``K`` drafts of depth ``D`` can create); the real ones come
first, the count stays on the device (:attr:`SampledDeviceTree.real`).

**The draws below each node** (the host tree's ``samples``, what the rejection walk tests in order): draft ``k``
passes through node ``node[k, d]`` and draws its depth-``d + 1`` token below it. Its column is its rank among the
drafts through that node, the number of earlier drafts ``j < k`` with ``same[j, k, d]``, so each node's row lists
its draws in draft order, duplicates included; every ``(node, rank)`` is written once.

**Scores** are the host's float64 sums in the host's order (``0.0 + log q_1 + log q_2 + ...``, one addition per
depth, not a parallel scan), so they equal the host builder's bit for bit on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spiffy.arspec.device_tree import DeviceTree

__all__ = ["SampledDeviceTree", "merged_drafts", "placed", "running_sums", "sampled_tree_device"]


@dataclass
class SampledDeviceTree:
    """Sampled drafts as one padded device tree (every tensor on the proposal's device).

    Attributes:
        tree: the nodes, padded to ``N = K * D`` (``tree.count == N``, a static upper bound): the first ``real``
            are the host builder's nodes in its order; padding follows :class:`DeviceTree` (token 0, parent -1,
            depth 1, score ``-inf``).
        real: 0-d long, the number of real nodes (read it only when a host synchronisation is acceptable).
        draws: ``[1 + N, K]`` long, the draws below each node in draft order, ``-1`` padded: row 0 the root's (every
            draft's depth-1 token), row ``i + 1`` node ``i``'s; rows of leaves and padding are all ``-1``.
        proposal: ``[D, V]`` float64, the ``q`` the depth-``d + 1`` draws came from (row ``d``), as given; or, with
            ``proposal_rows``, ``[Q, V]`` rows of per-node proposals (a DFlash2 selector's drafts:
            :func:`~spiffy.arspec.device_selector.selector_sampled_device`).
        proposal_rows: ``None`` (the draws below a depth-``d`` node came from ``proposal[d]``), or ``[1 + N]`` long:
            the row of ``proposal`` the draws below the root (entry 0) and below node ``i`` (entry ``i + 1``) came
            from.
    """

    tree: DeviceTree
    real: torch.Tensor
    draws: torch.Tensor
    proposal: torch.Tensor
    proposal_rows: torch.Tensor | None = None


def sampled_tree_device(probs: torch.Tensor, drafts: torch.Tensor, length: torch.Tensor | None = None
                        ) -> SampledDeviceTree:
    """:func:`~spiffy.arspec.selfselect.build_sampled_tree`'s tree of ``drafts`` ``[K, D]`` long (tokens in
    ``[0, V)``, e.g. from :func:`~spiffy.arspec.selfselect.sample_drafts`) drawn from ``probs`` ``[D, V]`` float64,
    built by tensor programs of static shape with no host read (see the module docstring).

    ``length``: a 0-d long tensor ``d <= D``: the tree of the drafts' first ``d`` tokens (``drafts[:, :d]`` from
    ``probs[:d]``) in the shapes of ``D`` (one captured step for every draft length): a ``(k, d')`` with ``d' >= d``
    is never new, so the running count of new flags is still the host's creation order over ``[K, d]``, and no draw
    below a depth-``d`` node is written."""
    k, depth = int(drafts.shape[0]), int(drafts.shape[1])
    if k * depth == 0:
        return merged_drafts(drafts, torch.zeros(k, depth, dtype=torch.float64, device=drafts.device), probs)[0]
    drafts = drafts.long()
    logq = torch.log(probs.clamp_min(1e-300)).gather(1, drafts.t())  # [D, K] log q of each draw
    return merged_drafts(drafts, running_sums(logq.t()), probs, length)[0]


def running_sums(logq: torch.Tensor) -> torch.Tensor:
    """``[K, D]`` float64: each row's running sums of ``logq [K, D]`` as the host adds them (``score = 0.0``, then
    ``score += ...`` one depth at a time: not a parallel scan, whose order of additions differs)."""
    running = [logq[:, 0] + 0.0]
    for d in range(1, int(logq.shape[1])):
        running.append(running[-1] + logq[:, d])
    return torch.stack(running, dim=1)


def merged_drafts(drafts: torch.Tensor, score: torch.Tensor, proposal: torch.Tensor,
                  length: torch.Tensor | None = None) -> tuple[SampledDeviceTree, torch.Tensor]:
    """The merge of the module docstring: ``drafts [K, D]`` long with each prefix's ``score [K, D]`` float64 ->
    ``(tree, slot)``: the :class:`SampledDeviceTree` (``proposal`` as given) and ``slot [K * D]`` long, where each
    ``(k, d)`` went in ``[K * D]`` row-major order (its node id when it created the node, else ``N`` or more), for
    placing more per-node values (:func:`placed`). ``length``: as :func:`sampled_tree_device` takes it."""
    k, depth = int(drafts.shape[0]), int(drafts.shape[1])
    n = k * depth
    dev = drafts.device
    if n == 0:
        z = torch.zeros(0, dtype=torch.long, device=dev)
        tree = DeviceTree(z, z.clone(), z.clone(), torch.zeros(0, dtype=torch.float64, device=dev), 0)
        draws = torch.full((1, k), -1, dtype=torch.long, device=dev)
        return SampledDeviceTree(tree, torch.zeros((), dtype=torch.long, device=dev), draws, proposal), z
    ramp_k = torch.arange(k, device=dev)
    # same[j, k, d]: drafts j and k share the prefix through depth d
    same = (drafts.unsqueeze(1) == drafts.unsqueeze(0)).to(torch.long).cumprod(dim=-1).bool()  # [K, K, D]
    first = torch.where(same, ramp_k.view(k, 1, 1), k).amin(dim=0)  # [K, D]; same[k, k, d] holds, so <= k
    new = first == ramp_k.view(k, 1)  # [K, D]
    below_real = None  # [K, D - 1]: the draw below (k, d') is a token of the draft (d' + 1 < d)
    if length is not None:
        drafted = torch.arange(depth, device=dev) < length  # [D]
        new = new & drafted.view(1, depth)
        below_real = drafted[1:].view(1, depth - 1).expand(k, depth - 1)
    ids = torch.cumsum(new.view(-1).to(torch.long), dim=0).view(k, depth) - 1  # host creation order
    node = ids.gather(0, first)  # [K, D] the node draft k passes through at depth d
    parent = torch.cat([torch.full((k, 1), -1, dtype=torch.long, device=dev), node[:, :-1]], dim=1)
    level = torch.arange(1, depth + 1, device=dev).expand(k, depth)
    # new (k, d) go to their node id; the rest to a slot of their own past N (no index written twice)
    slot = torch.where(new, ids, n + torch.arange(n, device=dev).view(k, depth)).view(-1)
    tokens = placed(slot, drafts, 0, n)
    parents = placed(slot, parent, -1, n)
    depths = placed(slot, level, 1, n)
    scores = placed(slot, score, float("-inf"), n)
    # the draws below node[k, d] (depths d < D - 1): draft k's next token, in column rank[k, d]
    earlier = (ramp_k.view(k, 1) < ramp_k.view(1, k)).unsqueeze(-1)  # [j, k, 1]: j < k
    rank = (same & earlier).sum(dim=0)  # [K, D]
    at = node[:, :-1] * k + rank[:, :-1]  # [K, D - 1]
    if below_real is not None:  # the draws past the draft go to one spare slot, cut below
        at = torch.where(below_real, at, n * k)
    below = torch.full((n * k + 1,), -1, dtype=torch.long, device=dev).scatter_(0, at.reshape(-1),
                                                                                drafts[:, 1:].reshape(-1))
    draws = torch.cat([drafts[:, 0].view(1, k), below[: n * k].view(n, k)], dim=0)
    return SampledDeviceTree(DeviceTree(tokens, parents, depths, scores, n), new.sum(), draws, proposal), slot


def placed(slot: torch.Tensor, values: torch.Tensor, fill: float, n: int) -> torch.Tensor:
    """``[n]``: ``values`` ``[K, D]`` scattered to the flat ``slot`` ``[K * D]`` (each distinct, the first ``n`` the
    real nodes), every other slot ``fill``."""
    out = torch.full((2 * n,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_(0, slot, values.reshape(-1))[:n]
