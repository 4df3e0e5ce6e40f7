"""Which tree a captured AR round builds on the device, and the step that builds it: :func:`round_tree` (one row's,
by eager kernels), :class:`TreePlan` and :func:`tree_program` (every row's inside one ``("tree", ...)`` step of the
target's :class:`~spiffy.capture.StepGraphs`, the drafts' lengths as data), and the host draws a sampled row reads
(:func:`tree_uniforms`, :func:`tree_races`). How the round walks the trees: :mod:`spiffy.arspec.captured_walk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spiffy.arspec.device_draws import SampledDeviceTree, sampled_tree_device
from spiffy.arspec.device_rejection import Proposals
from spiffy.arspec.device_selector import selector_chain_device, selector_sampled_device, selector_tree_device
from spiffy.arspec.device_tree import DeviceTree, chain_device, ddtree_device, ddtree_node_count
from spiffy.arspec.methods import BestTree, Chain, DraftKnobs, Method
from spiffy.arspec.sampling import tempered
from spiffy.arspec.selector import Draft, SelectorDraft, selector_exponentials
from spiffy.arspec.selfselect import (draft_temperature, draft_uniforms, drafts_from_uniforms, proposal_probs,
                                      sample_drafts)
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import on_device

__all__ = ["TreePlan", "ddtree_of", "draft_length", "plain_tree", "round_tree", "tree_plan", "tree_program",
           "tree_races", "tree_uniforms", "with_root"]


def with_root(depths: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` every verification row's depth (the root's 0, then ``depths [B, R - 1]``)."""
    return torch.cat([torch.zeros(int(depths.shape[0]), 1, dtype=torch.long, device=depths.device), depths], 1)


def round_tree(method: Method, config: DraftKnobs, draft: Draft | None, root_position: int
                ) -> DeviceTree | SampledDeviceTree | None:
    """The round's tree built on the device (a sampled one for drafts drawn from the drafter: DEER and DFlash under
    the rejection rule at T > 0, SpecDiff-2, and the same walked through a DFlash2 selector), or ``None`` when the
    method builds it on the host only (a method of another kind)."""
    if draft is None:
        return None
    if isinstance(draft, SelectorDraft):  # DFlash2: its DDTree, greedy chain and sampled drafts
        if isinstance(method, BestTree):
            return selector_tree_device(draft, int(config.budget), float(config.sampling.temperature))
        if isinstance(method, Chain) and method.samples(config):
            n = method.sample_count(config)
            races = selector_exponentials(config.sampling, n, draft.depth, int(draft.candidates.shape[1]),
                                          root_position)
            return selector_sampled_device(draft, n, draft_temperature(config.sampling),
                                           on_device(races, draft.candidates.device))
        if isinstance(method, Chain):
            return selector_chain_device(draft)
        return None
    if isinstance(method, BestTree):
        return ddtree_of(draft, int(config.budget), float(config.sampling.temperature))
    if isinstance(method, Chain) and method.samples(config):
        probs = proposal_probs(draft, config.sampling)
        return sampled_tree_device(probs, sample_drafts(probs, method.sample_count(config), config.sampling,
                                                        root_position))
    if type(method) is Chain:
        return chain_device(draft)
    return None


def ddtree_of(draft: torch.Tensor, budget: int, temperature: float, length: torch.Tensor | None = None
              ) -> DeviceTree:
    """DDTree's tree of ``draft [L, V]`` logits: the best-first tree of their tempered log-probabilities (of the
    first ``length`` rows when that 0-d tensor is given: :func:`~spiffy.arspec.device_tree.ddtree_device`)."""
    return ddtree_device(torch.log_softmax(tempered(draft, temperature), dim=-1), budget, length)


def plain_tree(tree: DeviceTree | SampledDeviceTree) -> DeviceTree:
    """The tree of a sampled tree (its nodes), or the tree itself."""
    return tree.tree if isinstance(tree, SampledDeviceTree) else tree


@dataclass(frozen=True)
class TreePlan:
    """Every row's tree when it is built inside a captured step from the round's drafts (hashable: part of the tree
    bucket's key). ``rows``: per row ``("ddtree", depth, budget, temperature, vocab)`` (DDTree over the
    tempered draft), ``("chain", depth)`` (the DFlash chain), ``("sampled", depth, drafts, temperature, top_k,
    top_p)`` (``drafts`` joint drafts drawn from the drafter: DEER and DFlash under the rejection rule at T > 0,
    SpecDiff-2), DFlash2's ``("selector_tree", depth, budget, temperature, candidates, vocab)`` (DDTree over its
    selector), ``("selector_chain", depth, candidates, vocab)`` (its greedy chain) and ``("selector_sampled", depth,
    drafts, temperature, candidates, vocab)`` (drafts walked through its selector at the draft temperature), or
    ``("none",)`` (no draft this round). A row's ``depth`` is the generation's deepest draft: the draft's own
    length is data of the step (:func:`tree_program`'s ``lengths``), so the last rounds of a generation, whose
    drafts stop at ``max_new_tokens``, replay the same bucket."""

    rows: tuple[tuple, ...]

    def counts(self) -> list[int]:
        """Each row's node count for a draft of the generation's depth (an upper bound: a shorter draft's tree, and
        a sampled tree, have their real count on the device)."""
        bound = {"ddtree": lambda r: ddtree_node_count(r[2], r[1], r[4]), "chain": lambda r: r[1],
                 "sampled": lambda r: r[1] * r[2], "selector_tree": lambda r: ddtree_node_count(r[2], r[1], r[4]),
                 "selector_chain": lambda r: r[1], "selector_sampled": lambda r: r[1] * r[2], "none": lambda r: 0}
        return [bound[r[0]](r) for r in self.rows]

    @property
    def depth(self) -> int:
        """The deepest draft (the draft buffer's length)."""
        return max([r[1] for r in self.rows if r[0] != "none"], default=0)

    @property
    def draws(self) -> int:
        """The most drafts a sampled row draws (``0``: no row samples): the width of the proposals' draws buffer."""
        return max(self.drafts_of("sampled"), self.drafts_of("selector_sampled"))

    def drafts_of(self, kind: str) -> int:
        """The most drafts a row of ``kind`` (``"sampled"``, ``"selector_sampled"``) draws (``0``: no such row)."""
        return max([r[2] for r in self.rows if r[0] == kind], default=0)

    @property
    def q_rows(self) -> int:
        """Rows of the proposals' ``q`` buffer: a sampled row's depths, a DFlash2 sampled row's root and nodes."""
        return max([r[1] if r[0] == "sampled" else 1 + r[1] * r[2] for r in self.rows
                    if r[0] in ("sampled", "selector_sampled")], default=0)

    @property
    def point_mass(self) -> bool:
        """Whether some row's tree is chosen by rank (DDTree, the chain), whose children are point-mass proposals."""
        return any(self.point_rows())

    def point_rows(self) -> list[bool]:
        """Per row, whether its tree is chosen by rank (its children are point-mass proposals)."""
        return [r[0] in ("ddtree", "chain", "selector_tree", "selector_chain") for r in self.rows]

    @property
    def candidates(self) -> int:
        """The selector's candidates per depth (``0``: no DFlash2 row)."""
        return max([r[-2] for r in self.rows if r[0].startswith("selector")], default=0)


def tree_plan(methods: Sequence[Method], configs: Sequence[DraftKnobs], drafts: Sequence[Draft | None],
              depth: int) -> TreePlan | None:
    """The round's :class:`TreePlan` when every row's tree is one :func:`round_tree` builds from its draft alone
    (DDTree, the greedy DFlash chain, drafts sampled from the drafter, DFlash2's DDTree and greedy chain over
    its selector, drafts walked through it), else ``None`` (a method of another kind: built on the host). ``depth``:
    the generation's deepest draft (at least every draft's length)."""
    rows: list[tuple] = []
    for method, config, draft in zip(methods, configs, drafts):
        if draft is None:
            rows.append(("none",))
        elif isinstance(draft, SelectorDraft):
            k = int(draft.candidates.shape[1])
            if isinstance(method, BestTree):
                rows.append(("selector_tree", int(depth), int(config.budget), float(config.sampling.temperature),
                             k, int(draft.vocab_size)))
            elif isinstance(method, Chain) and method.samples(config):
                rows.append(("selector_sampled", int(depth), int(method.sample_count(config)),
                             draft_temperature(config.sampling), k, int(draft.vocab_size)))
            elif isinstance(method, Chain):
                rows.append(("selector_chain", int(depth), k, int(draft.vocab_size)))
            else:
                return None
        elif not isinstance(draft, torch.Tensor):
            return None
        elif isinstance(method, BestTree):
            rows.append(("ddtree", int(depth), int(config.budget), float(config.sampling.temperature),
                         int(draft.shape[-1])))
        elif isinstance(method, Chain) and method.samples(config):
            s = config.sampling
            rows.append(("sampled", int(depth), int(method.sample_count(config)), float(s.temperature),
                         int(s.top_k), float(s.top_p)))
        elif type(method) is Chain:
            rows.append(("chain", int(depth)))
        else:
            return None
    return TreePlan(tuple(rows))


def draft_length(draft: Draft | None) -> int:
    """How many positions ``draft`` drafts (``0``: no draft)."""
    if draft is None:
        return 0
    return draft.depth if isinstance(draft, SelectorDraft) else int(draft.shape[0])


def tree_uniforms(plan: TreePlan, configs: Sequence[DraftKnobs], roots: Sequence[tuple[int, int]],
                  lengths: Sequence[int]) -> torch.Tensor:
    """``[B, L, K]`` float64 host uniforms of the sampled rows' draws (``L = plan.depth``, ``K = plan.draws``; row
    ``b``'s first ``lengths[b] x drafts`` are :func:`~spiffy.arspec.selfselect.draft_uniforms` keyed by its root
    position, exactly what :func:`~spiffy.arspec.selfselect.sample_drafts` draws with; zeros elsewhere)."""
    out = torch.zeros(len(plan.rows), plan.depth, plan.drafts_of("sampled"), dtype=torch.float64)
    for b, (row, config, (_tok, pos), length) in enumerate(zip(plan.rows, configs, roots, lengths)):
        if row[0] == "sampled" and length and row[2]:
            out[b, :length, : row[2]] = draft_uniforms(config.sampling, row[2], int(length), pos)
    return out


def tree_races(plan: TreePlan, configs: Sequence[DraftKnobs], roots: Sequence[tuple[int, int]],
               lengths: Sequence[int]) -> torch.Tensor:
    """``[B, n, L, K]`` float64 host exponentials of the DFlash2 rows' sampled drafts (``n`` the most drafts, ``K``
    the candidates): row ``b``'s first ``drafts x lengths[b]`` are
    :func:`~spiffy.arspec.selector.selector_exponentials` keyed by its root position, exactly what
    :meth:`~spiffy.arspec.selector.SelectorDraft.sample_tree` races with; zeros elsewhere."""
    out = torch.zeros(len(plan.rows), plan.drafts_of("selector_sampled"), plan.depth, plan.candidates,
                      dtype=torch.float64)
    for b, (row, config, (_tok, pos), length) in enumerate(zip(plan.rows, configs, roots, lengths)):
        if row[0] == "selector_sampled" and length and row[2]:
            out[b, : row[2], :length, : row[4]] = selector_exponentials(config.sampling, row[2], int(length), row[4],
                                                                        pos)
    return out


def tree_program(plan: TreePlan, drafts: torch.Tensor | None, lengths: torch.Tensor, ids: torch.Tensor,
                 parents: torch.Tensor, depths: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor,
                 uniforms: torch.Tensor | None = None, proposals: Proposals | None = None,
                 selector: SelectorDraft | None = None, races: torch.Tensor | None = None) -> None:
    """Write every row's tree (:func:`round_tree`'s, node for node) into the round buffers (a tensor program).

    Args:
        drafts: ``[B, L, V]`` the rows' draft logits (row ``b``'s first ``lengths[b]`` positions); lengths: ``[B]``
            long, each draft's length (data: a DDTree or chain row's tree stops there).
        ids, positions: ``[B, R]`` (column 0, the root's token and position, already written); parents, depths:
            ``[B, R - 1]``; counts: ``[B]``. Padding nodes (token 0, parent -1, depth 1) fill what the trees leave.
        uniforms: ``[B, L, K]`` float64 (:func:`tree_uniforms`), with a ``"sampled"`` row.
        proposals: with ``plan.draws > 0``, the buffers a sampled tree's draws go to for the rejection walk
            (:class:`~spiffy.arspec.device_rejection.Proposals`: ``draws [B, R, K]``, ``q [B, plan.q_rows, V]``
            float64, ``q_row [B, R]``), laid out as :func:`~spiffy.arspec.device_rejection.round_proposals` lays
            them out.
        selector: with DFlash2 rows, their drafts batched (``candidates [B, L, K]``, ``first [B, K]``, ``following
            [B, L - 1, K, K]``); ``drafts`` may then be ``None`` (no row drafts logits).
        races: ``[B, n, L, K]`` float64 (:func:`tree_races`), with a ``"selector_sampled"`` row.
    """
    parents.fill_(-1)
    depths.fill_(1)
    ids[:, 1:] = 0
    counts.zero_()
    if proposals is not None:
        assert proposals.q is not None and proposals.q_row is not None
        proposals.draws.fill_(-1)
        proposals.q.zero_()
    node_rows = []  # (row, proposal_rows) of the DFlash2 sampled rows: their q is per node
    for b, row in enumerate(plan.rows):
        if row[0] == "none":
            continue
        if row[0] == "selector_sampled":
            assert selector is not None and races is not None and proposals is not None and proposals.q is not None
            mine = SelectorDraft(selector.candidates[b], selector.first[b], selector.following[b], row[-1])
            drawn = selector_sampled_device(mine, row[2], row[3], races[b, : row[2]], lengths[b])
            proposals.draws[b, : drawn.draws.shape[0], : row[2]] = drawn.draws
            proposals.q[b, : drawn.proposal.shape[0]] = drawn.proposal
            node_rows.append((b, drawn.proposal_rows))
            _write_tree(b, drawn.tree, drawn.real, ids, parents, depths, counts)
            continue
        if row[0].startswith("selector"):
            assert selector is not None
            mine = SelectorDraft(selector.candidates[b], selector.first[b], selector.following[b], row[-1])
            tree = (selector_tree_device(mine, row[2], row[3], lengths[b]) if row[0] == "selector_tree"
                    else selector_chain_device(mine, lengths[b]))
            _write_tree(b, tree, tree.real, ids, parents, depths, counts)
            continue
        assert drafts is not None
        draft = drafts[b, : row[1]]
        if row[0] == "sampled":
            assert uniforms is not None and proposals is not None and proposals.q is not None
            sampling = SamplingConfig(temperature=row[3], top_k=row[4], top_p=row[5])
            probs = proposal_probs(draft, sampling)
            drawn = sampled_tree_device(probs, drafts_from_uniforms(probs, uniforms[b, : row[1], : row[2]]),
                                        lengths[b])
            proposals.draws[b, : drawn.draws.shape[0], : row[2]] = drawn.draws
            proposals.q[b, : row[1]] = probs
            _write_tree(b, drawn.tree, drawn.real, ids, parents, depths, counts)
        else:
            length = lengths[b]
            tree = ddtree_of(draft, row[2], row[3], length) if row[0] == "ddtree" else chain_device(draft, length)
            _write_tree(b, tree, tree.real, ids, parents, depths, counts)
    positions[:, 1:] = positions[:, :1] + depths
    if proposals is not None:  # a leaf's depth may be past the last q row: it draws nothing, any row serves
        assert proposals.q_row is not None
        proposals.q_row.copy_(with_root(depths).clamp(max=plan.depth - 1))
        for b, rows in node_rows:
            proposals.q_row[b, : rows.shape[0]] = rows


def _write_tree(b: int, tree: DeviceTree, real: torch.Tensor | None, ids: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, counts: torch.Tensor) -> None:
    """Row ``b``'s tree into the round buffers with its real node count (0-d, on the device: a tree built with the
    draft's length as data has a data-dependent count)."""
    assert real is not None
    n = int(tree.tokens.numel())
    ids[b, 1 : 1 + n] = tree.tokens
    parents[b, :n] = tree.parents
    depths[b, :n] = tree.depths
    counts[b] = real
