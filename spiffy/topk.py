"""Top-k of every row of a score matrix with one fixed tie rule, fast on real vocabulary sizes.

Spiffy ranks the top ``j`` tokens of each ranked position (:func:`spiffy.selfspec.formulas.rank_state`), and DDTree
falls back to the top ``K`` of every depth on small vocabularies (:mod:`spiffy.arspec.tree`). ``torch.topk`` leaves
the order of equal values unspecified and, on a CPU, costs about as much as sorting the row. :func:`top_ranked`
returns the same values in a documented order (value descending, ties by column ascending) from a few streaming
passes:

1. Split the row into chunks of ``s`` columns and take each chunk's maximum (one vectorised pass).
2. The ``k``-th largest chunk maximum ``t`` is a lower bound of the row's ``k``-th largest value (the chunk maxima
   are ``k`` distinct entries of the row), so every top-``k`` entry is ``>= t`` and lies in a chunk whose maximum
   is ``>= t``: only those chunks (about ``k`` per row) are read again.
3. The few entries ``>= t`` are sorted by (row, value descending, column ascending) with two stable sorts, and
   each row's first ``k`` are kept.

It pays off most for small ``k`` (Spiffy's ``j``); rows with fewer than ``2 k`` chunks of at least 16 columns are
sorted whole. Host synchronisations: a constant four (three ``nonzero`` and one count check).
"""

from __future__ import annotations

import torch

__all__ = ["top_ranked", "top_ranked_static"]

#: chunk widths tried, widest first (a wide chunk makes pass 1 cheaper, a narrow one makes pass 2 read less)
_CHUNKS: tuple[int, ...] = (256, 128, 64, 32, 16)


def _checked_empty(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate ``scores`` ``[R, V]`` and ``k``; the empty ``[R, k]`` result when ``k`` or ``R`` is 0, else ``None``."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [R, V], got shape {tuple(scores.shape)}")
    rows, width = int(scores.shape[0]), int(scores.shape[1])
    if not 0 <= k <= width:
        raise ValueError(f"k must be in [0, {width}], got {k}")
    if k == 0 or rows == 0:
        dev = scores.device
        return torch.zeros(rows, k, dtype=scores.dtype, device=dev), torch.zeros(rows, k, dtype=torch.long, device=dev)
    return None


def _chunk_width(width: int, k: int) -> int | None:
    """The widest chunk leaving at least ``2 k`` whole chunks in a row of ``width`` columns (``None``: sort whole)."""
    for s in _CHUNKS:
        if width // s >= max(2 * k, 4):
            return s
    return None


def _sorted_prefix(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-row stable sort (descending, so equal values keep their column order), first ``k`` columns."""
    vals, cols = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[:, :k].contiguous(), cols[:, :k].contiguous()


def top_ranked(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of every row, ordered by value descending, equal values by column ascending.

    Args:
        scores: ``[R, V]`` floating-point scores (probabilities, log-probabilities or logits); ``-inf`` entries are
            allowed (they rank last, by column); NaN entries are not meaningful.
        k: how many entries per row, ``0 <= k <= V``.
    Returns:
        ``(values [R, k], columns [R, k] long)`` on ``scores``' device; ``values`` are entries of ``scores``.
    Raises:
        ValueError: ``scores`` is not 2-D or ``k`` is out of range.
    """
    empty = _checked_empty(scores, k)
    if empty is not None:
        return empty
    rows, width = int(scores.shape[0]), int(scores.shape[1])
    s = _chunk_width(width, k)
    if s is None:
        return _sorted_prefix(scores, k)
    x = scores.contiguous()
    dev = x.device
    n_chunks = width // s
    head_len = n_chunks * s
    chunks = x.as_strided((rows, n_chunks, s), (width, s, 1))  # [R, C, s] view of the first C * s columns
    chunk_max = chunks.amax(dim=-1)  # [R, C]
    tail = x[:, head_len:]  # [R, V - C * s] (fewer than s columns)
    maxima = chunk_max if tail.shape[1] == 0 else torch.cat([chunk_max, tail.amax(dim=-1, keepdim=True)], dim=1)
    bound = torch.topk(maxima, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # [R, 1] <= k-th largest

    picked = (chunk_max >= bound).nonzero()  # [n, 2] (row, chunk), row-major, chunks ascending
    blocks = chunks[picked[:, 0], picked[:, 1]]  # [n, s]
    hit = (blocks >= bound.index_select(0, picked[:, 0])).nonzero()  # [m, 2] (block, offset)
    cand_rows = picked[:, 0].index_select(0, hit[:, 0])
    cand_cols = picked[:, 1].index_select(0, hit[:, 0]) * s + hit[:, 1]
    cand_vals = blocks[hit[:, 0], hit[:, 1]]
    tail_hit = (tail >= bound).nonzero()  # [m', 2] (row, offset); run even when empty: a fixed sync count
    cand_rows = torch.cat([cand_rows, tail_hit[:, 0]])
    cand_cols = torch.cat([cand_cols, tail_hit[:, 1] + head_len])
    cand_vals = torch.cat([cand_vals, tail[tail_hit[:, 0], tail_hit[:, 1]]])

    # within a row the candidates come in ascending column order (head chunks, then the tail), and both sorts are
    # stable: equal values keep that order
    order = torch.sort(cand_vals, descending=True, stable=True).indices
    order = order.index_select(0, torch.sort(cand_rows.index_select(0, order), stable=True).indices)
    counts = torch.bincount(cand_rows, minlength=rows)  # [R]
    if int(counts.min()) < k:  # only NaN can leave a row short of k entries >= its bound
        return _sorted_prefix(scores, k)
    starts = torch.cumsum(counts, 0) - counts
    take = order.index_select(0, (starts.unsqueeze(1) + torch.arange(k, device=dev)).reshape(-1))
    return cand_vals.index_select(0, take).view(rows, k), cand_cols.index_select(0, take).view(rows, k)


def top_ranked_static(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_ranked` (same values, same order, same tie rule) without a host synchronisation: static shapes
    only, so a captured step can run it. ``scores [R, V]`` -> ``(values [R, k], columns [R, k] long)``.

    Wide rows take the same first pass as :func:`top_ranked` (each ``s``-column chunk's maximum) but keep a fixed
    number of chunks: the ``k`` best by maximum, ties to the lower chunk (:func:`_static_whole` on the ``[R, C]``
    maxima), plus the short tail. Every top-``k`` entry lies in them: the ``a`` entries above the ``k``-th value
    ``t`` sit in at most ``a`` chunks, all of whose maxima exceed ``t`` and are kept; the remaining ``k - a`` picks
    are the lowest columns equal to ``t``, and the kept chunks of maximum ``t`` (at least ``k - a``, the lowest by
    index, each holding an entry equal to ``t``) come before any dropped one. The ``k * s`` (+ tail) candidates,
    laid out in ascending column order, are ranked whole by :func:`_static_whole`. About one read of the row plus
    a top-``k`` of a few thousand entries, close to :func:`top_ranked` on a CPU.
    """
    empty = _checked_empty(scores, k)
    if empty is not None:
        return empty
    rows, width = int(scores.shape[0]), int(scores.shape[1])
    s = _chunk_width(width, k)
    if s is None:
        return _static_whole(scores, k)
    x = scores.contiguous()
    n_chunks = width // s
    head_len = n_chunks * s
    chunks = x.as_strided((rows, n_chunks, s), (width, s, 1))  # [R, C, s] view of the first C * s columns
    _, best = _static_whole(chunks.amax(dim=-1), k)  # [R, k] chunk indices
    best = torch.sort(best, dim=-1).values  # ascending: the candidates below stay in column order
    picked = chunks.gather(1, best.unsqueeze(-1).expand(rows, k, s)).reshape(rows, k * s)  # [R, k * s]
    offsets = torch.arange(s, device=x.device)
    cols = (best.unsqueeze(-1) * s + offsets).reshape(rows, k * s)  # [R, k * s] their columns
    if head_len < width:  # the tail (fewer than s columns) is always a candidate, after every chunk
        tail_cols = torch.arange(head_len, width, device=x.device).expand(rows, width - head_len)
        picked = torch.cat([picked, x[:, head_len:]], dim=1)
        cols = torch.cat([cols, tail_cols], dim=1)
    vals, at = _static_whole(picked, k)
    return vals, cols.gather(-1, at)


def _static_whole(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_ranked_static` over whole rows (``scores [R, V]``, ``1 <= k <= V``): the ``k``-th largest value
    ``t`` (one ``torch.topk``) splits each row: every entry above ``t`` is in, and the entries equal to ``t`` fill
    the rest by column (a running count); the ``k`` chosen columns, read in column order and stably sorted by
    value, give value descending, ties by column ascending."""
    width = int(scores.shape[1])
    kth = torch.topk(scores, k, dim=-1).values[:, k - 1 :]  # [R, 1]
    above = scores > kth
    tied = scores == kth
    chosen = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
    reverse = torch.arange(width, 0, -1, device=scores.device)  # larger for smaller columns, all distinct
    cols = torch.topk(torch.where(chosen, reverse, 0), k, dim=-1).indices  # the chosen columns, ascending
    vals = scores.gather(-1, cols)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), cols.gather(-1, order)
