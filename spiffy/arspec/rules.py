"""The acceptance-rule interface: which drafted tokens the target keeps, and which token it adds.

After the one verification forward, a rule sees the draft structure (:class:`~spiffy.arspec.tree.DraftTree`), the
target's logits at any node (computed lazily by :class:`TargetLogits`: the coupled rule pays the head on the rows
it visits only; the rejection rule's walk, a tensor program over every row, takes them all in one head call), the
drafter's per-depth logits and the root position, and returns the accepted path and the bonus token
(:class:`Acceptance`).

:class:`CoupledRule` is today's rule: the target draws its own token at each visited node with position-keyed noise
(:mod:`spiffy.arspec.sampling`) and the walk follows the child holding that token, so the output is identical to
plain AR decoding for a seed, at any temperature. The speculative-sampling rule
(:class:`~spiffy.arspec.rejection.RejectionRule`: accept a child ``x`` with probability ``min(1, p(x) / q(x))``,
resample the bonus from the residual ``max(0, p - q)``) reads ``q`` from the tree's proposals within the same
signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from spiffy.arspec.sampling import sample_keyed
from spiffy.arspec.tree import DraftTree
from spiffy.sampling import SamplingConfig
from spiffy.verify import follow

__all__ = ["Acceptance", "AcceptanceRule", "CoupledRule", "TargetLogits"]


class TargetLogits:
    """Target logits of one verification forward, per tree node, computed on first use.

    Args:
        hidden: ``[1 + N, H]`` final hidden states: row 0 is the root, row ``i + 1`` is node ``i``.
        lm_head: the target's head (``[.., H] -> [.., V]``).
    """

    def __init__(self, hidden: torch.Tensor, lm_head: nn.Module) -> None:
        self.hidden = hidden
        self.lm_head = lm_head
        self._cache: dict[int, torch.Tensor] = {}

    def logits(self, node: int) -> torch.Tensor:
        """``[1, V]`` logits of the token after ``node`` (``-1`` = the root)."""
        row = 0 if node < 0 else node + 1
        out = self._cache.get(row)
        if out is None:
            out = self.lm_head(self.hidden[row : row + 1])
            self._cache[row] = out
        return out

    def all_rows(self, count: int) -> torch.Tensor:
        """``[count, V]`` logits of the first ``count`` rows (the root, then nodes in order), in one head call."""
        out = self.lm_head(self.hidden[:count])
        self._cache.update({row: out[row : row + 1] for row in range(count)})
        return out

    @property
    def rows_computed(self) -> int:
        """How many rows paid the head so far."""
        return len(self._cache)


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one draft structure.

    Attributes:
        accepted: accepted node indices, root to leaf (each the child of the previous one).
        bonus: the target's token after the last accepted node (the next round's root).
    """

    accepted: list[int]
    bonus: int


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides the accepted path of a verified draft."""

    def accept(
        self,
        tree: DraftTree,
        target: TargetLogits,
        draft_logits: torch.Tensor | None,
        root_position: int,
    ) -> Acceptance:
        """Walk ``tree`` from the root.

        Args:
            tree: the verified draft (``N`` nodes; node ``i`` at absolute position ``root_position + depths[i]``).
            target: the target's logits per node (lazy).
            draft_logits: ``[D, V]`` the drafter's logits for depths ``1..D``, or its own proposal object (a DFlash2
                selector's, :class:`~spiffy.arspec.selector.SelectorDraft`); ``None`` when nothing was drafted.
            root_position: absolute position of the root (the pending bonus token).
        Returns:
            :class:`Acceptance`.
        """
        ...


class CoupledRule:
    """Position-keyed coupled acceptance: the target samples at each visited node with noise keyed by the absolute
    position, and a child is accepted when it holds exactly that token. Equal to AR decoding for the same seed.

    Args:
        sampling: the target's decoding rule.
    """

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def accept(
        self,
        tree: DraftTree,
        target: TargetLogits,
        draft_logits: torch.Tensor | None,
        root_position: int,
    ) -> Acceptance:
        if tree.num_nodes == 0:  # nothing drafted: the root's own draw (what the walk below returns at once)
            return Acceptance([], int(sample_keyed(target.logits(-1), [root_position + 1], self.sampling)[0]))
        lookup = tree.children_lookup()
        depths = tree.depths.tolist()

        def target_token(node: int) -> int:
            depth = 0 if node < 0 else depths[node]
            return int(sample_keyed(target.logits(node), [root_position + depth + 1], self.sampling)[0])

        accepted, bonus = follow(-1, target_token, lambda node, tok: lookup.get((node, tok)), max_steps=tree.num_nodes)
        return Acceptance(list(accepted), int(bonus))
