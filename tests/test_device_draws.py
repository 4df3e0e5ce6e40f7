"""Sampled drafts on the device: :func:`~spiffy.arspec.selfselect.sample_drafts` (inverse-CDF draws with keyed host
uniforms) and :func:`~spiffy.arspec.device_draws.sampled_tree_device` (the host builder's tree as tensor programs).

* the device tree is the host tree (:func:`~spiffy.arspec.selfselect.build_sampled_tree`) node for node: tokens,
  parents, depths, scores bit for bit, the real count, and the draws below every node against ``samples``; on
  random proposals with zero-mass tokens and on hand-made drafts full of shared prefixes and duplicates;
* neither function reads anything to the host (:class:`~spiffy.bench.syncs.SyncCounter` sees no call);
* ``sample_drafts`` is a sampler of ``probs``: Pearson's chi-square goodness of fit (``scipy.stats.chisquare``) of
  the joint of four draws of a round (two depths of draft 0, depth 0 of drafts 1 and 2) over many root positions,
  against the product of the marginals, on bins fixed before sampling (outcomes expected fewer than
  :data:`MIN_EXPECTED` times pooled), rejecting at p < :data:`ALPHA` = 1e-3; seeds fixed, so deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from property_tiers import fast_settings
from spiffy.arspec.device_draws import SampledDeviceTree, sampled_tree_device
from spiffy.arspec.sampling import keyed_seed, keyed_uniforms, position_key
from spiffy.arspec.selfselect import (DRAFT_STREAM, build_sampled_tree, draft_uniforms, drafts_from_uniforms,
                                      sample_drafts)
from spiffy.arspec.tree import DraftTree
from spiffy.bench.syncs import SyncCounter
from spiffy.sampling import SamplingConfig

torch.set_num_threads(1)

#: significance level of the goodness-of-fit test (a correct sampler fails it with this probability)
ALPHA = 1e-3
#: outcomes expected fewer times than this are pooled into one bin
MIN_EXPECTED = 5.0
#: root positions (rounds) of the goodness-of-fit test
N_ROUNDS = 4000


def _probs(gen: torch.Generator, depth: int, vocab: int, zero_frac: float) -> torch.Tensor:
    """``[D, V]`` float64 rows with about ``zero_frac`` of their tokens without mass (never a whole row)."""
    raw = torch.softmax(1.5 * torch.randn(depth, vocab, generator=gen, dtype=torch.float64), -1)
    zero = torch.rand(depth, vocab, generator=gen) < zero_frac
    zero[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=gen)] = False  # one token keeps mass
    raw = raw.masked_fill(zero, 0.0)
    return raw / raw.sum(-1, keepdim=True)


def _assert_same_tree(host: DraftTree, dev: SampledDeviceTree, k: int, depth: int) -> None:
    """``dev`` is ``host`` padded to ``K * D`` nodes, node for node, with the draws below every node."""
    n = k * depth
    real = int(dev.real)
    assert dev.tree.count == n and real == host.num_nodes
    for name in ("tokens", "parents", "depths", "scores"):
        got = getattr(dev.tree, name)
        assert got.shape == (n,), name
        assert torch.equal(getattr(host, name), got[:real]), name  # scores: bit for bit
    pad = slice(real, n)
    assert bool((dev.tree.tokens[pad] == 0).all() and (dev.tree.parents[pad] == -1).all())
    assert bool((dev.tree.depths[pad] == 1).all() and (dev.tree.scores[pad] == float("-inf")).all())
    assert dev.draws.shape == (1 + n, k)
    samples = host.samples or {}
    assert set(samples) <= set(range(-1, real))
    for node in range(-1, n):
        want = samples.get(node, [])
        assert dev.draws[node + 1].tolist() == want + [-1] * (k - len(want)), node


def _shared_drafts(data: st.DataObject, k: int, depth: int, alphabet: int) -> torch.Tensor:
    """Hand-made ``[K, D]`` drafts over the first ``alphabet`` tokens: each draft copies a prefix of an earlier
    one (possibly all of it: a duplicate) and continues freely."""
    rows: list[list[int]] = []
    for i in range(k):
        row = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=depth, max_size=depth))
        if i > 0:
            src = rows[data.draw(st.integers(0, i - 1))]
            cut = data.draw(st.integers(0, depth))
            row = src[:cut] + row[cut:]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


@fast_settings(150)
@given(data=st.data(), vocab=st.integers(2, 12), k=st.integers(1, 6), depth=st.integers(1, 6),
       seed=st.integers(0, 10**6), hand_made=st.booleans())
def test_device_tree_is_the_host_tree(data, vocab, k, depth, seed, hand_made):
    gen = torch.Generator().manual_seed(seed)
    probs = _probs(gen, depth, vocab, zero_frac=0.4)
    if hand_made:
        drafts = _shared_drafts(data, k, depth, data.draw(st.integers(1, vocab)))
    else:
        drafts = sample_drafts(probs, k, SamplingConfig(temperature=1.0, seed=seed), data.draw(st.integers(0, 500)))
    _assert_same_tree(build_sampled_tree(probs, drafts), sampled_tree_device(probs, drafts), k, depth)


@fast_settings(100)
@given(data=st.data(), vocab=st.integers(2, 12), k=st.integers(1, 6), depth=st.integers(1, 6),
       cut=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_a_shorter_draft_in_the_same_shapes_is_its_own_tree(data, vocab, k, depth, cut, seed):
    """The tree of the drafts' first ``d`` tokens built in the shapes of ``D`` (``length=d``: one captured tree step
    for every draft length) is the host builder's tree of ``drafts[:, :d]``, node for node, draws included."""
    d = min(cut, depth)
    gen = torch.Generator().manual_seed(seed)
    probs = _probs(gen, depth, vocab, zero_frac=0.4)
    drafts = _shared_drafts(data, k, depth, data.draw(st.integers(1, vocab)))
    dev = sampled_tree_device(probs, drafts, torch.tensor(d))
    _assert_same_tree(build_sampled_tree(probs[:d], drafts[:, :d]), dev, k, depth)


def test_chains_and_wide_trees_match_the_host():
    """``K = 1`` (the DEER / DFlash chain under rejection) and the largest sizes: K = 16 drafts of depth 32."""
    gen = torch.Generator().manual_seed(5)
    for k, depth, vocab in ((1, 1, 3), (1, 32, 50), (16, 32, 3), (16, 32, 400), (16, 1, 2)):
        probs = _probs(gen, depth, vocab, zero_frac=0.3)
        drafts = sample_drafts(probs, k, SamplingConfig(temperature=0.7, seed=11), 40)
        assert drafts.shape == (k, depth) and drafts.dtype == torch.long
        dev = sampled_tree_device(probs, drafts)
        _assert_same_tree(build_sampled_tree(probs, drafts), dev, k, depth)
        if k == 1:  # a chain: every node real, each the parent of the next
            assert int(dev.real) == depth and dev.tree.parents.tolist() == list(range(-1, depth - 1))


def test_empty_cases():
    probs = torch.full((3, 4), 0.25, dtype=torch.float64)
    sampling = SamplingConfig(temperature=1.0, seed=0)
    assert sample_drafts(probs, 0, sampling, 3).shape == (0, 3)
    assert sample_drafts(probs[:0], 2, sampling, 3).shape == (2, 0)
    for drafts in (torch.zeros(0, 3, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        dev = sampled_tree_device(probs, drafts)
        assert dev.tree.count == 0 and int(dev.real) == 0 and dev.tree.tokens.numel() == 0
        assert dev.draws.shape == (1, drafts.shape[0]) and bool((dev.draws == -1).all())


def test_no_host_read():
    """No call SyncCounter knows (``item``, ``tolist``, ``cpu``, ``float(t)``, boolean-mask indexing, ...) is made,
    for the draws and for the tree. The proposal lives on the ``meta`` device, standing in for a GPU: on the CPU the
    counter cannot tell a move to the proposal's device from a read (``inverse_cdf`` moves its uniforms there), and a
    read of a meta tensor's values would raise."""
    gen = torch.Generator().manual_seed(2)
    host = _probs(gen, 6, 9, zero_frac=0.3)
    sampling = SamplingConfig(temperature=1.0, seed=3)
    probs = host.to("meta")
    with SyncCounter() as counter:
        drafts = sample_drafts(probs, 4, sampling, 17)
        out = sampled_tree_device(probs, drafts)
    assert counter.total == 0, dict(counter.counts)
    assert drafts.device.type == "meta" and out.draws.device.type == "meta" and out.real.device.type == "meta"
    cpu_drafts = sample_drafts(host, 4, sampling, 17)
    with SyncCounter() as counter:  # on the CPU too, where every tensor call is seen
        sampled_tree_device(host, cpu_drafts)
    assert counter.total == 0, dict(counter.counts)


def _joint_round(probs: torch.Tensor, position: int) -> tuple[int, ...]:
    """One round's draws (K = 3, D = 2): draft 0 at both depths, drafts 1 and 2 at depth 0."""
    d = sample_drafts(probs, 3, SamplingConfig(temperature=1.0, seed=21), position).tolist()
    return d[0][0], d[0][1], d[1][0], d[2][0]


def _pearson(counts: Counter, exact: dict[tuple[int, ...], float], n: int) -> float:
    """p-value of Pearson's chi-square test that ``n`` outcomes with ``counts`` follow ``exact``: outcomes expected
    at least :data:`MIN_EXPECTED` times are bins, the rest one pooled bin (fixed before looking at the counts)."""
    assert sum(counts.values()) == n and set(counts) <= set(exact), "an outcome outside the support"
    big = [o for o, p in exact.items() if n * p >= MIN_EXPECTED]
    rest = [o for o in exact if o not in set(big)]
    expected = np.array([exact[o] for o in big] + ([sum(exact[o] for o in rest)] if rest else []))
    observed = np.array([counts[o] for o in big] + ([sum(counts[o] for o in rest)] if rest else []), dtype=float)
    return float(stats.chisquare(observed, n * expected / expected.sum()).pvalue)


def test_sample_drafts_is_a_sampler_of_probs():
    """The joint of four draws of a round over many root positions fits the product of their ``q`` rows (each
    draw distributed as its depth's ``q``, draws of a round independent); a zero-mass token is never drawn."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05], [0.1, 0.2, 0.0, 0.3, 0.4]], dtype=torch.float64)
    q = probs.tolist()
    support = [[t for t in range(5) if q[d][t] > 0] for d in range(2)]
    exact = {(a, b, c, e): q[0][a] * q[1][b] * q[0][c] * q[0][e]
             for a, b, c, e in itertools.product(support[0], support[1], support[0], support[0])}
    counts = Counter(_joint_round(probs, pos) for pos in range(N_ROUNDS))
    # the support check of _pearson is the zero-mass check: an outcome holding a zero-mass token is not in exact
    assert _pearson(counts, exact, N_ROUNDS) > ALPHA


def test_sample_drafts_is_keyed():
    """Reproducible for a seed and a root position; another position or seed draws other drafts."""
    probs = _probs(torch.Generator().manual_seed(4), 8, 6, zero_frac=0.0)
    sampling = SamplingConfig(temperature=1.0, seed=8)
    first = sample_drafts(probs, 4, sampling, 100)
    assert torch.equal(first, sample_drafts(probs, 4, SamplingConfig(temperature=0.5, seed=8), 100))
    others = [sample_drafts(probs, 4, sampling, pos) for pos in range(101, 111)]
    others.append(sample_drafts(probs, 4, SamplingConfig(temperature=1.0, seed=9), 100))
    assert all(not torch.equal(first, o) for o in others)


def test_uniform_layout():
    """Draft ``k`` at depth ``d`` reads coin ``d * K + k`` of the round's keyed stream; a draw is ``inverse_cdf`` of
    its depth's row at that coin (what a captured round, feeding the coins in, relies on)."""
    sampling = SamplingConfig(temperature=1.0, seed=6)
    k, depth = 3, 4
    u = draft_uniforms(sampling, k, depth, 25)
    flat = keyed_uniforms(position_key(keyed_seed(sampling) ^ DRAFT_STREAM, 25), depth * k)
    assert u.shape == (depth, k) and u.dtype == torch.float64
    assert all(float(u[d, j]) == float(flat[d * k + j]) for d in range(depth) for j in range(k))
    probs = _probs(torch.Generator().manual_seed(7), depth, 5, zero_frac=0.3)
    drafts = drafts_from_uniforms(probs, u)
    assert torch.equal(drafts, sample_drafts(probs, k, sampling, 25))
    cdf = probs.cumsum(-1)
    for d in range(depth):
        for j in range(k):
            tok = int(drafts[j, d])
            low = float(cdf[d, tok - 1]) if tok > 0 else 0.0
            assert probs[d, tok] > 0 and low <= float(u[d, j] * cdf[d, -1]) < float(cdf[d, tok])


def test_certain_tokens_and_uniform_edges():
    """A probability-1 token is drawn every time, and a zero-mass last token never (the draw that lands on the
    top of the cumulative mass takes the last token with mass)."""
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.7, 0.0]], dtype=torch.float64)
    for pos in range(50):
        d = sample_drafts(probs, 5, SamplingConfig(temperature=1.0, seed=pos), pos)
        assert bool((d[:, 0] == 1).all()) and bool((d[:, 1] != 2).all())
