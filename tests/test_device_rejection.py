"""The rejection rule as a tensor program (:mod:`spiffy.arspec.device_rejection`):

* it takes the sequential rule's decisions (``tests/reference_rejection.py``, the rule as it was written on the host)
  on random trees of every proposal kind (DDTree's point masses, sampled chains and SpecDiff-2 trees), except where
  rounding decides (a coin within 1e-9 of its threshold);
* a batch of padded trees (a captured round's buffers: more nodes, more draws per row, other rows) walks each row
  exactly as the eager rule walks it alone;
* it reads nothing to the host (``SyncCounter``), and the eager rule's trace lists its decisions.

Its exactness in distribution is the statistical tests' (``tests/test_arspec_rejection.py``,
``tests/test_dflash2_rejection.py``), which run the same program.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_tiers import fast_settings
from reference_rejection import reference_accept

from spiffy.arspec.device_rejection import (Proposals, children_draws, rejection_coins, rejection_walk,
                                            round_proposals)
from spiffy.arspec.device_tree import ddtree_device
from spiffy.arspec.rejection import RejectionRule, tree_proposals
from spiffy.arspec.selfselect import build_sampled_tree
from spiffy.arspec.tree import DraftTree, build_ddtree, empty_tree
from spiffy.bench.syncs import SyncCounter
from spiffy.sampling import SamplingConfig

#: a decision closer than this to its threshold may go either way by rounding (closed form vs renormalised r)
ROUNDING_MARGIN = 1e-9


class RowLogits:
    """The ``TargetLogits`` interface over fixed ``[1 + N, V]`` logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.rows = logits

    def logits(self, node: int) -> torch.Tensor:
        return self.rows[node + 1].view(1, -1)


def _random_tree(kind: str, vocab: int, depth: int, width: int, gen: torch.Generator) -> DraftTree:
    """A DDTree of ``width`` nodes (point masses) or ``width`` joint drafts of ``depth`` tokens (sampled), drawn
    over few tokens so that drafts share prefixes and repeat."""
    logits = 2.0 * torch.randn(depth, vocab, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    if kind == "ddtree":
        return build_ddtree(torch.log_softmax(logits, -1), width)
    if width == 0:
        return empty_tree()
    probs[:, -1] = 0.0  # a token q never proposes
    probs = probs / probs.sum(-1, keepdim=True)
    drafts = torch.multinomial(probs, width, replacement=True, generator=gen).t()  # [K, D]
    return build_sampled_tree(probs, drafts)


def _case(seed: int, kind: str, vocab: int, depth: int, width: int) -> tuple[DraftTree, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tree = _random_tree(kind, vocab, depth, width, gen)
    # target logits close to the drafter's often, so walks go deep
    return tree, 1.5 * torch.randn(1 + tree.num_nodes, vocab, generator=gen, dtype=torch.float64)


@fast_settings(60)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["ddtree", "chain", "specdiff"]),
       vocab=st.integers(2, 7), depth=st.integers(1, 4), width=st.integers(0, 6),
       temperature=st.sampled_from([0.4, 1.0, 1.8]), top_k=st.sampled_from([0, 2]),
       top_p=st.sampled_from([1.0, 0.7]), root=st.integers(0, 50))
def test_the_program_takes_the_sequential_rules_decisions(seed, kind, vocab, depth, width, temperature, top_k,
                                                          top_p, root):
    tree, logits = _case(seed, kind, vocab, depth, min(width, 1) if kind == "chain" else width)  # 0: an empty tree
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed % 7)
    margins: list[float] = []
    expected = reference_accept(tree, logits, sampling, root, margins)
    out = RejectionRule(sampling).accept(tree, RowLogits(logits), None, root)
    if min(margins) > ROUNDING_MARGIN:
        assert (out.accepted, out.bonus) == expected
    if out.accepted:  # a path of the tree, each node a child of the one before
        parents = tree.parents.tolist()
        assert parents[out.accepted[0]] == -1
        assert all(parents[b] == a for a, b in zip(out.accepted, out.accepted[1:]))


def _pad(rows: list[Proposals], width: int, k: int) -> Proposals:
    """Single-tree proposals stacked into a batch of ``width`` verification rows and ``k`` draws per row."""
    draws = torch.full((len(rows), width, k), -1, dtype=torch.long)
    for b, p in enumerate(rows):
        draws[b, : p.draws.shape[1], : p.draws.shape[2]] = p.draws[0]
    if rows[0].q is None:
        return Proposals(draws)
    q = torch.zeros(len(rows), max(int(p.q.shape[1]) for p in rows), int(rows[0].q.shape[2]), dtype=torch.float64)
    q_row = torch.zeros(len(rows), width, dtype=torch.long)
    for b, p in enumerate(rows):
        q[b, : p.q.shape[1]] = p.q[0]
        q_row[b, : p.q_row.shape[1]] = p.q_row[0]
    return Proposals(draws, q, q_row)


@fast_settings(25)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["ddtree", "specdiff"]), rows=st.integers(1, 4),
       extra=st.integers(0, 5), temperature=st.sampled_from([0.6, 1.3]))
def test_padded_batched_rows_walk_as_each_tree_alone(seed, kind, rows, extra, temperature):
    """A captured round's buffers: every row padded to one width (nodes that see nothing and are never accepted),
    to one number of draws per row and one depth, with other rows beside it."""
    vocab = 6
    trees, logits = zip(*[_case(seed + b, kind, vocab, 3, 4) for b in range(rows)])
    samplings = [SamplingConfig(temperature=temperature, seed=seed + b) for b in range(rows)]
    roots = [7 + 3 * b for b in range(rows)]
    alone = [RejectionRule(s).accept(t, RowLogits(lg), None, r) for s, t, lg, r in zip(samplings, trees, logits, roots)]
    width = 1 + max(t.num_nodes for t in trees) + extra
    ids = torch.zeros(rows, width, dtype=torch.long)
    parents = torch.full((rows, width - 1), -1, dtype=torch.long)
    padded = torch.zeros(rows, width, vocab, dtype=torch.float64)
    for b, (t, lg) in enumerate(zip(trees, logits)):
        ids[b, 1 : 1 + t.num_nodes], parents[b, : t.num_nodes] = t.tokens, t.parents
        padded[b, : lg.shape[0]] = lg
        padded[b, lg.shape[0] :] = torch.randn(width - lg.shape[0], vocab, dtype=torch.float64)  # junk, never read
    counts = torch.tensor([t.num_nodes for t in trees])
    depth = max(t.max_depth() for t in trees) + (extra % 2)  # a deeper static depth than any tree's
    if kind == "ddtree":
        proposals = Proposals(children_draws(ids, parents, counts, width - 1 + extra))
    else:
        proposals = _pad([tree_proposals(t, torch.device("cpu")) for t in trees], width,
                         max(len(v) for t in trees for v in t.samples.values()) + extra)
    coins = rejection_coins(samplings, roots, depth + 1, int(proposals.draws.shape[2]) + 1, "cpu")
    walk = rejection_walk(padded, samplings, ids, parents, counts, proposals, coins, depth)
    for b, a in enumerate(alone):
        n = int(walk.accepted[b])
        assert ([int(r) - 1 for r in walk.keep[b, 1 : n + 1]], int(walk.bonus[b])) == (a.accepted, a.bonus)
        assert walk.kept_tokens[b, 1 : n + 1].tolist() == [int(trees[b].tokens[i]) for i in a.accepted]


def test_children_draws_lists_each_nodes_children_in_node_order():
    tree = build_ddtree(torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]), -1), 7)
    n = tree.num_nodes
    ids = torch.cat([torch.zeros(1, dtype=torch.long), tree.tokens]).view(1, -1)
    table = children_draws(ids, tree.parents.view(1, -1), torch.tensor([n - 2]), 5)  # the last two are padding
    parents, tokens = tree.parents.tolist()[: n - 2], tree.tokens.tolist()
    for row in range(n + 1):
        kids = [tokens[i] for i, p in enumerate(parents) if p == row - 1]
        assert table[0, row].tolist() == kids + [-1] * (5 - len(kids))


def test_the_walk_reads_nothing_to_the_host():
    gen = torch.Generator().manual_seed(3)
    logprobs = torch.log_softmax(torch.randn(4, 9, generator=gen, dtype=torch.float64), -1)
    tree = ddtree_device(logprobs, 8)
    ids = torch.cat([torch.zeros(1, dtype=torch.long), tree.tokens]).view(1, -1).repeat(2, 1)
    parents, counts = tree.parents.view(1, -1).repeat(2, 1), torch.tensor([tree.count, tree.count])
    row_depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths]).view(1, -1).repeat(2, 1)
    samplings = [SamplingConfig(temperature=0.8, seed=1), SamplingConfig(temperature=1.2, top_p=0.9, seed=2)]
    logits = torch.randn(2, 9, 9, generator=gen, dtype=torch.float64)
    coins = rejection_coins(samplings, [4, 9], 5, 9, "cpu")
    with SyncCounter() as counter:
        proposals = round_proposals([tree, tree], ids, parents, counts, row_depths)
        walk = rejection_walk(logits, samplings, ids, parents, counts, proposals, coins, 4)
        walk.keep.add_(0)
    assert counter.total == 0, counter.counts


@pytest.mark.parametrize("kind", ["ddtree", "specdiff"])
def test_the_trace_lists_every_decision_in_order(kind):
    tree, logits = _case(11, kind, 5, 3, 4)
    rule = RejectionRule(SamplingConfig(temperature=1.0, seed=3))
    rule.trace = []
    out = rule.accept(tree, RowLogits(logits), None, 20)
    tests = [t for t in rule.trace if t[0] == "test"]
    assert rule.trace[-1][0] == "draw" and sum(t[0] == "draw" for t in rule.trace) == 1
    # one passed test per accepted node, and the bonus drawn from what was left
    assert sum(u < thr for _kind, u, thr in tests) == len(out.accepted)
    left = rule.trace[-1][2]
    assert float(left[out.bonus]) > 0
