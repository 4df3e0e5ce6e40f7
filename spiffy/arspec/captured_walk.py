"""The device side of a captured AR round: which tree it builds (:func:`round_tree`), how it is walked
(:func:`walk_kind`, :func:`walk_program`) and the round fused into one step.

After the captured verification forward, a round on the device (:class:`~spiffy.arspec.captured_rounds.CapturedRounds`)
still has its tail to run: the target's logits, the target's token at every verification row, the walk (the coupled
rule: :func:`~spiffy.arspec.device_tree.coupled_walk`; the rejection rule at ``T > 0``:
:func:`~spiffy.arspec.device_rejection.rejection_walk`), the commit that moves the kept rows' K/V to the front of the
round's window (one gather and one scatter per layer tensor), and the packing of what the host reads. Run eagerly on
a GPU, that tail is a few hundred kernel launches (two per K/V tensor of every layer alone), several milliseconds a
round on an 8B target, as much as the replayed verification itself.

So the whole round after the tree is **one step** of the target's
:class:`~spiffy.capture.StepGraphs`, bucket ``("round", rows, width, depth, plan)``: verification forward -> logits
-> walk -> commit -> packed ``[rows, 3 + 2 (D + 1)]`` (accepted, bonus, nodes, kept rows, kept tokens), one CUDA
graph replay and then the round's one host read. What the walk needs from the host is made before the replay and
copied into the bucket's static buffers (:class:`WalkInputs`): the Gumbel noise of sampled rows' positions (coupled
rule at ``T > 0``), the rejection rule's coins, a sampled tree's draws and proposal distributions (written by the
round's tree step, :func:`tree_program`, or by the eager kernels of :func:`round_tree`). The rows' sampling
rules are static per bucket (:class:`WalkPlan`, part of the key: temperatures, top-k and top-p are constants of the
captured kernels). A hybrid target's round commits its recurrent state in the same step
(:meth:`~spiffy.arspec.captured_recurrent.StaticRecurrent.commit_inline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spiffy.arspec.device_draws import SampledDeviceTree, sampled_tree_device
from spiffy.arspec.device_rejection import (Proposals, SamplingGroups, children_draws, rejection_coins,
                                            rejection_walk, round_proposals, sampling_groups)
from spiffy.arspec.device_selector import selector_chain_device, selector_sampled_device, selector_tree_device
from spiffy.arspec.device_tree import (DeviceTree, WalkResult, chain_device, coupled_walk, ddtree_device,
                                       ddtree_node_count, position_noise, target_tokens)
from spiffy.arspec.methods import BestTree, Chain, DraftKnobs, Method
from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.rules import AcceptanceRule, CoupledRule
from spiffy.arspec.sampling import tempered
from spiffy.arspec.selector import Draft, SelectorDraft, selector_exponentials
from spiffy.arspec.selfselect import (draft_temperature, draft_uniforms, drafts_from_uniforms, proposal_probs,
                                      sample_drafts)
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import on_device

__all__ = ["TreePlan", "WalkInputs", "WalkPlan", "bucket_groups", "coupled_rows", "ddtree_of", "draft_length",
           "packed_walk", "plain_tree", "round_tree", "rows_of", "rule_walk", "tree_plan", "tree_program", "tree_races",
           "tree_uniforms", "unpack_walk", "walk_inputs", "walk_kind", "walk_program"]


@dataclass(frozen=True)
class WalkPlan:
    """What a round's walk is, static for a bucket (hashable: part of the bucket key).

    Attributes:
        rule: ``"coupled"`` (the coupled rule, or the rejection rule at ``T = 0``), ``"rejection"``, or ``"mixed"``
            (rows of both: :attr:`coupled` says which; both walks run and each row keeps its own rule's).
        samplings: per row ``(temperature, top_k, top_p)``: the rule's constants (seeds enter through the inputs).
        sampled: the rejection rule over sampled drafts (draws with their proposal distributions ``q``); ``False``
            for point-mass proposals (the children's tokens, DDTree) and for the coupled rule.
        mixed: with ``sampled``, some rows' children are point masses (DDTree, the chain) beside the sampled rows
            (:attr:`WalkInputs.point_rows` says which): each row walks by its own kind's rule.
        coupled: with rule ``"mixed"``, per row whether it walks by the coupled rule (:func:`coupled_rows`).
    """

    rule: str
    samplings: tuple[tuple[float, int, float], ...]
    sampled: bool = False
    mixed: bool = False
    coupled: tuple[bool, ...] = ()

    @classmethod
    def of(cls, rule: str, samplings: Sequence[SamplingConfig], sampled: bool = False, mixed: bool = False,
           coupled: Sequence[bool] = ()) -> "WalkPlan":
        return cls(rule, tuple((float(s.temperature), int(s.top_k), float(s.top_p)) for s in samplings),
                   bool(sampled), bool(sampled and mixed), tuple(bool(c) for c in coupled) if rule == "mixed" else ())

    def configs(self) -> list[SamplingConfig]:
        """The rows' sampling rules as configs (no seed: the walk reads none)."""
        return [SamplingConfig(temperature=t, top_k=k, top_p=p) for t, k, p in self.samplings]

    def rule_configs(self, coupled: bool) -> list[SamplingConfig]:
        """What the coupled (``coupled``) or the rejection walk runs each row with: its own rule, or greedy for a
        row of the other rule in a ``"mixed"`` plan (that walk's result for it is dropped: greedy costs least)."""
        return rows_of(self.configs(), self.coupled, coupled)


@dataclass
class WalkInputs:
    """What the walk reads besides the round's buffers, made on the host side of the replay (device tensors).

    Attributes:
        noise: ``[B, D + 1, V]`` Gumbel noise of the rows' positions (coupled rule with a sampled row), else ``None``.
        coins: ``[B, D + 1, K + 1]`` float64 coins (rejection rule), else ``None``.
        draws, q, q_row: a sampled tree's proposals (:class:`~spiffy.arspec.device_rejection.Proposals`), else
            ``None`` (point-mass children are listed inside the step from the round's tree buffers).
        point_rows: ``[B]`` bool with a :attr:`WalkPlan.mixed` plan: the rows whose children are point masses.
        coupled_rows: ``[B]`` bool with a ``"mixed"`` rule: the rows that keep the coupled walk's result.
    """

    noise: torch.Tensor | None = None
    coins: torch.Tensor | None = None
    draws: torch.Tensor | None = None
    q: torch.Tensor | None = None
    q_row: torch.Tensor | None = None
    point_rows: torch.Tensor | None = None
    coupled_rows: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        """The tensors present, by field name (what a bucket keeps static copies of)."""
        return {name: t for name in ("noise", "coins", "draws", "q", "q_row", "point_rows", "coupled_rows")
                if (t := getattr(self, name)) is not None}

    def signature(self) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """Names, shapes and dtypes: equal signatures share a bucket's static buffers."""
        return tuple((name, tuple(t.shape), t.dtype) for name, t in self.named().items())


def walk_inputs(plan: WalkPlan, samplings: Sequence[SamplingConfig], positions: Sequence[int],
                trees: Sequence[DeviceTree | SampledDeviceTree | None], ids: torch.Tensor, parents: torch.Tensor,
                counts: torch.Tensor, depths: torch.Tensor, depth: int, vocab: int,
                logits_dtype: torch.dtype, proposals: Proposals | None = None,
                point_rows: Sequence[bool] = ()) -> WalkInputs:
    """The round's :class:`WalkInputs` (``positions``: the roots' absolute positions; ``ids``, ``parents``,
    ``counts``, ``depths [B, R - 1]``: the filled round buffers, read by a sampled tree's proposals only;
    ``proposals``: the sampled trees' proposals when a tree step wrote them, else made here from ``trees``;
    ``point_rows``: with a :attr:`WalkPlan.mixed` plan, whether each row's children are point masses)."""
    dev = ids.device
    noise_dtype = torch.float64 if logits_dtype == torch.float64 else torch.float32
    coupled = rows_of(samplings, plan.coupled, True)
    if plan.rule == "coupled":
        return WalkInputs(noise=position_noise(coupled, list(positions), depth, vocab, dev, noise_dtype))
    k = max(int(ids.shape[1]) - 1, 1)
    inputs = WalkInputs()
    if plan.rule == "mixed":
        inputs.noise = position_noise(coupled, list(positions), depth, vocab, dev, noise_dtype)
        inputs.coupled_rows = on_device(torch.tensor(list(plan.coupled), dtype=torch.bool), dev)
    if plan.sampled:
        if proposals is None:
            proposals = round_proposals(trees, ids, parents, counts, with_root(depths))
        inputs.draws, inputs.q, inputs.q_row = proposals.draws, proposals.q, proposals.q_row
        k = max(int(proposals.draws.shape[2]), k if plan.mixed else 0)
        if plan.mixed:
            inputs.point_rows = on_device(torch.tensor(list(point_rows), dtype=torch.bool), dev)
    inputs.coins = rejection_coins(rows_of(samplings, plan.coupled, False), positions, depth + 1, k + 1, dev)
    return inputs


def rows_of(samplings: Sequence[SamplingConfig], coupled: Sequence[bool], rule: bool) -> list[SamplingConfig]:
    """``samplings`` for the walk of one rule (``rule``: the coupled one) when rows mix the rules (``coupled``, per
    row; empty: they do not): the other rule's rows greedy (their result is dropped)."""
    if not coupled:
        return list(samplings)
    return [s if c == rule else SamplingConfig() for s, c in zip(samplings, coupled)]


def with_root(depths: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` every verification row's depth (the root's 0, then ``depths [B, R - 1]``)."""
    return torch.cat([torch.zeros(int(depths.shape[0]), 1, dtype=torch.long, device=depths.device), depths], 1)


def walk_program(plan: WalkPlan, logits: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor,
                 depths: torch.Tensor, counts: torch.Tensor, depth: int, inputs: WalkInputs,
                 groups: SamplingGroups | None = None) -> WalkResult:
    """The walk of every row (a tensor program: no host read, static shapes).

    Args:
        logits: ``[B, R, V]`` the target's logits at every verification row; ids: ``[B, R]``; parents, depths:
            ``[B, R - 1]``; counts: ``[B]`` real nodes; depth: the deepest node (static).
        inputs: the round's :class:`WalkInputs` (static copies inside a captured bucket).
        groups: the rows of each sampling rule (:func:`~spiffy.arspec.device_rejection.sampling_groups`), made once
            per bucket outside the step (its index tensors are host copies a graph must not hold).
    """
    if plan.rule == "coupled":
        drawn = target_tokens(logits, with_root(depths), plan.configs(), inputs.noise)
        return coupled_walk(ids, parents, depths, counts, drawn, depth)
    walk = _rejection_program(plan, logits, ids, parents, counts, depth, inputs, groups)
    if plan.rule == "mixed":  # the coupled walk too; each row keeps its own rule's
        assert inputs.coupled_rows is not None
        drawn = target_tokens(logits, with_root(depths), plan.rule_configs(True), inputs.noise)
        mine = coupled_walk(ids, parents, depths, counts, drawn, depth)
        pick = inputs.coupled_rows
        return WalkResult(torch.where(pick, mine.accepted, walk.accepted), torch.where(pick, mine.bonus, walk.bonus),
                          torch.where(pick.view(-1, 1), mine.keep, walk.keep),
                          torch.where(pick.view(-1, 1), mine.kept_tokens, walk.kept_tokens))
    return walk


def _rejection_program(plan: WalkPlan, logits: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor,
                       counts: torch.Tensor, depth: int, inputs: WalkInputs, groups: SamplingGroups | None
                       ) -> WalkResult:
    """:func:`walk_program`'s rejection walk of every row (its own rule's rows, with a ``"mixed"`` rule)."""
    assert inputs.coins is not None
    if plan.mixed:  # point-mass rows list their children, sampled rows their draws (in the leading columns)
        assert inputs.draws is not None and inputs.point_rows is not None
        width = max(int(ids.shape[1]) - 1, 1)
        children = children_draws(ids, parents, counts, max(width, int(inputs.draws.shape[2])))
        draws = torch.nn.functional.pad(inputs.draws, (0, int(children.shape[2]) - int(inputs.draws.shape[2])),
                                        value=-1)
        proposals = Proposals(torch.where(inputs.point_rows.view(-1, 1, 1), children, draws), inputs.q,
                              inputs.q_row, inputs.point_rows, int(inputs.draws.shape[2]))
    elif plan.sampled:
        assert inputs.draws is not None
        proposals = Proposals(inputs.draws, inputs.q, inputs.q_row)
    else:
        proposals = Proposals(children_draws(ids, parents, counts, max(int(ids.shape[1]) - 1, 1)))
    return rejection_walk(logits, plan.rule_configs(False), ids, parents, counts, proposals, inputs.coins, depth,
                          groups=groups)


def packed_walk(walk: WalkResult, counts: torch.Tensor) -> torch.Tensor:
    """``[B, 3 + 2 (D + 1)]`` long: accepted, bonus, nodes, kept rows, kept tokens (what the round reads once)."""
    return torch.cat([walk.accepted.view(-1, 1), walk.bonus.view(-1, 1), counts.view(-1, 1), walk.keep,
                      walk.kept_tokens], 1)


def unpack_walk(packed: list[list[int]], depth: int) -> list[tuple[list[int], list[int], int]]:
    """Per row ``(new tokens, kept verification rows, draft nodes)`` from :func:`packed_walk`'s rows."""
    out = []
    span = depth + 1
    for row in packed:
        n, bonus, nodes = row[0], row[1], row[2]
        keep, toks = row[3 : 3 + span], row[3 + span :]
        out.append((toks[1 : n + 1] + [bonus], keep[: n + 1], nodes))
    return out


def bucket_groups(plan: WalkPlan, device: torch.device) -> SamplingGroups | None:
    """The sampling groups a rejection (or mixed) bucket's step reads (made when the bucket is built), else
    ``None``."""
    return None if plan.rule == "coupled" else sampling_groups(plan.rule_configs(False), device)


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


def walk_kind(rules: Sequence[AcceptanceRule], trees: Sequence[DeviceTree | SampledDeviceTree | None],
              drafts: Sequence[Draft | None]) -> str | None:
    """How the round's rows are walked on the device: ``"coupled"`` (the coupled rule, or the rejection rule at
    T = 0, which is the coupled walk), ``"rejection"`` (the rejection rule at T > 0 on trees whose proposals are all
    point masses or all sampled), or ``None``: on the host (a tree built on the host, or rows that mix the two)."""
    if any(t is None and d is not None for t, d in zip(trees, drafts)):
        return None
    kind = rule_walk(rules)
    if kind == "mixed":  # the rules mixed: with trees from the tree step only (captured_rounds)
        return None
    if kind != "rejection":
        return kind
    kinds = {isinstance(t, SampledDeviceTree) for t in trees if t is not None}
    return "rejection" if len(kinds) <= 1 else None


def rule_walk(rules: Sequence[AcceptanceRule]) -> str | None:
    """The walk the rows' rules ask for, whatever their trees: ``"coupled"`` (the coupled rule, or the rejection
    rule at T = 0), ``"rejection"`` (the rejection rule at T > 0 on every row), ``"mixed"`` (rows of both), or
    ``None`` (another rule): what :func:`walk_kind` decides for point-mass trees (DDTree, the chain)."""
    if not all(type(r) in (CoupledRule, RejectionRule) for r in rules):
        return None
    coupled = coupled_rows(rules)
    return "coupled" if all(coupled) else "rejection" if not any(coupled) else "mixed"


def coupled_rows(rules: Sequence[AcceptanceRule]) -> list[bool]:
    """Per row, whether it walks by the coupled rule (the coupled rule, or the rejection rule at T = 0: both the
    greedy walk there)."""
    return [type(r) is CoupledRule or float(r.sampling.temperature) == 0 for r in rules]


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
