"""The DDTree reference tree builder, re-expressed as the comparison baseline of ``spiffy bench overheads``.

This follows the algorithm of the DDTree authors' implementation (liranringel/ddtree, ``build_ddtree_tree``),
re-expressed here in this project's own code (the reference was read, not copied):

1. ``K = min(B, V)``; one ``topk`` of the float32 drafter logits per depth, a ``logsumexp`` per depth, and the
   top-``K`` log-probabilities ``top_logits - logsumexp`` copied to the host as NumPy arrays.
2. A best-first max-heap over rank tuples, seeded with the first depth's best token. Each popped node records its
   token, depth and parent, and registers itself in its parent's child map ``{token: node}``; it pushes its next
   sibling (score = own score - own log-probability + the next one's) and its first child (score + the next
   depth's best log-probability). Stop after ``B`` pops.
3. A boolean ancestor-visibility matrix ``[1 + N, 1 + N]`` (root first), row by row from the parent's row (the
   reference builds it with the tree; in spiffy the equivalent mask belongs to the compile stage, so it is timed
   separately here).
4. The compile (``compile_ddtree_tree``, :class:`ReferenceCompiler` here): buffers allocated once per generation
   (ids, positions ``[1, 1 + B]``, an additive mask ``[1, 1, 1 + B, T + 1 + B]`` of zeros, ``T`` the longest
   context); per round the previous round's tree block goes back to zeros (those columns are committed context
   now), the root and node ids / positions are copied in, and the new tree block is filled with the dtype's
   minimum and zeroed where the visibility matrix is set.

The host work uses NumPy scalars and Python floats as the reference does; only the time matters here.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
import torch

__all__ = ["ReferenceCompiler", "ReferenceTree", "reference_build", "reference_visibility"]


class ReferenceTree:
    """What the reference builder returns: node tokens / depths ``[N]``, parents ``[1 + N]`` (root ``-1`` first),
    child maps per row (root = row 0) and the seconds of its two host phases."""

    def __init__(self, tokens: np.ndarray, depths: np.ndarray, parents: list[int], child_maps: list[dict[int, int]],
                 copy_seconds: float, heap_seconds: float) -> None:
        self.tokens, self.depths, self.parents, self.child_maps = tokens, depths, parents, child_maps
        self.copy_seconds, self.heap_seconds = copy_seconds, heap_seconds

    def sequences(self) -> set[tuple[int, ...]]:
        """Every node as its token path from the root."""
        paths: list[tuple[int, ...]] = [()]
        for i, tok in enumerate(self.tokens.tolist()):
            paths.append(paths[self.parents[i + 1]] + (int(tok),))
        return set(paths[1:])


def reference_build(draft_logits: torch.Tensor, budget: int) -> ReferenceTree:
    """The reference's tree from ``[L, V]`` drafter logits under a node budget (see the module docstring)."""
    depth_limit, vocab = int(draft_logits.shape[0]), int(draft_logits.shape[1])
    if budget <= 0 or depth_limit == 0:
        return ReferenceTree(np.zeros(0, np.int64), np.zeros(0, np.int64), [-1], [{}], 0.0, 0.0)
    k = min(budget, vocab)
    t0 = time.perf_counter()
    logits = draft_logits.float()
    top_vals, top_ids = torch.topk(logits, k=k, dim=-1)
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    top_lp = (top_vals - log_norm).to(device="cpu", dtype=torch.float32).numpy()
    ids = top_ids.to(device="cpu", dtype=torch.long).numpy()
    t1 = time.perf_counter()

    start = float(top_lp[0, 0])
    # entry: (-score, rank tuple, parent row, depth (1-based), rank, score)
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-start, (0,), 0, 1, 0, start)]
    tokens = np.empty(budget, dtype=np.int64)
    depths = np.empty(budget, dtype=np.int64)
    parents = np.empty(budget + 1, dtype=np.int32)
    parents[0] = -1
    child_maps: list[dict[int, int]] = [{}]
    count = 0
    while heap and count < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        token = int(ids[depth - 1, rank])
        row = count + 1
        tokens[count], depths[count], parents[row] = token, depth, parent
        child_maps.append({})
        child_maps[parent][token] = row
        count += 1
        if rank + 1 < k:
            sib = score - float(top_lp[depth - 1, rank]) + float(top_lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < depth_limit:
            child = score + float(top_lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), row, depth + 1, 0, child))
    t2 = time.perf_counter()
    return ReferenceTree(tokens[:count], depths[:count], parents[: count + 1].tolist(), child_maps, t1 - t0, t2 - t1)


def reference_visibility(tree: ReferenceTree) -> np.ndarray:
    """``[1 + N, 1 + N]`` bool: row ``i`` sees its ancestors and itself (row 0 = the root)."""
    n = 1 + int(tree.tokens.shape[0])
    vis = np.zeros((n, n), dtype=np.bool_)
    vis[0, 0] = True
    for i in range(1, n):
        p = tree.parents[i]
        vis[i, :i] = vis[p, :i]
        vis[i, i] = True
    return vis


class ReferenceCompiler:
    """The reference's compile stage with its per-generation buffers (module docstring, step 4)."""

    def __init__(self, budget: int, max_context: int, dtype: torch.dtype = torch.float32) -> None:
        width = 1 + int(budget)
        self.ids = torch.empty(1, width, dtype=torch.long)
        self.positions = torch.empty(1, width, dtype=torch.long)
        self.mask = torch.zeros(1, 1, width, int(max_context) + width, dtype=dtype)
        self.visibility = torch.empty(width, width, dtype=torch.bool)
        self.dtype = dtype
        self._previous = (0, 0)  # (start column, length) of the last round's tree block

    def compile(self, root: int, start: int, tree: ReferenceTree, visibility: np.ndarray
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round's ``(ids [1, R], positions [1, R], mask [1, 1, R, start + R])`` for a tree below the root at
        position ``start`` on a context of ``start`` positions."""
        length = 1 + int(tree.tokens.shape[0])
        prev_start, prev_len = self._previous
        if prev_len:
            self.mask[0, 0, :prev_len, prev_start : prev_start + prev_len] = 0
        ids = self.ids[:, :length]
        ids[0, 0] = root
        positions = self.positions[:, :length]
        positions[0, 0] = start
        if length > 1:
            ids[0, 1:length].copy_(torch.from_numpy(tree.tokens))
            positions[0, 1:length].copy_(torch.from_numpy(tree.depths))
            positions[0, 1:length].add_(start)
        vis = self.visibility[:length, :length]
        vis.copy_(torch.from_numpy(visibility))
        block = self.mask[0, 0, :length, start : start + length]
        block.fill_(torch.finfo(self.dtype).min)
        block.masked_fill_(vis, 0)
        self._previous = (start, length)
        return ids, positions, self.mask[:, :, :length, : start + length]
