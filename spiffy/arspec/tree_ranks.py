"""Which tokens of each depth a DDTree of ``B`` nodes can use, best first: the ranks :func:`build_ddtree` reads.

Every depth's tokens are ranked by log-probability descending, equal values by token id ascending
(:func:`spiffy.topk.top_ranked`'s rule); the heap of :func:`~spiffy.arspec.tree.build_ddtree` needs, per depth,
a prefix of that ranking at most ``K = min(B, V)`` long, and only as far as it pops. Two ways to give it:

**The comb bound** (large vocabularies). Let ``U_d`` be the score of the argmax chain down to depth
``d`` (the best score at that depth). Any ``B`` distinct prefixes bound the ``B``-th best score ``S_B`` from below;
the builder takes a "comb" of prefixes (argmax chain to depth ``d - 1``, then the best token of one column set of
depth ``d``: the maxima of disjoint groups of column chunks, about ``4 B`` of them in all), whose scores need only
the chunk maxima of one vectorised pass, and calls the ``B``-th best of them ``LB``. A token at depth ``d`` can only
enter the tree if ``U_{d-1} + log q_d(v) >= S_B >= LB``, so each depth keeps the tokens above ``LB - U_{d-1}``
(capped at ``K``), read again only inside the chunks whose maximum clears that bar (about ``B`` chunks over all
depths, instead of ``K`` tokens at every depth). ``U`` is summed in float64 in the heap's order; the bar is lowered
by a margin far above the rounding of the bound's sums and far below the gaps between log-probabilities, so the
excluded tokens are exactly ones the heap would never pop: the tree is identical to the one built from the full
top-``K`` of every depth. The log-probabilities are used exactly as given (their float32 / float64 values, no
renormalisation), so the tree is a function of the ``logprobs`` tensor alone.

**Lazy ranks** (small vocabularies, a flat drafter whose bound lets too many candidates through, or rows whose
bound is not finite). Each depth's top 16 first (one ``torch.topk`` over ``[L, V]``); when the heap pops a depth's
last listed rank, that depth alone is ranked further (at least four times as deep, at most ``K``). A peaked drafter
reads a handful of ranks per depth and a flat one spreads the tree over the first depth's ranks, so reading
``K`` ranks of every depth (the reference algorithm's ``topk(K)``; at ``V = 4,096`` and ``K > 64`` a
partial sort of every row) is wasted work. The grown list is the same ranking's longer prefix, so the tree is
identical to the one built from every depth's full top ``K``.

Costs (one CPU thread, ``L = 16``, ``V = 151,936``): one pass of chunk maxima over ``[L, V]`` (chunks of 128 or
256 columns for small budgets, where about ``B`` chunks are read again, 64 otherwise), then a fixed handful of
small tensor operations and at most five host synchronisations.
"""

from __future__ import annotations

import math

import torch

from spiffy.topk import top_ranked
from spiffy.torch_utils import host_tensor

__all__ = ["RankedDepths", "ranked_candidates"]


#: chunk widths for the comb bound, widest first; a row needs at least :data:`_MIN_CHUNKS` of them
_CHUNK_WIDTHS: tuple[int, ...] = (256, 128, 64, 32, 16)
_MIN_CHUNKS = 8
#: a chunk wider than 64 columns is used only while ``width * budget`` (about the columns read again) stays below this
_WIDE_READ_LIMIT = 16384
#: the comb is thinned to about this many scores per budget node (:func:`_comb_summary`)
_COMB_PER_NODE = 4
#: up to this many comb scores the bound is selected on the host, beyond it on the device
_HOST_COMB_MAX = 1024
#: up to this many candidate tokens they are ranked on the host, beyond it on the device
_HOST_RANK_MAX = 256
#: up to this vocabulary size the ranks are lazy (:func:`_lazy_ranks`, from ``torch.topk``: :func:`_direct_top_k`):
#: below it the bound's fixed cost (a dozen small tensor operations) and the many candidates a flat
#: small-vocabulary drafter lets through cost more than a partial sort of a few ranks per row
_DIRECT_TOPK_MAX_VOCAB = 16384
#: the chunk pass gives up for lazy ranks (:func:`_lazy_ranks`) when the chunks to read again hold more
#: than this share of the ``[L, V]`` entries, or when more candidates than this many per budget node clear the bars
#: (a flat drafter: the comb bound is loose when the best prefixes all sit at the first depths, and ranking every
#: candidate would cost more than the rows' own selection)
_REREAD_SHARE = 1 / 4
_MAX_CANDIDATES_PER_NODE = 8


def _candidate_limit(budget: int) -> int:
    """The most candidate tokens the comb bound may let through before lazy ranks are cheaper."""
    return _MAX_CANDIDATES_PER_NODE * budget + _HOST_RANK_MAX


def _chunk_width(vocab: int, budget: int) -> int | None:
    """The chunk width of the maximum pass (``None``: too few columns, rank whole rows instead).

    Wide chunks make the pass cheaper (fewer, longer reductions) but every chunk that clears a bar is read again
    whole, about ``budget`` of them: widths above 64 are kept for small budgets. A width of at least 64 that divides
    the vocabulary (no tail block to handle apart) is preferred to a wider one.
    """
    usable = [s for s in _CHUNK_WIDTHS if vocab // s >= _MIN_CHUNKS and (s <= 64 or s * budget <= _WIDE_READ_LIMIT)]
    if not usable:
        return None
    return next((s for s in usable if s >= 64 and vocab % s == 0), usable[0])


def _bar_margin_scale(depth_limit: int, dtype: torch.dtype) -> float:
    """How far below ``LB - U_{d-1}`` the per-depth bar goes, relative to ``1 + |LB| + |U_{d-1}|``.

    The device-side bound sums (``torch.cumsum``, the comb) are rounded in ``dtype``, the heap's in float64 in its
    own order: they differ by at most about ``L + 1`` rounding steps of ``dtype``, and the bar itself is rounded to
    ``dtype``. The margin is several times that (and at least ``1e-9``) and far below the gaps between the
    log-probabilities that matter, so it only ever admits a few more tokens, never drops one the heap could pop.
    """
    return max(8.0 * (depth_limit + 2) * torch.finfo(dtype).eps, 1e-9)


def _comb_summary(chunk_max: torch.Tensor, tail_max: torch.Tensor | None, budget: int) -> torch.Tensor:
    """``[L, S]`` maxima of disjoint column sets that together cover each row, ``L * S`` about ``4 B``.

    Each row's ``C`` chunk maxima are split into ``G`` groups (contiguous runs of chunks when ``G`` is small, every
    ``G``-th chunk when it is large: the reduction that vectorises) and a group keeps its best; the chunks left over
    by the split and the tail block's maximum are appended as they are.
    """
    depth_limit, n_chunks = int(chunk_max.shape[0]), int(chunk_max.shape[1])
    groups = min(n_chunks, max(1, -(-_COMB_PER_NODE * budget // depth_limit)))
    parts = [chunk_max]
    if groups < n_chunks:
        runs = n_chunks // groups
        head = chunk_max[:, : runs * groups]
        if groups >= 64:
            parts = [head.view(depth_limit, runs, groups).amax(dim=1)]
        else:
            parts = [head.view(depth_limit, groups, runs).amax(dim=2)]
        if runs * groups < n_chunks:
            parts.append(chunk_max[:, runs * groups :])
    if tail_max is not None:
        parts.append(tail_max.unsqueeze(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _comb_bound(summary: torch.Tensor, budget: int) -> tuple[float, list[float]]:
    """``(LB, U)`` from :func:`_comb_summary`: a lower bound of the ``budget``-th best score (``-inf`` when fewer
    than ``budget`` comb scores are finite) and ``U_{d-1}`` per depth (``U_0 = 0``).

    Every summary entry is the best log-probability of its own column set, so ``U_{d-1}`` plus it is the score of a
    distinct prefix (the argmax chain to depth ``d - 1``, then that token) and the ``B``-th best of these scores is
    at most ``S_B``; the row maximum is each depth's best log-probability. Few scores go to the host and are summed
    there exactly as the heap sums (float64, in its order); more are summed and selected on the device (the bar's
    margin covers that rounding). Either way one host synchronisation.
    """
    depth_limit = int(summary.shape[0])
    if summary.numel() <= _HOST_COMB_MAX:
        rows = summary.tolist()
        reach = [0.0]
        for row in rows[:-1]:
            reach.append(reach[-1] + max(row))
        comb = sorted((u + v for u, row in zip(reach, rows) for v in row), reverse=True)
        return comb[budget - 1], reach
    best = summary.amax(dim=1)  # [L]
    reach_t = torch.nn.functional.pad(best[:-1], (1, 0)).cumsum(0)  # [L]
    comb_t = (summary + reach_t.unsqueeze(1)).view(-1)
    lb_t = torch.topk(comb_t, budget, sorted=False).values.min()
    summary_row = torch.cat([best, lb_t.view(1)]).tolist()
    reach = [0.0]
    for m in summary_row[: depth_limit - 1]:
        reach.append(reach[-1] + m)
    return summary_row[-1], reach


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


def _direct_top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The top ``k`` of every depth from one ``torch.topk`` (small vocabularies: no bound, no candidate ranking).

    ``torch.topk`` leaves the order of equal values unspecified. Equal values inside a row's top ``k`` are put in
    token-id order on the host; a tie at the boundary (the ``k``-th value reached by more than ``k`` entries: the
    set itself is ambiguous) is settled by the lowest token ids of that value (one ``nonzero`` over the row, for
    such rows only). The boundary shows as the ``k + 1``-th value equal to the ``k``-th; where ``torch.topk`` on a
    CPU would switch to its slower algorithm for ``k + 1`` (it partially sorts up to ``V / 64`` entries), the device
    counts the entries that reach the ``k``-th value instead. Host synchronisations: two (the values, the token
    ids), one more per row tied at the boundary.
    """
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    one_more = k < vocab and ((k + 1) * 64 <= vocab or k * 64 > vocab)
    vals_t, idx_t = torch.topk(logprobs, k + 1 if one_more else k, dim=-1)  # [L, k (+ 1)], sorted descending
    flat = vals_t.double().reshape(-1)
    if not one_more and k < vocab:  # [L] 1.0 where more than k entries reach the k-th value, after the values
        over = ((logprobs >= vals_t[:, k - 1 :]).sum(dim=-1) != k).to(torch.float64)
        flat = torch.cat([flat, over])
    packed = flat.tolist()
    width = k + 1 if one_more else k
    values = [packed[d * width : d * width + k] for d in range(depth_limit)]
    if one_more:
        tied = [d for d in range(depth_limit) if packed[d * width + k] == values[d][-1]]
    else:
        tied = [d for d, over in enumerate(packed[depth_limit * width :]) if over]
    ids = [row[:k] for row in idx_t.tolist()]
    for d in tied:  # the k-th value's entries by column: the lowest ones complete the set
        kth = values[d][-1]
        kept = [(v, t) for v, t in zip(values[d], ids[d]) if v > kth]
        cols = torch.nonzero(logprobs[d] == kth).view(-1)[: k - len(kept)].tolist()
        values[d], ids[d] = [v for v, _ in kept] + [kth] * len(cols), [t for _, t in kept] + cols
    for d in range(depth_limit):
        if len(set(values[d])) < k:  # equal values in unspecified order: token id ascending among them
            ranked = sorted(zip(values[d], ids[d]), key=lambda e: (-e[0], e[1]))
            values[d], ids[d] = [v for v, _ in ranked], [t for _, t in ranked]
    return values, ids


def _rows_top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Every depth's top ``k`` (:func:`_direct_top_k` on small vocabularies, :func:`~spiffy.topk.top_ranked` on
    large ones), as the builder's lists."""
    if int(logprobs.shape[1]) <= _DIRECT_TOPK_MAX_VOCAB:
        return _direct_top_k(logprobs, k)
    vals_t, idx_t = top_ranked(logprobs, k)
    return vals_t.double().cpu().tolist(), idx_t.cpu().tolist()


#: how many ranks of every depth a lazy ranking reads first, and the least depth it grows a list to
_LAZY_FIRST = 16
_LAZY_GROW = 64


class RankedDepths:
    """Per depth, tokens best first as the DDTree heap reads them.

    Attributes:
        values: ``values[d]`` the log-probabilities (Python floats, exact conversions of the entries) of depth
            ``d + 1``'s listed ranks, best first.
        tokens: ``tokens[d]`` their token ids. Each list is a prefix of its depth's full ranking (every token at
            least as probable as a listed one is listed).
    A final ranking (the comb bound's) lists every token the heap can pop; a lazy one (``source`` given) lists each
    depth's top :data:`_LAZY_FIRST` and :meth:`grow` reads one depth further, up to ``cap`` ranks.
    """

    def __init__(self, values: list[list[float]], tokens: list[list[int]], source: torch.Tensor | None = None,
                 cap: int = 0) -> None:
        self.values = values
        self.tokens = tokens
        self._source = source  # [L, V] log-probabilities to read further ranks from (None: final)
        self._cap = int(cap)

    def grow(self, depth: int) -> int:
        """Extend depth ``depth``'s lists in place (the same list objects) and return their new length; a final
        ranking, or a depth already at ``cap`` ranks, stays as it is."""
        have = len(self.values[depth])
        if self._source is None or have >= self._cap:
            return have
        want = min(self._cap, max(4 * have, _LAZY_GROW))
        vals, toks = _rows_top_k(self._source[depth : depth + 1], want)
        # the same ranking rule over the same row: the first ``have`` entries are the ones already listed
        self.values[depth].extend(vals[0][have:])
        self.tokens[depth].extend(toks[0][have:])
        return len(self.values[depth])


def _lazy_ranks(logprobs: torch.Tensor, k: int) -> RankedDepths:
    """Every depth's top ``min(k, 16)`` now, more on demand (:meth:`RankedDepths.grow`)."""
    values, tokens = _rows_top_k(logprobs, min(k, _LAZY_FIRST))
    return RankedDepths(values, tokens, logprobs, k)


def ranked_candidates(logprobs: torch.Tensor, budget: int, k: int) -> RankedDepths:
    """Per depth, the tokens a ``budget``-node DDTree can use, best first (ties by token id), at most ``k`` each.

    Args:
        logprobs: ``[L, V]`` per-depth log-probabilities.
        budget: the tree's node budget ``B`` (``>= 1``).
        k: the rank cap per depth (``min(B, V)``).
    Returns:
        :class:`RankedDepths`: per depth a prefix of that depth's full ranking (every token at least as probable as
        a listed one is listed, up to ``k``); depth 1 is never empty.

    Large vocabularies take the comb bound (module docstring; final lists; host synchronisations: five, the bound,
    two ``nonzero``, two lists). Small vocabularies (up to 16,384), a flat drafter's rows (whose bound lets too
    many candidates through: given up after three synchronisations) and rows whose bound is not finite (``-inf``
    log-probabilities everywhere but a few tokens) take lazy ranks: two synchronisations, two more per depth the
    heap reads past its first 16 ranks.
    """
    depth_limit, vocab = int(logprobs.shape[0]), int(logprobs.shape[1])
    if vocab <= _DIRECT_TOPK_MAX_VOCAB:  # a few ranks per depth from one cheap torch.topk, more on demand
        return _lazy_ranks(logprobs, k)
    width = _chunk_width(vocab, budget)
    if width is not None and depth_limit * (vocab // width) >= budget:
        x = logprobs.contiguous()
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        n_chunks = vocab // width
        head_len = n_chunks * width
        chunks = x.as_strided((depth_limit, n_chunks, width), (vocab, width, 1))  # [L, C, w]
        chunk_max = chunks.amax(dim=-1)  # [L, C]
        if chunk_max.dtype != work:
            chunk_max = chunk_max.to(work)
        tail = tail_max = None
        if head_len < vocab:  # the last columns, padded to one more block of w (-inf never clears a bar)
            tail = torch.nn.functional.pad(x[:, head_len:], (0, head_len + width - vocab), value=float("-inf"))
            tail_max = tail.amax(dim=-1).to(work)
        lb, reach = _comb_bound(_comb_summary(chunk_max, tail_max, budget), budget)
        if math.isfinite(lb):
            scale = _bar_margin_scale(depth_limit, work)
            bar = host_tensor([lb - u - scale * (1.0 + abs(lb) + abs(u)) for u in reach], work).view(depth_limit, 1)
            if x.device.type != "cpu":
                bar = bar.to(x.device)  # [L, 1]: a token below it is never popped
            rows, chunk = torch.nonzero(chunk_max >= bar, as_tuple=True)  # [n] (depth, chunk), row-major
            reread = int(rows.shape[0])
            # every chunk that clears its bar holds at least one candidate (its maximum): past the candidate limit
            # below, reading them would be wasted
            if reread * width > _REREAD_SHARE * depth_limit * vocab or reread > _candidate_limit(budget):
                return _lazy_ranks(logprobs, k)
            blocks = chunks[rows, chunk]  # [n, w]
            if tail is not None:  # every depth's tail block (chunk index C), after the picked ones
                blocks = torch.cat([blocks, tail])
                rows = torch.cat([rows, torch.arange(depth_limit, device=x.device)])
                chunk = torch.cat([chunk, torch.full((depth_limit,), n_chunks, device=x.device)])
            block, offset = torch.nonzero(blocks >= bar.index_select(0, rows), as_tuple=True)  # [m]
            cand = blocks[block, offset]
            # each depth's entries are in ascending column order here (the tail blocks come last and hold the
            # last columns); both rankings keep that order between equal values
            n, m = int(rows.shape[0]), int(block.shape[0])
            if m > _candidate_limit(budget):
                return _lazy_ranks(logprobs, k)
            if m <= _HOST_RANK_MAX:
                where = torch.cat([rows, chunk, block, offset]).tolist()
                picked_rows, picked_chunks = where[:n], where[n : 2 * n]
                hit_rows = [picked_rows[b] for b in where[2 * n : 2 * n + m]]
                cols = [picked_chunks[b] * width + o for b, o in zip(where[2 * n : 2 * n + m], where[2 * n + m :])]
                return RankedDepths(*_rank_on_host(cand.tolist(), hit_rows, cols, depth_limit, k))
            cols = chunk.index_select(0, block).mul_(width).add_(offset)
            return RankedDepths(*_rank_on_device(cand, rows.index_select(0, block), cols, depth_limit, k))
    return _lazy_ranks(logprobs, k)

