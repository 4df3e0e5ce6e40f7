"""(i, j) draft formulas: ranking the latest distribution ``P`` and instantiating formulas into states.

This module is the single source of truth for how Spiffy ranks positions and tokens; calibration
(:mod:`spiffy.selfspec.chains`) and the speculative runtime (:mod:`spiffy.selfspec.runtime`) both call
:func:`rank_state`, so a formula recorded offline means the same thing at run time.

Ranking (SPEC section 5):

* **Positions.** The positions still masked in the current block of ``x`` are ranked by their top-1 probability
  under ``P``, descending; ties go to the lower row. Position rank ``i`` is 1-based (1 = most confident).
* **Tokens.** Each ranked position's vocabulary is ranked by probability under ``P``, descending; ties go to the
  lower token id. Token rank ``j`` is 1-based (1 = argmax).

A formula is a tuple of pairs ``(i, j)``; instantiating it writes token ``c_ij`` at the row of rank ``i`` into a
copy of ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from spiffy.decoding.session import TransitionProbs
from spiffy.errors import ConfigError
from spiffy.topk import top_ranked, top_ranked_static
from spiffy.torch_utils import device_tensor

Pair = tuple[int, int]


@dataclass
class Ranking:
    """Ranks of one state under one distribution ``P``.

    Attributes:
        rows: ``[I]`` long, absolute rows of ``x`` in position-rank order (``rows[i - 1]`` has rank ``i``).
        token_ids: ``[I, J]`` long, ``token_ids[i - 1, j - 1]`` = ``c_ij``.
        token_probs: ``[I, J]`` float, probability of ``c_ij`` under ``P`` (``token_probs[:, 0]`` is the top-1
            probability the positions are ranked by).
        num_masked: number of masked positions in the block (``I = min(i_max, num_masked)``).
        block_start, block_end: absolute rows of the ranked block.
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    token_probs: torch.Tensor
    num_masked: int
    block_start: int
    block_end: int
    _host: tuple[list[list[float]], list[list[int]]] | None = field(default=None, repr=False, compare=False)
    #: host copy of :func:`rank_state`'s ``extra`` tensor, read with the ranking (``None``: none was given)
    extra: list[int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_positions(self) -> int:
        """``I``: how many position ranks are available (``1..I``)."""
        return int(self.rows.shape[0])

    @property
    def num_tokens(self) -> int:
        """``J``: how many token ranks are available per position (``1..J``)."""
        return int(self.token_ids.shape[1]) if self.token_ids.dim() == 2 else 0

    def available(self, pair: Pair) -> bool:
        """Whether ``pair`` has a rank in this ranking (``1 <= i <= I`` and ``1 <= j <= J``)."""
        i, j = pair
        return 1 <= i <= self.num_positions and 1 <= j <= self.num_tokens

    def probs_list(self) -> list[list[float]]:
        """``token_probs`` as nested Python floats (``[I][J]``; read with :meth:`ids_list` in one device sync)."""
        return self._host_tables()[0]

    def ids_list(self) -> list[list[int]]:
        """``token_ids`` as nested Python ints (``[I][J]``; read with :meth:`probs_list` in one device sync)."""
        return self._host_tables()[1]

    def _host_tables(self) -> tuple[list[list[float]], list[list[int]]]:
        if self._host is None:  # one read of both tables (float64 holds every token id exactly)
            i, j = self.num_positions, self.num_tokens
            flat = torch.cat([self.token_probs.detach().to(torch.float64).reshape(-1),
                              self.token_ids.to(torch.float64).reshape(-1)]).tolist()
            self._host = _split_tables(flat, i, j)
        return self._host


def _split_tables(flat: list[float], i: int, j: int) -> tuple[list[list[float]], list[list[int]]]:
    """``flat`` = ``i x j`` probabilities then ``i x j`` token ids, row-major -> the two nested tables."""
    probs = [flat[r * j : (r + 1) * j] for r in range(i)]
    ids = [[int(v) for v in flat[(i + r) * j : (i + r + 1) * j]] for r in range(i)]
    return probs, ids


def window_covers(window_start: int, window_len: int, block_start: int, block_end: int) -> bool:
    """Whether a logits window ``[window_start, window_start + window_len)`` contains ``[block_start, block_end)``."""
    return window_start <= block_start and block_end <= window_start + window_len


def rank_state(
    P_window: torch.Tensor,
    x: torch.Tensor,
    block_start: int,
    block_end: int,
    window_start: int,
    i_max: int,
    j_max: int,
    *,
    mask_id: int,
    probs: TransitionProbs | torch.Tensor | None = None,
    sync_free: bool | None = None,
    extra: torch.Tensor | None = None,
) -> Ranking:
    """Rank the masked positions of a block and their tokens under ``P``.

    Args:
        P_window: ``[W, V]`` (or ``[1, W, V]``) aligned window logits; index ``w`` predicts row ``window_start + w``.
        x: ``[T]`` (or ``[1, T]``) state whose masked block positions are ranked.
        block_start, block_end: absolute rows of the current block.
        window_start: absolute row of ``P_window[0]``.
        i_max: at most this many position ranks are kept (``>= 1``).
        j_max: at most this many token ranks per position are kept (``>= 1``).
        mask_id: the family's mask token id.
        probs: ``softmax(P_window)`` already computed by the baseline transition that ``P`` drove (a
            :class:`~spiffy.decoding.session.TransitionProbs`, or the ``[W, V]`` / ``[1, W, V]`` tensor; float32 or
            float64; see :meth:`~spiffy.decoding.session.DecodeSession.transition_probs`): ranked as given, no
            softmax here; with its ``top1``, the block's rows are not read again either; with its ``selection``
            (the confidences the transition's ``torch.topk`` chose from), positions are ordered as the baseline would
            pick them (:func:`selection_order`), ties and half-precision roundings included.
        sync_free: rank with static shapes (:func:`_rank_static`: every rank of ``min(i_max, block)`` computed,
            tokens by :func:`~spiffy.topk.top_ranked_static`) and read back, in **one** host synchronisation, the
            masked count with both tables (:meth:`Ranking.probs_list`, :meth:`Ranking.ids_list`), instead of the
            streaming :func:`~spiffy.topk.top_ranked` on the masked rows found with ``nonzero`` (five
            synchronisations, then one more for the tables). Same ranking either way; ``None``: on a GPU only.
        extra: ``[K]`` integer tensor read back with the ranking (in its one read when ``sync_free``) into
            :attr:`Ranking.extra` (Spiffy passes the session's :meth:`~spiffy.decoding.session.DecodeSession.count_tensor`).
    Returns:
        :class:`Ranking` with ``I = min(i_max, masked count)`` positions and ``J = min(j_max, V)`` tokens each.
        Probabilities are ``probs`` when given, else a softmax of the logits in float64 (float64 logits) or float32
        (any other dtype). Costs one pass over the block's rows (their top-1 probabilities) and a top-``J`` of the
        ``I`` kept rows, whatever the vocabulary; host synchronisations: a constant few.
    Raises:
        ConfigError: bad caps, or the window does not cover the block.
    """
    if i_max < 1 or j_max < 1:
        raise ConfigError(f"i_max={i_max} and j_max={j_max} must both be >= 1; fix: pass positive rank caps")
    logits = P_window[0] if P_window.dim() == 3 else P_window
    if logits.dim() != 2:
        raise ConfigError(f"P_window must be [W, V] or [1, W, V], got shape {tuple(P_window.shape)}")
    state = x[0] if x.dim() == 2 else x
    w, v = logits.shape
    if not window_covers(window_start, w, block_start, block_end):
        raise ConfigError(
            f"logits window [{window_start}, {window_start + w}) does not cover block [{block_start}, {block_end}); "
            "fix: rank only from a distribution whose window contains the current block"
        )
    j = min(j_max, v)
    dev = logits.device
    published = probs if isinstance(probs, TransitionProbs) else None
    tensor = published.probs if published is not None else probs
    given = None if tensor is None else (tensor[0] if tensor.dim() == 3 else tensor)
    if given is not None and tuple(given.shape) != (w, v):
        raise ConfigError(f"probs must match P_window's [W, V] = [{w}, {v}], got {tuple(tensor.shape)}")
    if sync_free is None:
        sync_free = dev.type == "cuda"
    if sync_free:
        return _rank_static(logits, state, block_start, block_end, window_start, min(i_max, block_end - block_start),
                            j, mask_id, given, published, extra)
    ranking = _rank_host(logits, state, block_start, block_end, window_start, i_max, j, mask_id, given, published)
    ranking.extra = None if extra is None else [int(v) for v in extra.tolist()]
    return ranking


def _rank_host(logits: torch.Tensor, state: torch.Tensor, block_start: int, block_end: int, window_start: int,
               i_max: int, j: int, mask_id: int, given: torch.Tensor | None,
               published: TransitionProbs | None) -> Ranking:
    """:func:`rank_state`'s host ranking: the masked rows found with ``nonzero``, the streaming top-``J``."""
    dev = logits.device
    masked = (state[block_start:block_end] == mask_id).nonzero().squeeze(1) + block_start  # [M] ascending rows
    m = int(masked.shape[0])
    if m == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return Ranking(
            rows=empty,
            token_ids=torch.zeros(0, j, dtype=torch.long, device=dev),
            token_probs=torch.zeros(0, j, dtype=torch.float64, device=dev),
            num_masked=0,
            block_start=block_start,
            block_end=block_end,
        )
    selection, selection_start = (published.selection, published.selection_start) if published else (None, 0)
    top1: torch.Tensor | None = None  # [M] confidences to sort by, needed only without the baseline's selection
    if given is not None:
        known_top1 = published.top1 if published is not None else None
        block_probs = given[block_start - window_start : block_end - window_start]  # [block, V] view, no copy
        if selection is None and known_top1 is not None:
            top1 = known_top1.reshape(-1).index_select(0, masked - window_start)  # [M], no pass over V
        elif selection is None:
            top1 = block_probs.amax(dim=-1).index_select(0, masked - block_start)  # [M]
        rows_of = masked - block_start
    else:
        cdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        block_probs = torch.softmax(logits.index_select(0, masked - window_start).to(cdtype), dim=-1)  # [M, V]
        if selection is None:
            top1 = block_probs.amax(dim=-1)
        rows_of = torch.arange(m, device=dev)
    if selection is not None:
        # the baseline's own order: its confidences, dtype and torch.topk tie-breaking
        order = selection_order(selection[0] if selection.dim() == 2 else selection, masked - selection_start,
                                min(i_max, m))
    else:
        assert top1 is not None
        order = torch.sort(top1, descending=True, stable=True).indices[: min(i_max, m)]  # ties -> lower row
    vals, ids = top_ranked(block_probs.index_select(0, rows_of.index_select(0, order)), j)  # ties -> lower id
    return Ranking(
        rows=masked.index_select(0, order),
        token_ids=ids,
        token_probs=vals,
        num_masked=m,
        block_start=block_start,
        block_end=block_end,
    )


def _rank_static(logits: torch.Tensor, state: torch.Tensor, block_start: int, block_end: int, window_start: int,
                 n: int, j: int, mask_id: int, given: torch.Tensor | None,
                 published: TransitionProbs | None, extra: torch.Tensor | None = None) -> Ranking:
    """:func:`rank_state`'s ranking with static shapes and one host read (``sync_free``).

    The masked count ``M`` is data, so every one of the ``n = min(i_max, L)`` ranks of the block's ``L`` rows is
    computed: the first ``min(n, M)`` are the masked rows in the host path's order, the rest point at the block's
    first row and are cut after the read. Orders, exactly as the host path: without a selection, top-1 probability
    descending with ties to the lower row (a stable sort of the block's rows, then a stable sort putting the masked
    rows first keeps their relative order); with the baseline's selection, the successive ``torch.topk`` picks of
    :func:`selection_order` on the same vector (masked rows at their clamped confidences, the rest ``-inf``), whose
    first ``M`` picks are the masked rows. Row probabilities: the published ``given [W, V]``, else a softmax of the
    block's rows (each row's softmax is its own: the same values as over the masked rows alone).

    Returns:
        A :class:`Ranking` of ``I = min(n, M)`` ranks with its host tables filled by the one read (``M``, the
        ``[n, J]`` probabilities and token ids, in float64).
    """
    length = block_end - block_start
    dev = logits.device
    is_masked = state[block_start:block_end] == mask_id  # [L]
    lo, hi = block_start - window_start, block_end - window_start
    if given is not None:
        block_probs = given[lo:hi]  # [L, V] view, no copy
    else:
        cdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        block_probs = torch.softmax(logits[lo:hi].to(cdtype), dim=-1)  # [L, V]
    selection = published.selection if published is not None else None
    if selection is not None:
        scores = selection[0] if selection.dim() == 2 else selection  # [F] the baseline's confidence frame
        start = block_start - published.selection_start  # type: ignore[union-attr]
        candidate = torch.zeros_like(scores, dtype=torch.bool)
        candidate[start : start + length] = is_masked
        vec = torch.where(candidate, scores.clamp_min(torch.finfo(scores.dtype).min), -torch.inf)
        rows = _topk_picks(vec, n) - start + block_start  # [n]: after the M candidates, arbitrary frame columns
    else:
        known = published.top1 if published is not None and given is not None else None
        top1 = known.reshape(-1)[lo:hi] if known is not None else block_probs.amax(dim=-1)  # [L]
        order = torch.sort(top1, descending=True, stable=True).indices
        unmasked_last = (~is_masked).index_select(0, order).to(torch.uint8)
        order = order.index_select(0, torch.sort(unmasked_last, stable=True).indices)
        rows = order[:n] + block_start  # [n]
    count = is_masked.sum()  # [] M, on the device
    rows = torch.where(torch.arange(n, device=dev) < count, rows, block_start)  # padding ranks: a row of the block
    vals, ids = top_ranked_static(block_probs.index_select(0, rows - block_start), j)  # [n, J] each
    more = [] if extra is None else [extra.to(torch.float64).reshape(-1)]  # the state's device, as P
    flat = torch.cat([count.to(torch.float64).reshape(1), vals.detach().to(torch.float64).reshape(-1),
                      ids.to(torch.float64).reshape(-1)] + more).tolist()  # the one host read of the step's ranking
    m = int(flat[0])
    i = min(n, m)
    probs_table, ids_table = _split_tables(flat[1 : 1 + 2 * n * j], n, j)
    return Ranking(rows=rows[:i], token_ids=ids[:i], token_probs=vals[:i], num_masked=m, block_start=block_start,
                   block_end=block_end, _host=(probs_table[:i], ids_table[:i]),
                   extra=None if extra is None else [int(x) for x in flat[1 + 2 * n * j :]])


def _topk_picks(vec: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` successive ``torch.topk(vec, 1)`` picks, each removed (set to ``-inf``) before the next: int64
    ``[count]`` indices into ``vec`` (modified in place). The order a one-per-step ``torch.topk`` baseline picks."""
    picks = torch.empty(count, dtype=torch.long, device=vec.device)
    for k in range(count):
        idx = torch.topk(vec, 1).indices
        picks[k : k + 1] = idx
        vec.index_fill_(0, idx, -torch.inf)
    return picks


def selection_order(scores: torch.Tensor, cols: torch.Tensor, count: int) -> torch.Tensor:
    """The order in which a baseline choosing one position per step with ``torch.topk`` would pick the candidates,
    were their confidences to stay as they are: ``count`` successive ``torch.topk(·, 1)`` calls on ``scores`` with
    every non-candidate entry at ``-inf`` and each pick removed.

    Descending confidence when the values are distinct; on ties (frequent in half precision, where confident
    positions round to exactly 1.0) the order is ``torch.topk``'s own, which is neither index order nor documented,
    so it is reproduced by calling it, on a vector laid out like the baseline's. No host synchronisation.

    Args:
        scores: ``[F]`` the confidence vector the baseline's ``torch.topk`` ranks (its dtype and frame).
        cols: ``[M]`` ascending columns of ``scores`` that are candidates (the masked rows of the block).
        count: picks wanted (``<= M``).
    Returns:
        int64 ``[count]`` indices into ``cols``, first pick first.
    """
    lowest = torch.finfo(scores.dtype).min
    vec = torch.full_like(scores, -torch.inf)
    # a candidate at -inf stays pickable (after every finite one), never a removed or non-candidate entry
    vec[cols] = scores.index_select(0, cols).clamp_min(lowest)
    return torch.searchsorted(cols, _topk_picks(vec, count))


def pairs_available(pairs: Iterable[Pair], ranking: Ranking) -> bool:
    """Whether every pair of a formula has a rank in ``ranking``."""
    return all(ranking.available(p) for p in pairs)


def pair_probs(pairs: Sequence[Pair], ranking: Ranking) -> list[float] | None:
    """Probabilities ``p_ij`` of a formula's pairs under ``P`` (Python floats), or ``None`` if a rank is unavailable."""
    if not pairs_available(pairs, ranking):
        return None
    table = ranking.probs_list()
    return [table[i - 1][j - 1] for i, j in pairs]


def instantiate(x: torch.Tensor, pairs: Sequence[Pair], ranking: Ranking) -> torch.Tensor | None:
    """``x ∪ {c_ij}``: a copy of ``x`` with token ``c_ij`` written at the row of rank ``i`` for every pair.

    Args:
        x: ``[T]`` or ``[B=1, T]`` state.
        pairs: the formula.
        ranking: ranks of ``x`` under ``P``.
    Returns:
        A new tensor shaped like ``x``, or ``None`` when a rank is unavailable.
    """
    out = instantiate_many(x, [pairs], ranking)
    if out is None or out[1][0] < 0:
        return None
    state = out[0][0]
    return state.view_as(x)


def instantiate_many(
    x: torch.Tensor, formulas: Sequence[Sequence[Pair]], ranking: Ranking
) -> tuple[torch.Tensor, list[int]] | None:
    """Instantiate several formulas in one scatter.

    Args:
        x: ``[T]`` or ``[1, T]`` state.
        formulas: the formulas to instantiate.
        ranking: ranks of ``x`` under ``P``.
    Returns:
        ``(states [K, T], index)`` where ``states`` holds the instantiable formulas in order and ``index[f]`` is the
        row of formula ``f`` in ``states`` or ``-1`` when a rank is unavailable; ``None`` when ``formulas`` is empty.
    """
    if not formulas:
        return None
    base = x[0] if x.dim() == 2 else x
    index: list[int] = []
    node_idx: list[int] = []
    i_idx: list[int] = []
    j_idx: list[int] = []
    k = 0
    for pairs in formulas:
        if not pairs_available(pairs, ranking):
            index.append(-1)
            continue
        index.append(k)
        for i, j in pairs:
            node_idx.append(k)
            i_idx.append(i - 1)
            j_idx.append(j - 1)
        k += 1
    states = base.unsqueeze(0).repeat(k, 1)
    if node_idx:
        dev = base.device
        ii = device_tensor(i_idx, torch.long, dev)
        jj = device_tensor(j_idx, torch.long, dev)
        nn_ = device_tensor(node_idx, torch.long, dev)
        states[nn_, ranking.rows.index_select(0, ii)] = ranking.token_ids[ii, jj].to(states.dtype)
    return states, index


__all__ = [
    "Pair",
    "Ranking",
    "rank_state",
    "instantiate",
    "instantiate_many",
    "pair_probs",
    "pairs_available",
    "window_covers",
]
