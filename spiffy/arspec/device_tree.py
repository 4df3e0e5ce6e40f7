"""Draft trees built, masked and walked on the device: DDTree, the DFlash chain and the coupled walk as tensor
programs with static shapes and no host synchronisation (the captured path's rounds, :mod:`spiffy.arspec.captured`).

**DDTree** (:func:`ddtree_device`). The host builder (:func:`spiffy.arspec.tree.build_ddtree`) pops prefixes
best first by ``(score descending, rank tuple ascending)``; its first ``B`` pops are the top ``B`` prefixes in that
order. The same set, in the same order, comes from a level-by-level selection: the depth-``d`` prefixes of the
top ``B`` all have their parent among the top ``B`` of depth ``d - 1``, so each depth keeps the best ``B`` of
``(kept parents) x (top K tokens)`` (``K = min(B, V)``; with the parents in rank-tuple order, a candidate's
rank-tuple order is its flat index ``parent * K + rank``, and stable sorts keep exactly the host's tie rule), and
the tree is the best ``B`` of all kept prefixes, ordered by score, ties by rank tuple (a lexicographic stable sort
over the ``[L]`` rank tuples, ``-1`` padded so a prefix precedes its extensions). Scores are summed in float64 in
the host's order (parent score + the depth's log-probability), so the values, the tree and the node order are the
host builder's. Cost: ``L`` stable sorts of ``B * K`` candidates and ``L + 2`` sorts of ``L * B`` prefixes. The
selection itself is :func:`best_prefixes`, which takes each depth's children ranked per kept parent (DDTree: the same
top ``K`` below every parent; DFlash2's selector ranks them by the parent's own token,
:mod:`spiffy.arspec.device_selector`) and a validity per child (a child of probability 0 is never added, so the
real node count may be below the budget: :attr:`DeviceTree.real`).

**The walk** (:func:`coupled_walk`): the target's token at every verification row at once (greedy, or position-keyed
Gumbel-max with the row's depth), a node is accepted when its token is its parent's target token and its parent is
accepted (``max depth`` vectorised steps), the bonus is the target token at the deepest accepted row: exactly
:class:`~spiffy.arspec.rules.CoupledRule`'s walk, for every tree row of a batch in one program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from spiffy.arspec.sampling import gumbel_noise, keyed_seed, tempered
from spiffy.sampling import SamplingConfig, filter_logits
from spiffy.topk import top_ranked_static

__all__ = ["DeviceTree", "RankedChildren", "WalkResult", "ancestor_visibility", "best_prefixes", "chain_device",
           "coupled_walk", "cut_chain", "ddtree_device", "ddtree_node_count", "padded_tree", "position_noise"]


@dataclass
class DeviceTree:
    """A draft tree padded to a static node count ``N`` (root excluded), every tensor on the device.

    Attributes:
        tokens, parents, depths: ``[N]`` long (``parents``: ``-1`` for children of the root; parents precede
            children); scores: ``[N]`` float64 cumulative log-probability (``-inf`` on padding).
        count: the real nodes (the first ``count``; a host integer known without reading the device), or, when
            ``real`` is set, a static upper bound of them.
        real: ``None`` (``count`` is exact), or a 0-d long device tensor: the real nodes when their number depends
            on the data (read it only when a host synchronisation is acceptable).
    Padding nodes (token 0, parent -1, depth 1, score ``-inf``) hang below the root; :func:`coupled_walk` never
    accepts them.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    count: int
    real: torch.Tensor | None = None


def ddtree_node_count(budget: int, depth: int, vocab: int) -> int:
    """How many nodes the host builder pops for ``budget``, ``depth`` positions and ``vocab`` tokens (every
    prefix of the per-depth top ``K`` is available: ``min(B, K + K^2 + ... + K^L)``)."""
    if budget <= 0 or depth <= 0 or vocab <= 0:
        return 0
    k = min(budget, vocab)
    total, level = 0, 1
    for _ in range(depth):
        level = min(level * k, budget)
        total += level
        if total >= budget:
            return budget
    return total


def ddtree_device(logprobs: torch.Tensor, budget: int, length: torch.Tensor | None = None) -> DeviceTree:
    """The host builder's tree (:func:`~spiffy.arspec.tree.build_ddtree`: same nodes, same order) of ``[L, V]``
    log-probabilities, as ``[budget]`` device tensors (see the module docstring).

    ``length``: a 0-d long device tensor ``d <= L``: the tree of the first ``d`` rows only (``build_ddtree`` of
    ``logprobs[:d]``), in a program whose shapes do not depend on ``d`` (one captured step for every draft length:
    a prefix deeper than ``d`` is invalid, and validity, not the shape, ends the tree); its node count is then data
    (:attr:`DeviceTree.real`, ``count`` the bound of ``L`` rows). Rows past ``d`` are never read for the result."""
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    dev = logprobs.device
    n = ddtree_node_count(budget, depth_limit, vocab)
    if n == 0:
        return padded_tree(budget, 0, dev)
    k = min(int(budget), vocab)
    vals, toks = top_ranked_static(logprobs, k)  # [L, K] each, value descending, ties by token id
    vals = vals.double()
    every = torch.ones(1, k, dtype=torch.bool, device=dev)
    drafted = None if length is None else torch.arange(depth_limit, device=dev) < length  # [L]

    def ranked(d: int, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # the same top K below every parent: DDTree's depths are independent of the parent's token
        rows = int(after.shape[0])
        tok = toks[d].expand(rows, k)
        ok = every if drafted is None else every & drafted[d]
        return vals[d].expand(rows, k), tok, tok, ok.expand(rows, k)

    tree, real = best_prefixes(ranked, depth_limit, k, int(budget), dev)
    tree.count = n  # every prefix of the L rows is valid: the first n picks are real, the count is exact
    if length is not None:
        tree.real = real
    return tree


#: a depth's children, best first: ``ranked(d, after)`` for depth ``d`` (0-based) below ``P`` parents, ``after [P]``
#: long (the parents' ``index``; depth 0: ``[1]``, the root's ``-1``), returns ``(logq [P, K] float64 descending,
#: tokens [P, K] long, index [P, K] long (what the children pass as ``after`` one depth down), ok [P, K] bool (a
#: child that may be added))``
RankedChildren = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def best_prefixes(ranked: RankedChildren, depth_limit: int, k: int, budget: int, dev: torch.device
                  ) -> tuple[DeviceTree, torch.Tensor]:
    """The best-first heap's first ``budget`` pops (score descending, ties by rank tuple; a prefix is valid when
    every step's ``ok`` holds) by the level-by-level selection of the module docstring, generalised to children
    ranked per parent: ``(tree, real)``, the tree padded to ``[budget]`` (``count = budget``: set it when known;
    invalid picks padded) and ``real`` the 0-d count of valid nodes (the first ``real``). ``1 <= k <= budget``."""
    width = int(budget)
    ramp = torch.arange(width, device=dev)
    # per depth: the kept prefixes in rank-tuple order: score, token, index, parent slot, validity, rank tuple [L]
    scores = torch.full((depth_limit, width), float("-inf"), dtype=torch.float64, device=dev)
    tokens = torch.zeros(depth_limit, width, dtype=torch.long, device=dev)
    index = torch.zeros(depth_limit, width, dtype=torch.long, device=dev)
    parent_slot = torch.full((depth_limit, width), -1, dtype=torch.long, device=dev)
    valid = torch.zeros(depth_limit, width, dtype=torch.bool, device=dev)
    ranks = torch.full((depth_limit, width, depth_limit), -1, dtype=torch.long, device=dev)
    vals, toks, idx, ok = ranked(0, torch.full((1,), -1, dtype=torch.long, device=dev))
    scores[0, :k], tokens[0, :k], index[0, :k], valid[0, :k] = vals[0], toks[0], idx[0], ok[0]
    ranks[0, :k, 0] = ramp[:k]
    for d in range(1, depth_limit):
        vals, toks, idx, ok = ranked(d, index[d - 1])  # [B, K] each: every kept slot's own ranked children
        cand = (scores[d - 1].unsqueeze(1) + vals).reshape(-1)  # [B * K] flat = parent * K + rank
        fine = (valid[d - 1].unsqueeze(1) & ok).reshape(-1)
        order = _best_first(cand, fine)[:width].sort().values  # the best B, back in rank-tuple order
        parent, rank = order // k, order % k
        scores[d] = cand[order]
        tokens[d] = toks.reshape(-1)[order]
        index[d] = idx.reshape(-1)[order]
        parent_slot[d] = parent
        valid[d] = fine[order]
        ranks[d] = ranks[d - 1][parent]
        ranks[d, :, d] = rank
    # every kept prefix, in rank-tuple order (stable sorts from the last element to the first), then best first
    flat_ranks = ranks.view(-1, depth_limit)
    lex = torch.arange(depth_limit * width, device=dev)
    for col in range(depth_limit - 1, -1, -1):
        lex = lex[flat_ranks[lex, col].sort(stable=True).indices]
    pick = lex[_best_first(scores.view(-1)[lex], valid.view(-1)[lex])[:width]]  # [B] ids d * B + slot, pop order
    where = torch.full((depth_limit * width + 1,), -1, dtype=torch.long, device=dev)
    where[pick] = ramp
    depth_of = pick // width
    parent_id = torch.where(depth_of > 0, (depth_of - 1) * width + parent_slot.view(-1)[pick], depth_limit * width)
    pad = ~valid.view(-1)[pick]  # valid picks come first: padding below the root (never accepted)
    out = DeviceTree(tokens.view(-1)[pick].masked_fill(pad, 0), where[parent_id].masked_fill(pad, -1),
                     (depth_of + 1).masked_fill(pad, 1), scores.view(-1)[pick].masked_fill(pad, float("-inf")),
                     width)
    return out, (~pad).sum()


def _best_first(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Indices ordered valid first, then by score descending, equal scores by index (two stable sorts)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[torch.sort((~valid[order]).to(torch.uint8), stable=True).indices]


def padded_tree(width: int, count: int, dev: torch.device) -> DeviceTree:
    """``[width]`` padding nodes only (token 0, parent -1, depth 1, score ``-inf``) with ``count`` real nodes."""
    z = torch.zeros(width, dtype=torch.long, device=dev)
    return DeviceTree(z, z - 1, z + 1, torch.full((width,), float("-inf"), dtype=torch.float64, device=dev), count)


def chain_device(logits: torch.Tensor, length: torch.Tensor | None = None) -> DeviceTree:
    """The DFlash chain (:func:`~spiffy.arspec.tree.build_chain`: the argmax at every depth) as device tensors;
    ``length`` (0-d long, ``<= L``): the chain of the first ``length`` rows, padded to ``L`` nodes (its node count in
    :attr:`DeviceTree.real`), as :func:`ddtree_device` takes it."""
    depth_limit = int(logits.shape[0])
    dev = logits.device
    if depth_limit == 0:
        return padded_tree(0, 0, dev)
    tok = logits.argmax(dim=-1)
    work = logits if logits.dtype == torch.float64 else logits.float()
    best = torch.log_softmax(work, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ramp = torch.arange(depth_limit, device=dev)
    return cut_chain(DeviceTree(tok.long(), ramp - 1, ramp + 1, best.double().cumsum(0), depth_limit), length)


def cut_chain(chain: DeviceTree, length: torch.Tensor | None) -> DeviceTree:
    """A chain of ``L`` nodes (node ``i`` at depth ``i + 1``) cut to its first ``length`` (0-d long, data) and padded
    back to ``L`` (its node count in :attr:`DeviceTree.real`); ``None``: the chain as it is."""
    if length is None:
        return chain
    n = int(chain.tokens.numel())
    pad = torch.arange(n, device=chain.tokens.device) >= length  # past the draft: padding below the root
    return DeviceTree(chain.tokens.masked_fill(pad, 0), chain.parents.masked_fill(pad, -1),
                      chain.depths.masked_fill(pad, 1), chain.scores.masked_fill(pad, float("-inf")), n,
                      length.clamp(max=n).to(torch.long).reshape(()))


def ancestor_visibility(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N, N]`` bool: ``out[b, i, j]`` = node ``j`` is node ``i`` or an ancestor of it in row ``b``'s tree
    (``parents [B, N]``), in ``max_depth`` vectorised steps (no host synchronisation)."""
    rows, n = int(parents.shape[0]), int(parents.shape[1])
    dev = parents.device
    vis = torch.zeros(rows, n, n + 1, dtype=torch.bool, device=dev)  # column n: where finished walks write
    cur = torch.arange(n, device=dev).expand(rows, n)
    for _ in range(int(max_depth)):
        col = torch.where(cur >= 0, cur, n)
        vis.scatter_(2, col.unsqueeze(-1), True)
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur)
    return vis[:, :, :n]


def position_noise(samplings: list[SamplingConfig], root_positions: list[int], depth: int, vocab: int,
                   device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, depth + 1, V]`` the Gumbel noise of each row's positions ``root + 1 .. root + depth + 1``
    (:func:`~spiffy.arspec.sampling.gumbel_noise`, the eager rule's noise), ``None`` when every row is greedy.
    Greedy rows get zeros (never read)."""
    if all(float(s.temperature) == 0 for s in samplings):
        return None
    out = torch.zeros(len(samplings), depth + 1, vocab, dtype=dtype, device=device)
    for b, (s, root) in enumerate(zip(samplings, root_positions)):
        if float(s.temperature) > 0:
            for j in range(depth + 1):
                out[b, j] = gumbel_noise(keyed_seed(s), root + j + 1, vocab, device, dtype)
    return out


@dataclass
class WalkResult:
    """The coupled walk of every batch row (device tensors).

    Attributes:
        accepted: ``[B]`` accepted nodes per row; bonus: ``[B]`` the target's token after the last one.
        keep: ``[B, D + 1]`` verification rows to keep, root first (row ``j`` valid for ``j <= accepted``).
        kept_tokens: ``[B, D + 1]`` their tokens (root first).
    """

    accepted: torch.Tensor
    bonus: torch.Tensor
    keep: torch.Tensor
    kept_tokens: torch.Tensor


def target_tokens(logits: torch.Tensor, row_depths: torch.Tensor, samplings: list[SamplingConfig],
                  noise: torch.Tensor | None) -> torch.Tensor:
    """``[B, R]`` the target's draw at every verification row (``logits [B, R, V]``; ``row_depths [B, R]``: the
    row's depth, the root 0): the argmax, or the filtered tempered logits plus the noise of the row's position
    (:func:`~spiffy.arspec.sampling.sample_tokens`' rule)."""
    greedy = logits.argmax(dim=-1)
    if noise is None:
        return greedy
    out = greedy.clone()
    for b, s in enumerate(samplings):
        if float(s.temperature) > 0:
            scores = filter_logits(tempered(logits[b], float(s.temperature)), int(s.top_k), float(s.top_p),
                                   nucleus="reaches")
            out[b] = (scores + noise[b][row_depths[b]].to(scores.dtype)).argmax(dim=-1)
    return out


def coupled_walk(ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, counts: torch.Tensor,
                 drawn: torch.Tensor, max_depth: int) -> WalkResult:
    """:class:`~spiffy.arspec.rules.CoupledRule` on every row at once.

    Args:
        ids: ``[B, R]`` verification rows' tokens (row 0 the root, row ``i + 1`` node ``i``).
        parents, depths: ``[B, N]`` (``N = R - 1``); counts: ``[B]`` real nodes per row (the rest is padding).
        drawn: ``[B, R]`` the target's token at every row (:func:`target_tokens`).
        max_depth: the deepest node (static).
    """
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    n = width - 1
    dev = ids.device
    if n == 0:
        keep = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        return WalkResult(torch.zeros(rows, dtype=torch.long, device=dev), drawn[:, 0], keep, ids[:, :1])
    real = torch.arange(n, device=dev).unsqueeze(0) < counts.view(-1, 1)
    match = real & (ids[:, 1:] == drawn.gather(1, parents + 1))
    acc = torch.zeros(rows, width, dtype=torch.bool, device=dev)  # by verification row; row 0 (root) accepted
    acc[:, 0] = True
    for _ in range(int(max_depth)):
        acc[:, 1:] = match & acc.gather(1, parents + 1)
    node_acc = acc[:, 1:]
    accepted = node_acc.sum(dim=1)
    slot = torch.where(node_acc, depths, max_depth + 1)  # accepted node i -> its depth (one per depth)
    keep = torch.zeros(rows, max_depth + 2, dtype=torch.long, device=dev)
    keep.scatter_(1, slot, torch.arange(1, width, device=dev).expand(rows, n))
    keep = keep[:, : max_depth + 1]
    deepest = keep.gather(1, accepted.view(-1, 1)).view(-1)
    return WalkResult(accepted, drawn.gather(1, deepest.view(-1, 1)).view(-1), keep, ids.gather(1, keep))
