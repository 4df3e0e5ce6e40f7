"""DFlash2's deterministic drafts built on the device: the tensor-program twins of
:meth:`SelectorDraft.chain <spiffy.arspec.selector.SelectorDraft.chain>` and
:meth:`SelectorDraft.best_tree <spiffy.arspec.selector.SelectorDraft.best_tree>` for the captured path
(:mod:`spiffy.arspec.captured`): static shapes, nothing read to the host, the host builders' nodes in their order.

**The chain** (:func:`selector_chain_device`): each depth's argmax of the raw scores in the row of the previous
choice, one ``index_select`` and one ``argmax`` per depth (the host's ``argmax``: the first maximal index), and the
score summed one depth at a time in float64 (the host's order of additions, so the values are bit for bit its own).

**The tree** (:func:`selector_tree_device`): the level-by-level selection of
:func:`~spiffy.arspec.device_tree.best_prefixes` (the one DDTree's :func:`~spiffy.arspec.device_tree.ddtree_device`
runs), with each kept parent ranking the next depth's ``K`` candidates by its own row of ``log q`` (the parent's
candidate index is carried down as ``after``): probability descending, equal probabilities by token id ascending,
equal tokens by candidate index (a stable sort by token, then a stable descending sort by value: Python's ``sorted``
on the host). A candidate of ``log q = -inf`` is invalid, so how many nodes the tree has depends on the data: the
tree is padded to the static bound ``count`` and its real node count rides along as the 0-d :attr:`DeviceTree.real`.

**Sampled drafts** (:func:`selector_sampled_device`, :meth:`SelectorDraft.sample_tree`'s twin, the rejection rule at
``T > 0``): every draft's walk through the chain at once, one exponential race per depth over the host's exponentials
(:func:`~spiffy.arspec.selector.race_draw`, :func:`~spiffy.arspec.selector.selector_exponentials`), merged as
:func:`~spiffy.arspec.device_draws.merged_drafts` merges any joint drafts; below each node, the ``q`` of its token's
row over the next depth's candidates, dense over the vocabulary (what the rejection walk reads).

All three compute ``log q`` (and the sampled drafts ``q``) as the host does (``log_softmax`` / ``softmax`` of
:func:`~spiffy.arspec.sampling.tempered` float64 scores, row by row), so on the CPU the scores, draws and proposals
are the host's bit for bit. Rows whose scores are all ``-inf`` (``log q`` NaN) have no order on the host either and
are not supported.
"""

from __future__ import annotations

import torch

from spiffy.arspec.device_draws import SampledDeviceTree, merged_drafts, placed, running_sums
from spiffy.arspec.device_tree import DeviceTree, best_prefixes, cut_chain, ddtree_node_count, padded_tree
from spiffy.arspec.sampling import tempered
from spiffy.arspec.selector import SelectorDraft, race_draw
from spiffy.errors import ConfigError

__all__ = ["selector_chain_device", "selector_sampled_device", "selector_tree_device"]


def selector_chain_device(draft: SelectorDraft, length: torch.Tensor | None = None) -> DeviceTree:
    """:meth:`SelectorDraft.chain`'s greedy chain (``D`` nodes: tokens, parents ``-1 .. D - 2``, depths ``1 .. D``,
    cumulative ``log q`` at temperature 1 in float64) as ``[D]`` tensors on the draft's device; ``length`` (0-d long,
    ``<= D``): the chain of the first ``length`` depths, padded to ``D`` nodes (its count in :attr:`DeviceTree.real`:
    one captured tree step for every draft length)."""
    depth = draft.depth
    dev = draft.candidates.device
    if depth == 0:
        return padded_tree(0, 0, dev)
    cands = draft.candidates.long()  # [D, K]
    raw_first, raw_next = draft.first.double(), draft.following.double()  # [K], [D - 1, K, K]
    logq_first, logq_next = torch.log_softmax(raw_first, -1), torch.log_softmax(raw_next, -1)
    index = raw_first.argmax().view(1)  # [1]: a tensor index, never a host int
    tokens, scores = [cands[0].index_select(0, index)], [logq_first.index_select(0, index)]
    for d in range(depth - 1):
        nxt = raw_next[d].index_select(0, index).argmax(-1)  # [1] the best candidate after the previous choice
        # one float64 addition per depth, as the host's running sum (a cumsum could add in another order)
        scores.append(scores[-1] + logq_next[d].index_select(0, index).gather(1, nxt.view(1, 1)).view(1))
        index = nxt
        tokens.append(cands[d + 1].index_select(0, index))
    ramp = torch.arange(depth, device=dev)
    return cut_chain(DeviceTree(torch.cat(tokens), ramp - 1, ramp + 1, torch.cat(scores), depth), length)


def selector_tree_device(draft: SelectorDraft, budget: int, temperature: float,
                         length: torch.Tensor | None = None) -> DeviceTree:
    """:meth:`SelectorDraft.best_tree`'s ``budget``-node DDTree at ``temperature`` (``0``: unscaled scores) as
    ``[budget]`` tensors on the draft's device: the host's nodes in its order first, ``count`` the static bound
    (:func:`~spiffy.arspec.device_tree.ddtree_node_count` of ``budget``, ``D`` depths and ``K`` candidates), ``real``
    the 0-d number of real nodes (fewer when candidates of probability 0 are skipped), padding after them.
    ``length`` (0-d long, ``<= D``): the tree of the first ``length`` depths in the shapes of ``D`` (a deeper child
    is invalid, as :func:`~spiffy.arspec.device_tree.ddtree_device` takes it)."""
    if budget < 0:
        raise ConfigError(f"tree budget must be >= 0, got {budget}; fix: pass budget=0 (plain AR) or more")
    depth, width = draft.depth, int(draft.candidates.shape[1])
    dev = draft.candidates.device
    bound = ddtree_node_count(int(budget), depth, width)
    if bound == 0:
        return padded_tree(int(budget), 0, dev)
    cands = draft.candidates.long()  # [D, K]
    logq_first = torch.log_softmax(tempered(draft.first.double(), temperature), dim=-1)  # [K]
    logq_next = torch.log_softmax(tempered(draft.following.double(), temperature), dim=-1)  # [D - 1, K, K]
    k = min(int(budget), width)  # a rank >= budget never pops: its better siblings fill the budget first
    by_token = torch.sort(cands, dim=-1, stable=True).indices  # [D, K] candidate indices by token id, stable
    drafted = None if length is None else torch.arange(depth, device=dev) < length  # [D]

    def ranked(d: int, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Depth ``d``'s candidates ranked below each parent (``after [P]``: the parents' candidate indices)."""
        rows = logq_first.unsqueeze(0) if d == 0 else logq_next[d - 1].index_select(0, after)  # [P, K]
        by_tok = by_token[d].expand(int(rows.shape[0]), width)
        vals, pos = torch.sort(rows.gather(1, by_tok), dim=-1, descending=True, stable=True)
        idx = by_tok.gather(1, pos)[:, :k]  # [P, k] candidate indices, best first
        vals = vals[:, :k]
        ok = vals != float("-inf")
        return vals, cands[d][idx], idx, ok if drafted is None else ok & drafted[d]

    tree, real = best_prefixes(ranked, depth, k, int(budget), dev)
    tree.count, tree.real = bound, real
    return tree


def selector_sampled_device(draft: SelectorDraft, num_drafts: int, temperature: float, races: torch.Tensor,
                            length: torch.Tensor | None = None) -> SampledDeviceTree:
    """:meth:`SelectorDraft.sample_tree`'s tree of ``num_drafts`` drafts at the draft ``temperature``
    (:func:`~spiffy.arspec.selfselect.draft_temperature`) with the round's exponentials ``races [n, D, K]``
    (:func:`~spiffy.arspec.selector.selector_exponentials`, on the draft's device), padded to ``N = n * D`` nodes
    (the host's nodes in its order first, their count in ``real``). ``draws [1 + N, n]`` lists the draws below the
    root and each node in draw order; ``proposal [1 + N, V]`` float64 the ``q`` they came from (row ``i + 1``: node
    ``i``'s, zeros where nothing is drawn), ``proposal_rows`` ``0 .. N``. ``length``: as
    :func:`~spiffy.arspec.device_draws.sampled_tree_device` takes it."""
    depth, width, n = draft.depth, int(draft.candidates.shape[1]), int(num_drafts)
    dev, vocab = draft.candidates.device, int(draft.vocab_size)
    if n <= 0 or depth == 0:
        empty = torch.zeros(max(n, 0), depth, dtype=torch.long, device=dev)
        tree, _slot = merged_drafts(empty, empty.double(), torch.zeros(1, vocab, dtype=torch.float64, device=dev))
        tree.proposal_rows = torch.zeros(1, dtype=torch.long, device=dev)
        return tree
    cands = draft.candidates.long()  # [D, K]
    first, following = draft.first.double() / temperature, draft.following.double() / temperature
    q_first, q_next = torch.softmax(first, -1), torch.softmax(following, -1)  # [K], [D - 1, K, K]
    logq_first, logq_next = torch.log_softmax(first, -1), torch.log_softmax(following, -1)
    index = race_draw(q_first.expand(n, width), races[:, 0])  # [n] each draft's depth-1 candidate
    indices, logs = [index], [logq_first.index_select(0, index)]
    for d in range(1, depth):  # each draft's next candidate given its previous one
        index, row = race_draw(q_next[d - 1].index_select(0, index), races[:, d]), index
        logs.append(logq_next[d - 1, row].gather(1, index.view(n, 1)).view(n))
        indices.append(index)
    chosen = torch.stack(indices, dim=1)  # [n, D] candidate indices
    tokens = cands.t().gather(0, chosen)  # [n, D]: cands[d, chosen[j, d]]
    proposal = torch.zeros(1 + n * depth, vocab, dtype=torch.float64, device=dev)
    drawn, slot = merged_drafts(tokens, running_sums(torch.stack(logs, dim=1)), proposal, length)
    # below node i (depth d_i): its candidate's row of the next depth's q, over that depth's tokens; zeros below a
    # node nothing was drawn below (a leaf, a node at the draft's length, padding)
    node_index = placed(slot, chosen, 0, n * depth)  # [N]
    node_depth = drawn.tree.depths  # [N] (padding: depth 1)
    below = torch.zeros(n * depth, width, dtype=torch.float64, device=dev)
    where = cands[node_depth.clamp(max=depth - 1)]  # [N, K] the next depth's candidates
    if depth > 1:
        drew = drawn.draws[1:, :1] >= 0  # [N, 1]: the draft that made a node draws below it first
        below = q_next[(node_depth - 1).clamp(max=depth - 2), node_index] * drew
    proposal.scatter_add_(1, torch.cat([cands[:1], where]), torch.cat([q_first.view(1, width), below]))
    drawn.proposal_rows = torch.arange(1 + n * depth, device=dev)
    return drawn
