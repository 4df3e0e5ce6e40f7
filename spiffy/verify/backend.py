"""Compile a set of draft nodes with parent links into model inputs, and walk the result.

Both speculative modes use this module:

* **DDTree** (AR): every node is one token; a node sees the committed context, its ancestors and itself
  (``visibility="ancestors"``). Position of a node = root position + depth.
* **Spiffy** (dLLM): every node is a *span* of rows (a block, a block + suffix copy, or a whole sequence) that
  replaces real rows; it sees the committed context and its own rows only (``visibility="self"``). Position
  ids are those of the rows it replaces. Drafts never see each other; real rows never see drafts.

Two layouts are offered:

* :func:`compile_packed` puts every node's rows in one sequence ``[1, R]`` with a 4-D additive mask
  ``[1, 1, R, C + R]`` (``C`` = cached context length). Needed for trees.
* :func:`compile_batched` stacks equal-length spans in the batch dimension ``[N, S]`` (each row of the batch
  is one node); with ``visibility="self"`` this is the same computation with a cheaper attention.

The walk, :func:`follow`, is generic: it starts at a root, asks the target's own decoding rule for the next
state, and moves to the child that matches it until none does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, Sequence, TypeVar

import torch

from spiffy.errors import StepLimitError
from spiffy.torch_utils import device_tensor
from spiffy.verify.host_tree import PARENT_ORDER_ERROR, compile_one_host_tree

Visibility = Literal["ancestors", "self"]

NodeT = TypeVar("NodeT", bound=Hashable)
StateT = TypeVar("StateT")


@dataclass
class DraftStructure:
    """Draft nodes to verify in one forward.

    Attributes:
        tokens: per node, ``[S_n]`` long token ids of the node's rows.
        positions: per node, ``[S_n]`` long position ids of those rows.
        parents: per node, the indices of its parent nodes (``()`` or ``(-1,)`` = child of the root/real state).
            Parents must precede children. Used for ``"ancestors"`` visibility and by walks.
        visibility: ``"ancestors"`` (tree nodes see ancestors + self) or ``"self"`` (spans see only themselves).
    """

    tokens: list[torch.Tensor]
    positions: list[torch.Tensor]
    parents: list[tuple[int, ...]] = field(default_factory=list)
    visibility: Visibility = "self"

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.positions):
            raise ValueError(f"tokens ({len(self.tokens)}) and positions ({len(self.positions)}) differ in node count")
        if not self.parents:
            self.parents = [()] * len(self.tokens)
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"parents ({len(self.parents)}) and tokens ({len(self.tokens)}) differ in node count")
        for i, (t, p, par) in enumerate(zip(self.tokens, self.positions, self.parents)):
            if t.dim() != 1 or p.dim() != 1 or t.shape != p.shape:
                raise ValueError(f"node {i}: tokens {tuple(t.shape)} and positions {tuple(p.shape)} must be equal 1-D")
            for q in par:
                if q >= i:
                    raise ValueError(f"node {i}: parent {q} does not precede it (parents must come first)")
        if self.visibility not in ("ancestors", "self"):
            raise ValueError(f"visibility must be 'ancestors' or 'self', got {self.visibility!r}")

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def row_offsets(self) -> list[int]:
        """Start row of every node in the packed layout, plus the total row count at the end."""
        offs = [0]
        for t in self.tokens:
            offs.append(offs[-1] + int(t.numel()))
        return offs


@dataclass
class CompiledDraft:
    """Model inputs for one verification forward.

    Attributes:
        input_ids: ``[1, R]`` (packed) or ``[N, S]`` (batched) long.
        position_ids: same shape as ``input_ids``.
        attention_mask: 4-D additive float mask, ``[1, 1, R, C + R]`` (packed) or ``[N, 1, S, C + S]``
            (batched); ``0`` = visible, ``dtype`` min = hidden.
        row_offsets: packed layout: start row of each node plus total; batched: ``None``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_offsets: list[int] | None

    def node_rows(self, node: int) -> slice | int:
        """Where node ``node``'s outputs live: a row slice (packed) or a batch index (batched)."""
        if self.row_offsets is None:
            return node
        return slice(self.row_offsets[node], self.row_offsets[node + 1])


def tree_ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Ancestor-or-self visibility of a tree.

    Args:
        parents: ``[N]`` long, parent index of each node, ``-1`` for children of the root; parents precede children.
        max_depth: the tree's depth when the caller knows it (children of the root have depth 1): the walk up the
            parents then runs exactly that many vectorised steps with no host synchronisation; ``None`` stops when
            every walk has reached the root (one synchronisation per level).
    Returns:
        ``[N, N]`` bool, ``out[i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``.
    """
    n = int(parents.numel())
    vis = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    if n == 0:
        return vis
    rows = torch.arange(n, device=parents.device)
    cur = rows.clone()  # each node's current ancestor-or-self on the walk up; -1 once past the root
    for _ in range(n if max_depth is None else int(max_depth)):  # a depth-d node has d entries (itself + d - 1)
        alive = cur >= 0
        col = cur.clamp(min=0)
        vis[rows, col] = vis[rows, col] | alive  # no boolean indexing: no data-dependent shape
        cur = torch.where(alive, parents[col], torch.full_like(cur, -1))
        if max_depth is None and not bool((cur >= 0).any()):
            break
    return vis


def _node_visibility(structure: DraftStructure, device: torch.device) -> torch.Tensor:
    """``[N, N]`` bool node-level visibility."""
    n = structure.num_nodes
    if structure.visibility == "self":
        return torch.eye(n, dtype=torch.bool, device=device)
    for i, par in enumerate(structure.parents):
        if len([q for q in par if q >= 0]) > 1:
            raise ValueError(f"node {i} has {len(par)} parents: 'ancestors' visibility needs a tree")
    parents = device_tensor([next((q for q in par if q >= 0), -1) for par in structure.parents], torch.long, device)
    return tree_ancestor_mask(parents)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return torch.where(visible, zero, neg)


def compile_packed(
    structure: DraftStructure,
    context_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    context_visible: torch.Tensor | None = None,
    prefix_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> CompiledDraft:
    """Pack every node's rows into one sequence with a 4-D additive visibility mask.

    No package code calls this today (DDTree uses the vectorised :func:`compile_tree`; Spiffy builds its own
    inputs); it is kept as the general reference layout (multi-row nodes, ``"self"`` or ``"ancestors"``
    visibility, real prefix rows) that :func:`compile_tree` is tested against.

    Args:
        structure: the draft nodes.
        context_len: ``C``, number of cached (committed) positions every row may see.
        dtype: mask dtype (use the model's compute dtype).
        device: target device (default: the device of the first node's tokens).
        context_visible: optional ``[R, C]`` bool; which cached positions each row sees (default: all).
        prefix_rows: optional ``(tokens [P], positions [P])`` of *real* rows placed before the nodes (e.g. the
            DDTree root / the real Spiffy state). Real rows see the context and each other (bidirectionally for a
            span, i.e. as one ``"self"`` node) and never see draft rows; with ``"ancestors"`` visibility every
            node additionally sees all prefix rows (they are its ancestors).
    Returns:
        :class:`CompiledDraft` with ``input_ids [1, R]``, ``position_ids [1, R]``, ``attention_mask [1, 1, R, C+R]``;
        ``row_offsets`` count prefix rows as node ``0`` when ``prefix_rows`` is given.
    """
    dev = torch.device(device) if device is not None else (structure.tokens[0].device if structure.tokens else torch.device("cpu"))
    tok = [t.to(dev) for t in structure.tokens]
    pos = [p.to(dev) for p in structure.positions]
    sizes = [int(t.numel()) for t in tok]
    node_vis = _node_visibility(structure, dev)
    # Expand node-level visibility to rows: row r of node a sees row s of node b iff node_vis[a, b].
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=dev), device_tensor(sizes, torch.long, dev)) if sizes else torch.zeros(0, dtype=torch.long, device=dev)
    draft_vis = node_vis[owner][:, owner] if owner.numel() else torch.zeros(0, 0, dtype=torch.bool, device=dev)
    n_pre = 0 if prefix_rows is None else int(prefix_rows[0].numel())
    r_draft = int(owner.numel())
    r = n_pre + r_draft
    vis = torch.zeros(r, r, dtype=torch.bool, device=dev)
    vis[n_pre:, n_pre:] = draft_vis
    if n_pre:
        vis[:n_pre, :n_pre] = True
        if structure.visibility == "ancestors":
            vis[n_pre:, :n_pre] = True
        tok = [prefix_rows[0].to(dev)] + tok  # type: ignore[index]
        pos = [prefix_rows[1].to(dev)] + pos  # type: ignore[index]
    ctx = torch.ones(r, context_len, dtype=torch.bool, device=dev)
    if context_visible is not None:
        if tuple(context_visible.shape) != (r, context_len):
            raise ValueError(f"context_visible must be [{r}, {context_len}], got {tuple(context_visible.shape)}")
        ctx = context_visible.to(dev, torch.bool)
    full = torch.cat([ctx, vis], dim=1)
    input_ids = torch.cat(tok).view(1, r) if tok else torch.zeros(1, 0, dtype=torch.long, device=dev)
    position_ids = torch.cat(pos).view(1, r) if pos else torch.zeros(1, 0, dtype=torch.long, device=dev)
    offsets = [0] + ([n_pre] if n_pre else [])
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return CompiledDraft(input_ids, position_ids, _additive(full, dtype).view(1, 1, r, context_len + r), offsets)


def compile_batched(
    structure: DraftStructure,
    context_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> CompiledDraft:
    """Stack equal-length ``"self"``-visibility spans in the batch dimension.

    No package code calls this today; it is kept for batched verification (several sequences or drafts in the
    batch dimension, issue 14), where it replaces the packed layout when no node needs to see another.

    Each batch row is one node seeing the ``C`` cached positions and its own ``S`` rows (a cache of batch 1 is
    broadcast by the models). Returns ``input_ids [N, S]``, ``position_ids [N, S]``, ``attention_mask
    [N, 1, S, C + S]`` (all zeros: everything in reach is visible).
    """
    if structure.visibility != "self":
        raise ValueError("compile_batched only supports 'self' visibility; use compile_packed for trees")
    if not structure.tokens:
        raise ValueError("compile_batched needs at least one node")
    sizes = {int(t.numel()) for t in structure.tokens}
    if len(sizes) != 1:
        raise ValueError(f"compile_batched needs equal-length spans, got lengths {sorted(sizes)}")
    dev = torch.device(device) if device is not None else structure.tokens[0].device
    ids = torch.stack([t.to(dev) for t in structure.tokens])
    pos = torch.stack([p.to(dev) for p in structure.positions])
    n, s = ids.shape
    mask = torch.zeros(n, 1, s, context_len + s, dtype=dtype, device=dev)
    return CompiledDraft(ids, pos, mask, None)


def compile_tree(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    parents: torch.Tensor,
    context_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    prefix_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_depth: int | None = None,
) -> CompiledDraft:
    """Vectorised :func:`compile_packed` for trees whose nodes are single tokens (DDTree).

    Same result as ``compile_packed(DraftStructure([t] per node, [p] per node, parents, "ancestors"), ...)`` without
    any per-node Python work (a 1024-node tree compiles in one pass of tensor ops).

    Args:
        tokens: ``[N]`` long, node tokens (parents precede children).
        positions: ``[N]`` long, node position ids.
        parents: ``[N]`` long, parent node index, ``-1`` for children of the root.
        context_len: ``C``, cached positions every row sees.
        dtype: mask dtype.
        device: target device (default: ``tokens.device``).
        prefix_rows: optional ``(tokens [P], positions [P])`` real rows (the root) placed first; every node sees them.
        max_depth: the tree's depth if known (see :func:`tree_ancestor_mask`: no per-level host synchronisation).
    Returns:
        :class:`CompiledDraft` with ``input_ids [1, R]``, ``position_ids [1, R]``, ``attention_mask [1, 1, R, C+R]``
        (``R = P + N``) and ``row_offsets`` = ``[0, P, P+1, ..., P+N]`` (prefix rows as node 0 when given).
    """
    dev = torch.device(device) if device is not None else tokens.device
    tokens = tokens.to(dev).reshape(-1)
    positions = positions.to(dev).reshape(-1)
    parents = parents.to(dev).reshape(-1)
    n = int(tokens.numel())
    if positions.numel() != n or parents.numel() != n:
        raise ValueError(f"tokens ({n}), positions ({positions.numel()}) and parents ({parents.numel()}) must have one entry per node")
    if n and bool((parents >= torch.arange(n, device=dev)).any()):
        raise ValueError(PARENT_ORDER_ERROR)
    n_pre = 0 if prefix_rows is None else int(prefix_rows[0].numel())
    r = n_pre + n
    vis = torch.zeros(r, r, dtype=torch.bool, device=dev)
    vis[n_pre:, n_pre:] = tree_ancestor_mask(parents, max_depth)
    if n_pre:
        vis[:n_pre, :n_pre] = True
        vis[n_pre:, :n_pre] = True
    full = torch.cat([torch.ones(r, context_len, dtype=torch.bool, device=dev), vis], dim=1)
    if n_pre:
        ids = torch.cat([prefix_rows[0].to(dev).reshape(-1), tokens])  # type: ignore[index]
        pos = torch.cat([prefix_rows[1].to(dev).reshape(-1), positions])  # type: ignore[index]
    else:
        ids, pos = tokens, positions
    offsets = [0] + ([n_pre] if n_pre else []) + list(range(n_pre + 1, r + 1))
    return CompiledDraft(ids.view(1, r), pos.view(1, r), _additive(full, dtype).view(1, 1, r, context_len + r), offsets)


def _ancestor_pairs(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(node, ancestor)`` index pairs of a tree's ancestor-or-self relation (:func:`tree_ancestor_mask`'s ``True``
    entries), from its parent list (``-1`` = a child of the root; parents precede children)."""
    chains: list[list[int]] = []
    nodes: list[int] = []
    ancestors: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(PARENT_ORDER_ERROR)
        chain = (chains[p] if p >= 0 else []) + [i]
        chains.append(chain)
        nodes.extend([i] * len(chain))
        ancestors.extend(chain)
    return torch.tensor(nodes, dtype=torch.long), torch.tensor(ancestors, dtype=torch.long)


def compile_tree_rows(
    trees: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    prefix_rows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    context_visible: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    pad_token: int = 0,
    max_depths: Sequence[int] | None = None,
    staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[CompiledDraft, list[int]]:
    """One tree per batch row (batched DDTree / DFlash verification; one prompt is a batch of one): each row laid
    out as :func:`compile_tree` lays it out, padded to the longest row and stacked, with a per-row view of the
    shared cache.

    Args:
        trees: per batch row ``(tokens [N_b], positions [N_b], parents [N_b])`` as in :func:`compile_tree` (host
            tensors: the rows are assembled on the host and moved to the device once).
        prefix_rows: per batch row ``(tokens [P_b], positions [P_b])`` real rows placed first (the root).
        context_visible: ``[B, C]`` bool, the cached positions each batch row may see (its committed context; left
            padding and the holes left by other rows' longer commits are ``False``).
        dtype: mask dtype; pad_token: token id of the padding rows.
        max_depths: each row's tree depth when the caller knows it (no host synchronisation per tree level).
        staging: preallocated host buffers ``(ids [B', W'], positions [B', W'], visible [B', W', W'] bool)`` with
            ``B' >= B`` and ``W' >= R``, reused across calls (a generation allocates them once for its widest
            round); ``None`` allocates them here.
    Returns:
        ``(compiled, rows)``: ``input_ids`` / ``position_ids`` ``[B, R]`` and ``attention_mask [B, 1, R, C + R]``
        (``R`` = the longest ``P_b + N_b``); batch row ``b`` occupies rows ``[0, rows[b])`` (prefix then nodes, as
        in :func:`compile_tree`); padding rows see only themselves and are never read. ``row_offsets`` is ``None``.
    """
    if len(trees) != len(prefix_rows) or len(trees) != int(context_visible.shape[0]):
        raise ValueError(f"{len(trees)} trees, {len(prefix_rows)} prefixes and {int(context_visible.shape[0])} "
                         "context rows must match (one per batch row)")
    dev = context_visible.device
    context_len = int(context_visible.shape[1])
    if len(trees) == 1 and trees[0][2].device.type == "cpu":  # one prompt, a host tree: no staging, no padding
        prefix = (prefix_rows[0][0].reshape(-1).tolist(), prefix_rows[0][1].reshape(-1).tolist())
        ids, pos, additive = compile_one_host_tree(trees[0], prefix, context_visible, dtype)
        return CompiledDraft(ids, pos, additive, None), [int(ids.shape[1])]
    pres = [int(pre[0].numel()) for pre in prefix_rows]
    rows = [p + int(tok.numel()) for (tok, _p, _q), p in zip(trees, pres)]
    width = max(rows) if rows else 0
    batch = len(trees)
    if staging is None:
        staging = (torch.empty(batch, width, dtype=torch.long), torch.empty(batch, width, dtype=torch.long),
                   torch.empty(batch, width, width, dtype=torch.bool))
    if staging[0].shape[0] < batch or staging[0].shape[1] < width:
        raise ValueError(f"staging buffers {tuple(staging[0].shape)} are smaller than the round [{batch}, {width}]")
    ids, pos, vis = staging[0][:batch, :width], staging[1][:batch, :width], staging[2][:batch, :width, :width]
    vis.zero_()
    for b, ((tok, tpos, par), (pre_tok, pre_pos)) in enumerate(zip(trees, prefix_rows)):
        n_pre, r = pres[b], rows[b]
        n = r - n_pre
        ids[b, :n_pre] = pre_tok.reshape(-1)
        pos[b, :n_pre] = pre_pos.reshape(-1)
        vis[b, :r, :n_pre] = True  # the prefix sees itself, every node sees the prefix
        if n:
            ids[b, n_pre:r] = tok.reshape(-1)
            pos[b, n_pre:r] = tpos.reshape(-1)
            if par.device.type == "cpu":  # a host tree: its ancestor pairs in Python, one scatter
                node, ancestor = _ancestor_pairs(par.reshape(-1).tolist())
                vis[b, n_pre:r, n_pre:r][node, ancestor] = True
            else:
                if bool((par >= torch.arange(n, device=par.device)).any()):
                    raise ValueError(PARENT_ORDER_ERROR)
                vis[b, n_pre:r, n_pre:r] = tree_ancestor_mask(par.reshape(-1), None if max_depths is None
                                                              else max_depths[b]).cpu()
        if r < width:  # padding rows: the pad token at the last position, each sees only itself
            ids[b, r:] = int(pad_token)
            pos[b, r:] = pos[b, r - 1] if r else 0
            vis[b, r:, r:].fill_diagonal_(True)
    # the additive mask written in two blocks (no [B, R, C + R] boolean intermediate): the cached columns, one row
    # of each batch row broadcast down its verification rows, and the tree block
    zero = torch.zeros((), dtype=dtype, device=dev)
    hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dev)
    additive = torch.empty(batch, 1, width, context_len + width, dtype=dtype, device=dev)
    additive[:, 0, :, :context_len] = torch.where(context_visible.to(torch.bool), zero, hidden).unsqueeze(1)
    for b, r in enumerate(rows):
        if r < width:
            additive[b, 0, r:, :context_len] = hidden  # padding rows see no cached position
    additive[:, 0, :, context_len:] = torch.where(vis.to(dev), zero, hidden)
    compiled = CompiledDraft(ids.to(dev), pos.to(dev), additive, None)
    return compiled, rows


def follow(
    root: NodeT,
    next_state: Callable[[NodeT], StateT],
    child_matching: Callable[[NodeT, StateT], NodeT | None],
    max_steps: int | None = None,
) -> tuple[list[NodeT], StateT]:
    """Walk a verified draft structure from ``root`` by the target's own decoding rule.

    Args:
        root: the node holding the real state.
        next_state: ``node -> state``: apply the target's decoding rule at ``node`` (e.g. the target's token at a
            tree node, or the baseline transition applied to a draft's distribution).
        child_matching: ``(node, state) -> child or None``: the child of ``node`` equal to ``state``.
        max_steps: the most nodes the walk may accept (a tree: its node count; a Spiffy walk: the block's steps);
            ``None``: bounded by the structure alone (children strictly deeper). Past it: :class:`StepLimitError`.
    Returns:
        ``(accepted, final_state)``: the accepted nodes in order (root excluded) and the first state that matched
        no child (the DDTree bonus token / the Spiffy state after the last accepted draft).
    """
    accepted: list[NodeT] = []
    node = root
    while True:
        state = next_state(node)
        child = child_matching(node, state)
        if child is None:
            return accepted, state
        if max_steps is not None and len(accepted) >= max_steps:
            raise StepLimitError(
                f"the verification walk accepted {len(accepted)} nodes and found another child, past max_steps="
                f"{max_steps}; the structure has a cycle or a child_matching that never ends; fix: make every "
                "accepted child a strictly deeper node"
            )
        accepted.append(child)
        node = child
