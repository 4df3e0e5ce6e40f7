"""DDTree: the optimal draft tree under a node budget (SPEC §7, DDTree paper Alg. 1).

Given the drafter's per-depth log-probabilities ``log q_d(v)`` for depths ``d = 1..L``, the surrogate value of a
tree ``T`` (a prefix-closed set of token sequences) is ``sum_{u in T} prod_i q_i(u_i)``. The ``B`` prefixes with
the largest product probability form a prefix-closed set (a prefix is at least as probable as any extension), so
the optimum is simply the top-``B`` prefixes. They are enumerated best-first without materialising ``V^L``
candidates: keep only the top-``K`` tokens per depth (``K = min(B, V)``, enough because a node of rank ``r`` at
some depth needs its ``r - 1`` better siblings in the tree first), identify a node by its tuple of per-depth ranks,
and run a max-heap seeded with ``(0,)``. Popping a node adds it to the tree and pushes its next sibling (last rank
+ 1) and its first child (rank 0 appended). Each push scores no better than the popped node, so pops come out in
globally best-first order and every node's parent is popped before it.

Ties are broken deterministically. Inside a depth, tokens are ranked by log-probability descending and equal
log-probabilities by token id ascending (:func:`spiffy.topk.top_ranked`'s rule). In the heap, equal scores pop by
rank tuple (lexicographically smaller first), which also guarantees parents before children when a child is exactly
as probable as its parent (a probability-1 token).

Only the ranks the heap can reach are materialised (:mod:`spiffy.arspec.tree_ranks`): on large vocabularies a
bound on the ``B``-th best score keeps the few tokens that can clear it; otherwise each depth's ranks are read
lazily, the top 16 first and more only for a depth whose last rank the heap pops. The heap runs in Python
(``O(B log B)``; rank tuples are kept as integers with the same order, see :func:`build_ddtree`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from spiffy.errors import ConfigError
from spiffy.torch_utils import host_tensor
from spiffy.arspec.tree_ranks import ranked_candidates

__all__ = ["DraftTree", "NodeProposals", "build_ddtree", "build_chain", "empty_tree"]


@dataclass
class NodeProposals:
    """Proposals that depend on the node the draws hang below (a DFlash2 selector's, :mod:`spiffy.arspec.selector`).

    Attributes:
        vocab_size: ``V``.
        rows: ``{parent index or -1: (token ids [K] long, probabilities [K] float64)}``, CPU; tokens not listed have
            probability 0.
    """

    vocab_size: int
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def dense(self, node: int) -> torch.Tensor | None:
        """``[V]`` float64 probabilities below ``node`` (``None``: nothing was drawn below it)."""
        row = self.rows.get(node)
        if row is None:
            return None
        tokens, probs = row
        # repeated tokens add up, in the candidates' order (as the device twin's scatter_add_ adds them)
        return torch.zeros(self.vocab_size, dtype=torch.float64).scatter_add_(0, tokens.long(), probs.double())


@dataclass
class DraftTree:
    """A draft tree hanging below a root (the bonus token, not stored here).

    Attributes:
        tokens: ``[N]`` long token id of each node (``N`` = number of nodes, root excluded).
        parents: ``[N]`` long index of each node's parent, ``-1`` for children of the root. Parents precede children.
        depths: ``[N]`` long depth of each node (children of the root have depth 1).
        scores: ``[N]`` float cumulative log-probability of each node's prefix under the drafter.
        samples: for trees of sampled drafts (:mod:`spiffy.arspec.selfselect`): ``{parent index or -1: [tokens]}``,
            the i.i.d. draws below each node, in draw order, duplicates included (the rejection rule needs the
            multiset and its order); ``None`` when the children are chosen deterministically (argmax, top-B).
        proposal: with ``samples``: ``[D, V]`` float64 CPU probabilities the depth-``d`` draws came from (row
            ``d - 1``), or :class:`NodeProposals` when they depend on the node they hang below.
    All tensors live on the CPU (they drive host-side bookkeeping).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    samples: dict[int, list[int]] | None = None
    proposal: torch.Tensor | NodeProposals | None = None

    def proposal_below(self, node: int, depth: int) -> torch.Tensor | None:
        """``[V]`` float64 probabilities the draws below ``node`` (at depth ``depth``, the root's is 0) came from."""
        if isinstance(self.proposal, NodeProposals):
            return self.proposal.dense(node)
        return None if self.proposal is None else self.proposal[depth]

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def __len__(self) -> int:
        return self.num_nodes

    def children_lookup(self) -> dict[tuple[int, int], int]:
        """``{(parent index or -1, token): node index}`` (sibling tokens are distinct)."""
        return {(p, t): i for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist()))}

    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0


def empty_tree() -> DraftTree:
    """A tree with no nodes (root only: plain AR)."""
    z = torch.zeros(0, dtype=torch.long)
    return DraftTree(z, z.clone(), z.clone(), torch.zeros(0, dtype=torch.float64))


def build_ddtree(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """Best-first construction of the optimal ``budget``-node draft tree.

    Args:
        logprobs: ``[L, V]`` per-depth log-probabilities (row ``d`` = depth ``d + 1``), any device / float dtype.
        budget: maximum number of nodes (root excluded); ``0`` gives an empty tree; more than the number of
            available prefixes (``sum_d K^d``) gives all of them.
    Returns:
        :class:`DraftTree` with nodes in pop order (non-increasing score; parents before children).

    The ranks come from :func:`~spiffy.arspec.tree_ranks.ranked_candidates` (only the reachable tokens, or each
    depth's best ranks read as the heap needs them); the heap holds at most ``2 * budget`` entries. Host
    synchronisations: a constant handful, plus two for each depth whose ranks are read further.
    """
    if budget < 0:
        raise ConfigError(f"tree budget must be >= 0, got {budget}; fix: pass budget=0 (plain AR) or more")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [L, V], got shape {tuple(logprobs.shape)}")
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    if budget == 0 or depth_limit == 0 or vocab == 0:
        return empty_tree()
    k = min(int(budget), vocab)
    ranks = ranked_candidates(logprobs, int(budget), k)
    vals, idx = ranks.values, ranks.tokens  # lists a lazy ranking extends in place (RankedDepths.grow)
    sizes = [len(v) for v in vals]
    # a node's rank tuple (r_1, ..., r_n) as the integer sum of (r_i + 1) * base ** (L - i): tuples and integers
    # order alike (a prefix before its extensions), and a sibling / first child is one addition away
    base = k + 1
    place = [base ** (depth_limit - 1 - i) for i in range(depth_limit)]
    last_depth = depth_limit - 1
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # heap entry: (-score, rank key, rank, depth index (0-based), parent node index, parent score); rank keys are
    # distinct, so entries never compare past them
    heap: list[tuple[float, int, int, int, int, float]] = [(-vals[0][0], place[0], 0, 0, -1, 0.0)]
    while heap and len(tokens) < budget:
        neg, key, r, d, parent, parent_score = heapq.heappop(heap)
        node = len(tokens)
        score = -neg
        tokens.append(idx[d][r])
        parents.append(parent)
        depths.append(d + 1)
        scores.append(score)
        if r + 1 == sizes[d] and r + 1 < k:  # the heap reached the end of this depth's list: read further ranks
            sizes[d] = ranks.grow(d)
        if r + 1 < sizes[d]:  # next sibling (ranks beyond a final list can never be popped)
            heapq.heappush(heap, (-(parent_score + vals[d][r + 1]), key + place[d], r + 1, d, parent, parent_score))
        if d < last_depth and sizes[d + 1]:  # first child
            heapq.heappush(heap, (-(score + vals[d + 1][0]), key + place[d + 1], 0, d + 1, node, score))
    # one packed buffer for the three integer fields (several times faster than ``torch.tensor`` on lists); the
    # tensors are views of it and keep it alive
    n = len(tokens)
    packed = host_tensor(tokens + parents + depths, torch.long)
    return DraftTree(packed[:n], packed[n : 2 * n], packed[2 * n :], host_tensor(scores, torch.float64))


def build_chain(logits: torch.Tensor) -> DraftTree:
    """Vanilla DFlash as a tree: the argmax at every depth, chained (``L`` nodes for ``[L, V]`` logits)."""
    depth_limit = int(logits.shape[0])
    if depth_limit == 0:
        return empty_tree()
    tok = logits.argmax(dim=-1)
    work = logits if logits.dtype == torch.float64 else logits.float()
    best = torch.log_softmax(work, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    tokens = tok.cpu()
    return DraftTree(
        tokens.to(torch.long),
        torch.arange(-1, depth_limit - 1, dtype=torch.long),
        torch.arange(1, depth_limit + 1, dtype=torch.long),
        best.cpu().double().cumsum(0),
    )
