"""Compile one host-side tree below its root into verification inputs (a batch of one: one prompt's DDTree round).

:func:`compile_one_host_tree` is :func:`spiffy.verify.compile_tree_rows`'s path for a batch of one tree whose
parents live on the host, in a handful of tensor operations: the additive mask ``[1, 1, R, C + R]`` is filled with
the dtype's minimum, its visible cached columns and the tree block's visible entries are zeroed, and the ids and
positions come from one packed buffer. The tree block's visibility (each node sees its ancestors and itself) is
built without per-entry Python work: for a small tree each row is a Python integer used as a bit set (a node's row is
its parent's plus its own bit), unpacked once into a ``[R, R]`` byte matrix; for a large tree (where a masked fill
over the block costs more than a scatter) every node's ancestor chain is walked level by level in NumPy into flat
indices, a 1024-node tree in about a tenth of a millisecond.
"""

from __future__ import annotations

import numpy as np
import torch

from spiffy.torch_utils import host_tensor

__all__ = ["PARENT_ORDER_ERROR", "MaskWorkspace", "compile_one_host_tree"]

#: from this many nodes the ancestor chains are walked in NumPy and scattered (below, bit-set rows and one masked
#: fill of the tree block cost less)
_VECTOR_WALK_MIN_NODES = 192
#: up to this many rows the mask is filled whole and the cached columns opened by a masked fill
_FILL_WHOLE_MAX_ROWS = 48

#: the error a tree whose parents do not precede their children gets (every compile path)
PARENT_ORDER_ERROR = "every parent index must be smaller than its node's index (parents precede children)"


_HIDDEN: dict[torch.dtype, float] = {}


def _hidden_value(dtype: torch.dtype) -> float:
    """The additive mask's "hidden" value, the dtype's minimum (looked up once per dtype: ``torch.finfo`` costs
    about a microsecond a call)."""
    value = _HIDDEN.get(dtype)
    if value is None:
        value = _HIDDEN[dtype] = float(torch.finfo(dtype).min)
    return value


def _tree_block_bits(parents: list[int], n_pre: int) -> np.ndarray:
    """``[R, R]`` 0/1 visibility of the tree block (``R = P + N``): the prefix rows see each other, every node sees
    the prefix, its ancestors and itself. Each row is a Python integer used as a bit set (a node's row is its
    parent's with its own bit set), unpacked into bytes once."""
    prefix = (1 << n_pre) - 1
    rows = [prefix] * n_pre
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(PARENT_ORDER_ERROR)
        rows.append((rows[n_pre + p] if p >= 0 else prefix) | (1 << (n_pre + i)))
    width = len(rows)
    nbytes = (width + 7) // 8
    packed = np.frombuffer(b"".join([r.to_bytes(nbytes, "little") for r in rows]), dtype=np.uint8)
    return np.unpackbits(packed.reshape(width, nbytes), axis=1, count=width, bitorder="little")


def _tree_block_numpy(parents: list[int], n_pre: int, context_len: int, stride: int, max_depth: int | None = None
                      ) -> np.ndarray:
    """Flat indices into ``[R, C + R]`` of the tree block's visible entries (:func:`_tree_block_bits`'s ones), by
    array operations: every node's ancestor one level further up per step
    (``max_depth``: the tree's depth when known, children of the root at depth 1)."""
    n = len(parents)
    up = np.empty(n + 1, dtype=np.int64)
    up[:n] = parents
    up[n] = -1  # index -1 reads this sentinel: a walk past the root stays there
    nodes = np.arange(n, dtype=np.int64)
    if bool((up[:n] >= nodes).any()):
        raise ValueError(PARENT_ORDER_ERROR)
    levels = [nodes]  # levels[k][i]: node i's ancestor k levels up (-1 past the root)
    cur = up[:n]
    # each step moves to a strictly smaller index: at most n levels; a known depth needs no check per level
    for _ in range(n if max_depth is None else max_depth - 1):
        if max_depth is None and int(cur.max()) < 0:
            break
        levels.append(cur)
        cur = up[cur]
    cols = np.stack(levels)  # [K, N]
    row_start = (nodes + n_pre) * stride + context_len
    flat_nodes = (row_start + n_pre + cols)[cols >= 0]
    prefix = np.arange(n_pre, dtype=np.int64)
    flat_prefix = (np.concatenate([np.arange(n_pre, dtype=np.int64) * stride + context_len, row_start])[:, None]
                   + prefix).reshape(-1)
    return np.concatenate([flat_prefix, flat_nodes])


class MaskWorkspace:
    """Memory a generation's batch-of-one rounds write their attention masks into, kept across rounds.

    A mask is a view ``[R, C + R]`` of a ``[rows, cols]`` storage whose row stride stays fixed, so a round writes
    only what changed: the columns that became cached context since the last round (zeroed in every row: visible),
    then its own tree block ``[R, R]``. Cached columns are written in full only when some are hidden (a row with
    left padding or holes) or the storage grows. The view is consumed by the round's forward before the next round
    writes (host execution; a device mask is written in full every round, without the workspace).

    Invariant: every row's columns ``[0, clean)`` are zero.
    """

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None
        self.clean = 0

    def view(self, rows: int, context_len: int, dtype: torch.dtype, all_visible: bool) -> torch.Tensor:
        """``[rows, context_len + rows]`` view whose cached columns are zero (visible) when ``all_visible``; the rest
        of it is for the caller to write (the tree block always, the cached columns when not ``all_visible``)."""
        width = context_len + rows
        st = self.storage
        if st is None or st.dtype != dtype or st.shape[0] < rows or st.shape[1] < width:
            height = rows if st is None else max(rows, int(st.shape[0]))
            st = self.storage = torch.zeros(height, 2 * width, dtype=dtype)
            self.clean = 2 * width
        if all_visible and self.clean < context_len:
            st[:, self.clean : context_len] = 0
        self.clean = context_len if all_visible else 0
        return st.narrow(0, 0, rows).narrow(1, 0, width)


def compile_one_host_tree(tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                          prefix: tuple[list[int], list[int]], context_visible: torch.Tensor,
                          dtype: torch.dtype, position_offset: int | None = None,
                          workspace: MaskWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One host tree below its prefix rows, as :func:`~spiffy.verify.compile_tree_rows` lays out a batch of one.

    Args:
        tree: ``(tokens [N], positions [N], parents [N])`` host tensors (parents precede children, ``-1`` = a child
            of the root).
        prefix: ``(tokens, positions)`` of the real rows placed first (the root), as Python lists of ``P`` ints.
        context_visible: ``[1, C]`` bool, the cached positions the row may see.
        dtype: the mask dtype.
        position_offset: ``None``, or ``tree``'s positions are its nodes' depths (children of the root at depth 1)
            below a root at this position: they are added to it.
        workspace: the generation's :class:`MaskWorkspace` (host masks only): the mask is a view of it, written
            only where it changed since the last round; ``None`` writes a fresh mask.
    Returns:
        ``(input_ids [1, R], position_ids [1, R], attention_mask [1, 1, R, C + R])`` (``R = P + N``) on
        ``context_visible``'s device.
    """
    tok, tpos, par = tree
    dev = context_visible.device
    parents = par.tolist()
    positions = tpos.tolist()
    max_depth = None
    if position_offset is not None:
        max_depth = max(positions, default=0)
        positions = [depth + position_offset for depth in positions]
    n_pre, n, context_len = len(prefix[0]), len(parents), int(context_visible.shape[1])
    rows = n_pre + n
    stride = context_len + rows
    # [R, C + R]: everything hidden, then the visible cached columns and the tree block's visible entries opened
    hidden = _hidden_value(dtype)
    reuse = workspace is not None and dev.type == "cpu"
    all_visible = reuse and bool(context_visible.all())  # a host tensor: no device synchronisation
    if reuse:
        mask = workspace.view(rows, context_len, dtype, all_visible)  # type: ignore[union-attr]
    else:
        mask = torch.empty((rows, stride), dtype=dtype, device=dev)
    tree_block = mask.narrow(1, context_len, rows)
    if all_visible:  # the cached columns are zero already: only the tree block is written
        tree_block.fill_(hidden)
    elif rows <= _FILL_WHOLE_MAX_ROWS:  # few rows: a masked fill of the cached columns costs least
        mask.fill_(hidden)
        mask.narrow(1, 0, context_len).masked_fill_(context_visible[0], 0.0)
    else:  # many rows: one row of the cached columns broadcast down, the tree block filled apart
        mask.narrow(1, 0, context_len).copy_(torch.zeros(context_len, dtype=dtype, device=dev).masked_fill_(
            ~context_visible[0], hidden).expand(rows, context_len))
        tree_block.fill_(hidden)
    if n < _VECTOR_WALK_MIN_NODES:
        block = torch.from_numpy(_tree_block_bits(parents, n_pre)).view(torch.bool)
        tree_block.masked_fill_(block if dev.type == "cpu" else block.to(dev), 0.0)
    else:
        # flat indices over the memory the view starts at (offset 0: the workspace's storage, or the fresh mask)
        base = workspace.storage.view(-1) if reuse else mask.view(-1)  # type: ignore[union-attr]
        flat = torch.from_numpy(_tree_block_numpy(parents, n_pre, context_len, int(mask.stride(0)), max_depth))
        base.index_fill_(0, flat if dev.type == "cpu" else flat.to(dev), 0.0)
    packed = host_tensor(prefix[0] + tok.tolist() + prefix[1] + positions, torch.long).view(2, 1, rows)
    if dev.type != "cpu":
        packed = packed.to(dev)
    ids, pos = packed.unbind(0)
    return ids, pos, mask[None, None]
