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

Ties are broken deterministically by the rank tuple (lexicographically smaller first), which also guarantees
parents before children when a child is exactly as probable as its parent (a probability-1 token).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from spiffy.errors import ConfigError

__all__ = ["DraftTree", "build_ddtree", "build_chain", "empty_tree"]


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
            ``d - 1``).
    All tensors live on the CPU (they drive host-side bookkeeping).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    samples: dict[int, list[int]] | None = None
    proposal: torch.Tensor | None = None

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

    One ``torch.topk`` over the vocabulary for all depths; the heap holds at most ``2 * budget`` entries.
    """
    if budget < 0:
        raise ConfigError(f"tree budget must be >= 0, got {budget}; fix: pass budget=0 (plain AR) or more")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [L, V], got shape {tuple(logprobs.shape)}")
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    if budget == 0 or depth_limit == 0 or vocab == 0:
        return empty_tree()
    k = min(int(budget), vocab)
    vals_t, idx_t = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    vals = vals_t.double().cpu().tolist()
    idx = idx_t.cpu().tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # heap entry: (-score, rank tuple, depth index (0-based), parent node index, parent score)
    heap: list[tuple[float, tuple[int, ...], int, int, float]] = [(-vals[0][0], (0,), 0, -1, 0.0)]
    while heap and len(tokens) < budget:
        neg, ranks, d, parent, parent_score = heapq.heappop(heap)
        node = len(tokens)
        r = ranks[-1]
        score = -neg
        tokens.append(idx[d][r])
        parents.append(parent)
        depths.append(d + 1)
        scores.append(score)
        if r + 1 < k:  # next sibling
            heapq.heappush(heap, (-(parent_score + vals[d][r + 1]), ranks[:-1] + (r + 1,), d, parent, parent_score))
        if d + 1 < depth_limit:  # first child
            heapq.heappush(heap, (-(score + vals[d + 1][0]), ranks + (0,), d + 1, node, score))
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        torch.tensor(scores, dtype=torch.float64),
    )


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
