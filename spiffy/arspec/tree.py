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
#: the comb is thinned to about this many scores per budget node (:func:`_comb_bound`)
_COMB_PER_NODE = 4
#: up to this many comb scores the bound is selected on the host, beyond it on the device
_HOST_COMB_MAX = 256
#: up to this many candidate tokens they are ranked on the host, beyond it on the device
_HOST_RANK_MAX = 128


def _bar_margin_scale(depth_limit: int, dtype: torch.dtype) -> float:
    """How far below ``LB - U_{d-1}`` the per-depth bar goes, relative to ``1 + |LB| + |U_{d-1}|``.

    The device-side bound sums (``torch.cumsum``, the comb) are rounded in ``dtype``, the heap's in float64 in its
    own order: they differ by at most about ``L + 1`` rounding steps of ``dtype``, and the bar itself is rounded to
    ``dtype``. The margin is several times that (and at least ``1e-9``) and far below the gaps between the
    log-probabilities that matter, so it only ever admits a few more tokens, never drops one the heap could pop.
    """
    return max(8.0 * (depth_limit + 2) * torch.finfo(dtype).eps, 1e-9)


def _comb_bound(chunk_max: torch.Tensor, best: torch.Tensor, budget: int) -> tuple[float, list[float]]:
    """``(LB, U)``: a lower bound of the ``budget``-th best score and ``U_{d-1}`` per depth (``U_0 = 0``).

    Args:
        chunk_max: ``[L, C]`` chunk maxima; ``best``: ``[L]`` row maxima (both in the working dtype).
    Only a lower bound of ``S_B`` is needed, so the comb is thinned first: each row's chunks are split into ``G``
    disjoint groups with ``L * G`` about ``4 B`` (contiguous runs of chunks when ``G`` is small, every ``G``-th
    chunk when it is large: the reduction that vectorises), and a group keeps its best chunk. A group's maximum is
    still one prefix's comb score, so the ``B``-th best of the ``L * G`` group scores is a lower bound. Few scores
    go to the host and are summed there exactly as the heap sums (float64, its order); more are summed and selected
    on the device. Either way one host synchronisation.
    """
    depth_limit, n_chunks = int(chunk_max.shape[0]), int(chunk_max.shape[1])
    groups = min(n_chunks, max(1, -(-_COMB_PER_NODE * budget // depth_limit)))
    folded = chunk_max
    if groups < n_chunks:
        runs = n_chunks // groups
        head = chunk_max[:, : runs * groups]
        if groups >= 64:
            folded = head.view(depth_limit, runs, groups).amax(dim=1)
        else:
            folded = head.view(depth_limit, groups, runs).amax(dim=2)
    if depth_limit * groups <= _HOST_COMB_MAX:
        rows = torch.cat([best.unsqueeze(1), folded], dim=1).tolist()  # [L, 1 + G]
        reach = [0.0]
        for row in rows[:-1]:
            reach.append(reach[-1] + row[0])
        comb = sorted((u + v for u, row in zip(reach, rows) for v in row[1:]), reverse=True)
        return comb[budget - 1], reach
    reach_t = torch.nn.functional.pad(best[:-1], (1, 0)).cumsum(0)  # [L]
    comb_t = (folded + reach_t.unsqueeze(1)).view(-1)  # [L * G]
    lb_t = torch.topk(comb_t, budget, sorted=False).values.min()
    summary = torch.cat([best, lb_t.view(1)]).tolist()
    reach = [0.0]
    for m in summary[: depth_limit - 1]:
        reach.append(reach[-1] + m)
    return summary[-1], reach


def _rank_on_host(vals: list[float], rows: list[int], cols: list[int], depth_limit: int, k: int
                  ) -> tuple[list[list[float]], list[list[int]]]:
    """Per depth, the candidates by value descending, equal values by column ascending, at most ``k``."""
    per_depth: list[list[tuple[float, int]]] = [[] for _ in range(depth_limit)]
    for v, r, c in zip(vals, rows, cols):
        per_depth[r].append((-v, c))
    values: list[list[float]] = []
    tokens: list[list[int]] = []
    for entries in per_depth:
        entries.sort()
        del entries[k:]
        values.append([-nv for nv, _ in entries])
        tokens.append([c for _, c in entries])
    return values, tokens


def _rank_on_device(cand: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, depth_limit: int, k: int
                    ) -> tuple[list[list[float]], list[list[int]]]:
    """:func:`_rank_on_host` with two stable sorts on the device (``cand`` / ``rows`` / ``cols``: ``[m]``, each
    depth's entries in ascending column order), for many candidates."""
    order = torch.sort(cand, descending=True, stable=True).indices
    order = order.index_select(0, torch.sort(rows.index_select(0, order), stable=True).indices)
    counts_and_ids = torch.cat([torch.bincount(rows, minlength=depth_limit), cols.index_select(0, order)])
    flat_vals = cand.index_select(0, order).tolist()
    packed = counts_and_ids.tolist()
    values: list[list[float]] = []
    tokens: list[list[int]] = []
    start = depth_limit
    for c in packed[:depth_limit]:
        stop = start + min(c, k)
        values.append(flat_vals[start - depth_limit : stop - depth_limit])
        tokens.append(packed[start:stop])
        start += c
    return values, tokens


def ranked_candidates(logprobs: torch.Tensor, budget: int, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per depth, the tokens a ``budget``-node DDTree can use, best first (ties by token id), at most ``k`` each.

    Args:
        logprobs: ``[L, V]`` per-depth log-probabilities.
        budget: the tree's node budget ``B`` (``>= 1``).
        k: the rank cap per depth (``min(B, V)``).
    Returns:
        ``(values, tokens)``: ``values[d]`` the log-probabilities (Python floats, exact conversions of the entries)
        and ``tokens[d]`` the token ids of depth ``d + 1``'s ranks, a prefix of that depth's full ranking (every
        token at least as probable as a listed one is listed, up to ``k``); depth 1 is never empty.

    See the module docstring for the bound. Host synchronisations: five (the bound, two ``nonzero``, two lists).
    Small vocabularies, and rows whose bound is not finite (``-inf`` log-probabilities everywhere but a few
    tokens), take the top ``k`` of every depth instead.
    """
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    width = next((s for s in _CHUNK_WIDTHS if vocab // s >= _MIN_CHUNKS), None)
    if width is not None and depth_limit * (vocab // width) >= budget:
        x = logprobs.contiguous()
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        n_chunks = vocab // width
        head_len = n_chunks * width
        chunks = x.as_strided((depth_limit, n_chunks, width), (vocab, width, 1))  # [L, C, w]
        chunk_max = chunks.amax(dim=-1).to(work)  # [L, C]
        best = chunk_max.amax(dim=-1)  # [L] each depth's best log-probability
        tail = None
        if head_len < vocab:  # the last columns, padded to one more block of w (-inf never clears a bar)
            tail = torch.nn.functional.pad(x[:, head_len:], (0, head_len + width - vocab), value=float("-inf"))
            best = torch.maximum(best, tail.amax(dim=-1).to(work))
        lb, reach = _comb_bound(chunk_max, best, budget)
        if math.isfinite(lb):
            scale = _bar_margin_scale(depth_limit, work)
            bar = torch.tensor([lb - u - scale * (1.0 + abs(lb) + abs(u)) for u in reach], dtype=work,
                               device=x.device).unsqueeze(1)  # [L, 1]: a token below it is never popped
            picked = (chunk_max >= bar).nonzero()  # [n, 2] (depth, chunk), row-major
            rows, chunk = picked.unbind(1)
            blocks = chunks[rows, chunk]  # [n, w]
            first_col = chunk * width
            if tail is not None:  # every depth's tail block, after the picked ones
                blocks = torch.cat([blocks, tail])
                rows = torch.cat([rows, torch.arange(depth_limit, device=x.device)])
                first_col = torch.cat([first_col, torch.full((depth_limit,), head_len, device=x.device)])
            hit = (blocks >= bar.index_select(0, rows)).nonzero()  # [m, 2] (block, offset)
            block, offset = hit.unbind(1)
            rows = rows.index_select(0, block)
            cols = first_col.index_select(0, block).add_(offset)
            cand = blocks[block, offset]
            # each depth's entries are in ascending column order here (the tail blocks come last and hold the
            # last columns); both rankings keep that order between equal values
            if int(hit.shape[0]) <= _HOST_RANK_MAX:
                where = torch.cat([rows, cols]).tolist()
                m = len(where) // 2
                return _rank_on_host(cand.tolist(), where[:m], where[m:], depth_limit, k)
            return _rank_on_device(cand, rows, cols, depth_limit, k)
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
