"""Drafts from a DFlash2 drafter's candidate selector: the chain, sampled drafts and the DDTree tree.

A DFlash2 drafter (:mod:`spiffy.models.dflash2`) proposes, for each drafted depth ``d = 1..D``, ``K`` candidate tokens
and a score for each candidate *given the token chosen before it* (the root for depth 1). That is a Markov chain over
each depth's candidates: with ``q_d(c | p) = softmax(scores_d(p, .) / T)[c]`` over the ``K`` candidates, a drafted
path ``u_1..u_n`` has probability ``prod_d q_d(u_d | u_{d-1})``. :class:`SelectorDraft` holds every transition score
of one round (what :meth:`~spiffy.models.dflash2.DFlash2DraftModel.select` returns) and builds the round's draft
structure from it:

* :meth:`SelectorDraft.chain`: the official package's draft at ``T = 0``: from the root, the best-scoring candidate
  given the previous choice, left to right (ties: the candidate of higher logit, then lower token id).
* :meth:`SelectorDraft.sample_tree`: ``n`` drafts, each walking the chain with draws from ``q_d(. | previous)`` at the
  draft temperature (the package's draft at ``T > 0`` for ``n = 1``), merged into one tree whose
  :class:`~spiffy.arspec.tree.NodeProposals` give, below every node, the ``q`` its children were drawn from. The draws
  below a node are i.i.d. from ``q(. | that node's token)`` given everything above it, so the rejection rule's
  recursive speculative sampling (:class:`~spiffy.arspec.rejection.RejectionRule`) is exact on it. Each draw is an
  exponential race (:func:`race_draw`: ``argmax(q / E)`` with ``E ~ Exp(1)``, which is how ``torch.multinomial``
  draws one sample on a CPU, from the same stream) with host exponentials keyed by ``(seed, root position)``
  (:func:`selector_exponentials`), so the captured path's device twin
  (:func:`~spiffy.arspec.device_selector.selector_sampled_device`) draws the same tokens from the same numbers.
* :meth:`SelectorDraft.best_tree`: DDTree over the chain: the ``budget`` prefixes of highest probability. A prefix is
  at least as probable as its extensions, so they form a tree and come out of the same best-first heap as
  :func:`~spiffy.arspec.tree.build_ddtree` (pop the best node, push its next sibling and its first child), except
  that a node's children are ranked by ``q(. | that node's token)``: each popped node ranks the next depth's
  candidates for its own token. Ranks inside a row: probability descending, equal probabilities by token id; equal
  heap scores pop by rank tuple, so parents precede children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Union

import torch

from spiffy.arspec.sampling import keyed_seed, position_key, tempered
from spiffy.arspec.selfselect import DRAFT_STREAM, draft_temperature
from spiffy.arspec.tree import DraftTree, NodeProposals, empty_tree
from spiffy.errors import ConfigError
from spiffy.sampling import SamplingConfig

__all__ = ["Draft", "SelectorDraft", "race_draw", "selector_exponentials"]


@dataclass(frozen=True)
class SelectorDraft:
    """One round's proposal of a DFlash2 drafter (tensors on the drafter's device).

    Attributes:
        candidates: ``[D, K]`` long, each depth's candidate tokens.
        first: ``[K]`` the depth-1 scores given the root.
        following: ``[D - 1, K, K]``: row ``i`` of ``following[d]`` scores depth ``d + 2``'s candidates after
            candidate ``i`` of depth ``d + 1``.
        vocab_size: the target's vocabulary size ``V``.
    """

    candidates: torch.Tensor
    first: torch.Tensor
    following: torch.Tensor
    vocab_size: int

    @property
    def depth(self) -> int:
        return int(self.candidates.shape[0])

    def _host(self, temperature: float | None) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """Candidates as lists and the scores on the CPU in float64: raw (``temperature`` ``None``) or as
        log-probabilities ``log q`` at ``temperature`` (``0``: unscaled, as :func:`~spiffy.arspec.sampling.tempered`)."""
        first, following = self.first.double().cpu(), self.following.double().cpu()
        if temperature is not None:
            first = torch.log_softmax(tempered(first, temperature), dim=-1)
            following = torch.log_softmax(tempered(following, temperature), dim=-1)
        return self.candidates.cpu().tolist(), first, following

    def chain(self) -> DraftTree:
        """The greedy chain: the argmax of every step's scores, left to right from the root (``D`` nodes; scores:
        cumulative ``log q`` at temperature 1)."""
        if self.depth == 0:
            return empty_tree()
        cands, first, following = self._host(None)
        logq_first, logq_next = torch.log_softmax(first, -1), torch.log_softmax(following, -1)
        index = int(first.argmax())
        tokens, scores = [cands[0][index]], [float(logq_first[index])]
        for d in range(self.depth - 1):
            nxt = int(following[d, index].argmax())
            scores.append(scores[-1] + float(logq_next[d, index, nxt]))
            index = nxt
            tokens.append(cands[d + 1][index])
        n = self.depth
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long),
                         torch.arange(1, n + 1, dtype=torch.long), torch.tensor(scores, dtype=torch.float64))

    def sample_tree(self, num_drafts: int, sampling: SamplingConfig, root_position: int) -> DraftTree:
        """``num_drafts`` drafts walked through the chain with draws from ``q`` at
        :func:`~spiffy.arspec.selfselect.draft_temperature` (:func:`race_draw` of :func:`selector_exponentials`),
        merged into one tree (creation order: draft by draft, shallow to deep); ``samples`` lists the draws below each
        node in draw order, ``proposal`` the ``q`` of each. A node's score is its prefix's sum of ``log_softmax``
        values at that temperature, added one depth at a time (what the device twin adds)."""
        if num_drafts <= 0 or self.depth == 0:
            return empty_tree()
        cands, first, following = self._host(None)
        temperature = draft_temperature(sampling)
        first, following = first / temperature, following / temperature
        q_first, q_next = torch.softmax(first, -1), torch.softmax(following, -1)
        logq_first, logq_next = torch.log_softmax(first, -1), torch.log_softmax(following, -1)
        races = selector_exponentials(sampling, int(num_drafts), self.depth, len(cands[0]), root_position)
        cand_rows = self.candidates.cpu()
        lookup: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        samples: dict[int, list[int]] = {}
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for j in range(int(num_drafts)):
            node, index, score = -1, -1, 0.0
            for d in range(self.depth):
                q = q_first if d == 0 else q_next[d - 1, index]
                logq = logq_first if d == 0 else logq_next[d - 1, index]
                index = int(race_draw(q, races[j, d]))
                tok = cands[d][index]
                samples.setdefault(node, []).append(tok)
                rows.setdefault(node, (cand_rows[d], q))
                score += float(logq[index])
                child = lookup.get((node, tok))
                if child is None:
                    child = lookup[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    depths.append(d + 1)
                    scores.append(score)
                node = child
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                         torch.tensor(depths, dtype=torch.long), torch.tensor(scores, dtype=torch.float64),
                         samples=samples, proposal=NodeProposals(int(self.vocab_size), rows))

    def best_tree(self, budget: int, temperature: float) -> DraftTree:
        """The ``budget``-node DDTree of the chain's path probabilities at ``temperature`` (``0``: unscaled scores).

        Nodes come in pop order (non-increasing score, parents before children); candidates of probability 0 are
        never added.
        """
        if budget < 0:
            raise ConfigError(f"tree budget must be >= 0, got {budget}; fix: pass budget=0 (plain AR) or more")
        if budget == 0 or self.depth == 0:
            return empty_tree()
        cands, logq_first, logq_next = self._host(temperature)
        k = len(cands[0])
        rankings: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

        def ranking(depth: int, after: int) -> tuple[list[float], list[int]]:
            """Depth ``depth``'s (0-based) finite log-probabilities and candidate indices, best first, after
            candidate ``after`` of the depth before (``-1``: the root)."""
            key = (depth, after)
            if key not in rankings:
                row = (logq_first if depth == 0 else logq_next[depth - 1, after]).tolist()
                order = sorted(range(k), key=lambda i: (-row[i], cands[depth][i]))
                vals = [row[i] for i in order]
                keep = sum(v != float("-inf") for v in vals)
                rankings[key] = (vals[:keep], order[:keep])
            return rankings[key]

        base = k + 1
        place = [base ** (self.depth - 1 - d) for d in range(self.depth)]
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        top = ranking(0, -1)[0]
        # heap entry: (-score, rank key, rank, depth (0-based), parent node, parent score, parent's candidate index)
        heap: list[tuple[float, int, int, int, int, float, int]] = [(-top[0], place[0], 0, 0, -1, 0.0, -1)] if top else []
        while heap and len(tokens) < budget:
            neg, key, r, d, parent, parent_score, after = heapq.heappop(heap)
            vals, order = ranking(d, after)
            node, score, index = len(tokens), -neg, order[r]
            tokens.append(cands[d][index])
            parents.append(parent)
            depths.append(d + 1)
            scores.append(score)
            if r + 1 < len(vals):  # next sibling
                heapq.heappush(heap, (-(parent_score + vals[r + 1]), key + place[d], r + 1, d, parent, parent_score, after))
            if d + 1 < self.depth:  # first child, ranked for this node's token
                child_vals = ranking(d + 1, index)[0]
                if child_vals:
                    heapq.heappush(heap, (-(score + child_vals[0]), key + place[d + 1], 0, d + 1, node, score, index))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                         torch.tensor(depths, dtype=torch.long), torch.tensor(scores, dtype=torch.float64))


#: what a drafter proposes for a round: ``[D, V]`` per-position logits, or a DFlash2 selector's proposal
Draft = Union[torch.Tensor, SelectorDraft]


def selector_exponentials(sampling: SamplingConfig, num_drafts: int, depth: int, candidates: int,
                          root_position: int) -> torch.Tensor:
    """``[n, D, K]`` float64 host ``Exp(1)`` draws of a round's selector drafts (draft ``j``'s depth-``d`` race over
    the ``K`` candidates at ``[j, d]``) from a generator keyed by ``(seed, DRAFT_STREAM, root_position)``: one call,
    the stream ``n * D`` successive ``torch.multinomial(q, 1)`` calls of ``K`` candidates read (float64 exponentials
    in order; ``tests/test_device_selector.py`` checks the two agree). Host work only; a captured round copies them
    into its static buffer."""
    gen = torch.Generator().manual_seed(position_key(keyed_seed(sampling) ^ DRAFT_STREAM, root_position))
    races = torch.empty(int(num_drafts) * int(depth) * int(candidates), dtype=torch.float64)
    return races.exponential_(generator=gen).view(int(num_drafts), int(depth), int(candidates))


def race_draw(q: torch.Tensor, races: torch.Tensor) -> torch.Tensor:
    """``[...]`` long: the exponential race of ``q [..., K]`` (nonnegative) against ``races [..., K]`` (``Exp(1)``
    draws): ``argmax(q / E)``, the first maximal index. ``P(i) = q_i / sum(q)`` (the smallest of independent
    ``E_i / q_i`` wins), and a candidate without mass almost surely never wins. A tensor program: one division
    and one argmax on whatever device ``q`` is on."""
    return (q / races).argmax(dim=-1)
