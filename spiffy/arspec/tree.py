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

Only the ranks the heap can reach are materialised. Let ``U_d`` be the score of the argmax chain down to depth
``d`` (the best score at that depth). Any ``B`` distinct prefixes bound the ``B``-th best score ``S_B`` from below;
the builder takes the "comb" of prefixes (argmax chain to depth ``d - 1``, then the maximum of one column chunk of
depth ``d``), whose scores need only the chunk maxima of one vectorised pass, and calls the ``B``-th best of them
``LB``. A token at depth ``d`` can only enter the tree if ``U_{d-1} + log q_d(v) >= S_B >= LB``, so each depth keeps
the tokens above ``LB - U_{d-1}`` (capped at ``K``), read again only inside the chunks whose maximum clears that
bar (about ``B`` chunks over all depths, instead of ``K`` tokens at every depth). Scores are the same
float64 sums, added in the same order, as the heap's, and the bar is lowered by a small margin, so the excluded
tokens are exactly ones the heap would never pop: the tree is identical to the one built from the full top-``K``
of every depth.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from spiffy.errors import ConfigError
from spiffy.topk import top_ranked

__all__ = ["DraftTree", "build_ddtree", "build_chain", "empty_tree", "ranked_candidates"]


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

    The ranks come from :func:`ranked_candidates` (one chunk-maximum pass over ``[L, V]``, then only the
    reachable tokens); the heap holds at most ``2 * budget`` entries. Host synchronisations: a constant handful,
    whatever the budget and the vocabulary.
    """
    if budget < 0:
        raise ConfigError(f"tree budget must be >= 0, got {budget}; fix: pass budget=0 (plain AR) or more")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [L, V], got shape {tuple(logprobs.shape)}")
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    if budget == 0 or depth_limit == 0 or vocab == 0:
        return empty_tree()
    k = min(int(budget), vocab)
    vals, idx = ranked_candidates(logprobs, int(budget), k)
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
        if r + 1 < len(vals[d]):  # next sibling (ranks beyond the list can never be popped)
            heapq.heappush(heap, (-(parent_score + vals[d][r + 1]), ranks[:-1] + (r + 1,), d, parent, parent_score))
        if d + 1 < depth_limit and vals[d + 1]:  # first child
            heapq.heappush(heap, (-(score + vals[d + 1][0]), ranks + (0,), d + 1, node, score))
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        torch.tensor(scores, dtype=torch.float64),
    )


#: chunk widths for the comb bound, widest first; a row needs at least :data:`_MIN_CHUNKS` of them
_CHUNK_WIDTHS: tuple[int, ...] = (64, 32, 16)
_MIN_CHUNKS = 8


def _bar_margin(lb: float, reach: torch.Tensor) -> torch.Tensor:
    """How far below ``LB - U_{d-1}`` the per-depth bar goes: far above float64 rounding of the sums involved,
    far below the spacing of float32 log-probabilities, so it only ever admits a few more tokens."""
    return 1e-9 * (1.0 + abs(lb) + reach.abs())


def ranked_candidates(logprobs: torch.Tensor, budget: int, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per depth, the tokens a ``budget``-node DDTree can use, best first (ties by token id), at most ``k`` each.

    Args:
        logprobs: ``[L, V]`` per-depth log-probabilities.
        budget: the tree's node budget ``B`` (``>= 1``).
        k: the rank cap per depth (``min(B, V)``).
    Returns:
        ``(values, tokens)``: ``values[d]`` the log-probabilities (Python floats of the float64 conversion) and
        ``tokens[d]`` the token ids of depth ``d + 1``'s ranks, a prefix of that depth's full ranking (every
        token at least as probable as a listed one is listed, up to ``k``); depth 1 is never empty.

    See the module docstring for the bound. Small vocabularies, and rows whose bound is not finite (``-inf``
    log-probabilities everywhere but a few tokens), take the top ``k`` of every depth instead.
    """
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    width = next((s for s in _CHUNK_WIDTHS if vocab // s >= _MIN_CHUNKS), None)
    if width is not None and depth_limit * (vocab // width) >= budget:
        x = logprobs.contiguous()
        n_chunks = vocab // width
        head_len = n_chunks * width
        chunks = x.as_strided((depth_limit, n_chunks, width), (vocab, width, 1))  # [L, C, w]
        chunk_max = chunks.amax(dim=-1)  # [L, C]
        tail = x[:, head_len:]  # [L, < w]
        best = chunk_max.amax(dim=-1)
        if tail.shape[1]:
            best = torch.maximum(best, tail.amax(dim=-1))
        # U_{d-1}: the argmax chain's scores, added in the heap's order (float64 Python sums)
        reach_list = [0.0]
        for m in best.double().tolist()[:-1]:
            reach_list.append(reach_list[-1] + m)
        reach = torch.tensor(reach_list, dtype=torch.float64, device=x.device).unsqueeze(1)  # [L, 1]
        comb = (reach + chunk_max.double()).reshape(-1)  # [L * C] scores of distinct prefixes
        lb = float(torch.topk(comb, budget, sorted=False).values.min())
        if math.isfinite(lb):
            bar = lb - reach - _bar_margin(lb, reach)  # [L, 1] float64: a token below it is never popped
            picked = (chunk_max.double() >= bar).nonzero()  # [n, 2] (depth, chunk), chunks ascending
            blocks = chunks[picked[:, 0], picked[:, 1]]  # [n, w]
            hit = (blocks.double() >= bar.index_select(0, picked[:, 0])).nonzero()  # [m, 2] (block, offset)
            rows = picked[:, 0].index_select(0, hit[:, 0])
            cols = picked[:, 1].index_select(0, hit[:, 0]) * width + hit[:, 1]
            cand = blocks[hit[:, 0], hit[:, 1]]
            tail_hit = (tail.double() >= bar).nonzero()  # run even when empty: a fixed sync count
            rows = torch.cat([rows, tail_hit[:, 0]])
            cols = torch.cat([cols, tail_hit[:, 1] + head_len])
            cand = torch.cat([cand, tail[tail_hit[:, 0], tail_hit[:, 1]]])
            # per depth, columns ascending (head chunks, then the tail); stable sorts keep that order for ties
            order = torch.sort(cand, descending=True, stable=True).indices
            order = order.index_select(0, torch.sort(rows.index_select(0, order), stable=True).indices)
            counts = torch.bincount(rows, minlength=depth_limit).tolist()
            flat_vals = cand.index_select(0, order).double().tolist()
            flat_ids = cols.index_select(0, order).tolist()
            values: list[list[float]] = []
            tokens: list[list[int]] = []
            start = 0
            for c in counts:
                values.append(flat_vals[start : start + min(c, k)])
                tokens.append(flat_ids[start : start + min(c, k)])
                start += c
            return values, tokens
    vals_t, idx_t = top_ranked(logprobs, k)
    return vals_t.double().cpu().tolist(), idx_t.cpu().tolist()


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
