"""The device side of a captured AR round after its tree: how it is walked (:func:`walk_kind`, :func:`walk_program`)
and the round fused into one step (the trees themselves: :mod:`spiffy.arspec.captured_trees`).

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
round's tree step, :func:`~spiffy.arspec.captured_trees.tree_program`, or by the eager kernels of
:func:`~spiffy.arspec.captured_trees.round_tree`). The rows' sampling rules are static per bucket (:class:`WalkPlan`,
part of the key: temperatures, top-k and top-p are constants of the captured kernels). A hybrid target's round
commits its recurrent state in the same step (:meth:`~spiffy.arspec.captured_recurrent.StaticRecurrent.commit_inline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spiffy.arspec.captured_trees import with_root
from spiffy.arspec.device_draws import SampledDeviceTree
from spiffy.arspec.device_rejection import (Proposals, SamplingGroups, children_draws, rejection_coins,
                                            rejection_walk, round_proposals, sampling_groups)
from spiffy.arspec.device_tree import DeviceTree, WalkResult, coupled_walk, position_noise, target_tokens
from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.rules import AcceptanceRule, CoupledRule
from spiffy.arspec.selector import Draft
from spiffy.sampling import SamplingConfig
from spiffy.torch_utils import on_device

__all__ = ["WalkInputs", "WalkPlan", "bucket_groups", "coupled_rows", "packed_walk", "rows_of", "rule_walk",
           "unpack_walk", "walk_inputs", "walk_kind", "walk_program"]


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
