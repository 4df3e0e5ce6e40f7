"""DFlash2's drafts on the device (:mod:`spiffy.arspec.device_selector`) are the host builders' node for node, read
nothing back, and take over the captured path's DFlash2 rounds.

* Random :class:`SelectorDraft`s (depths 1-6, 1-8 candidates with repeated tokens, small integer scores full of
  ties, ``-inf`` candidates, float32 and float64, budgets 1-40, T in 0 / 0.5 / 1 / 2): the device tree's first
  ``real`` nodes are :meth:`SelectorDraft.best_tree`'s (tokens, parents, depths, float64 scores bit for bit, order),
  the rest is padding, ``count`` the static bound; the device chain is :meth:`SelectorDraft.chain`'s.
* No host read while building either (:class:`~spiffy.bench.syncs.SyncCounter` sees none).
* Drafts walked through the selector (:meth:`SelectorDraft.sample_tree`, 1-9 drafts, the same random drafts and
  temperatures, cut lengths): the device twin's nodes, draws below every node and dense proposals are the host's
  bit for bit; the exponential race over :func:`selector_exponentials` draws what ``torch.multinomial`` draws from
  the same keyed generator (the stream the host loop used before).
* ``compile=True`` == ``compile=False`` for ``dflash2``, ``ddtree-dflash2`` and SpecDiff-2 over DFlash2 (coupled at
  T = 0 and 0.7, rejection at 0.9), the captured rounds building every tree in the tree step (the sampled chain and
  drafts too) and walking on the device (no host walk), and a round reading the device at most twice; the tree
  step traces as one graph.
* A shorter draft (the last rounds of a generation) built in the shapes of the full one, its length as data, is the
  host builders' tree of the cut draft.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spiffy.arspec.captured_trees as captured_module
from captured_rounds import captured_round_syncs, guess_selector_drafts
from spiffy.arspec import ARSpecConfig, SamplingConfig, SelectorDraft, as_drafter, speculative_generate
from spiffy.arspec.captured import static_target_of
from spiffy.arspec.captured_rounds import CapturedRounds
from spiffy.arspec.device_rejection import Proposals
from spiffy.arspec.device_selector import selector_chain_device, selector_sampled_device, selector_tree_device
from spiffy.arspec.device_tree import DeviceTree, ddtree_node_count
from spiffy.arspec.selector import race_draw, selector_exponentials
from spiffy.arspec.selfselect import DRAFT_STREAM, draft_temperature
from spiffy.arspec.sampling import keyed_seed, position_key
from spiffy.arspec.tree import DraftTree
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import trace_steps
from spiffy.models import load_ar_drafter, load_target, make_tiny_dflash2, make_tiny_target

torch.set_num_threads(1)

FIELDS = ("tokens", "parents", "depths", "scores")
BLOCK = 6


@st.composite
def selector_drafts(draw: Any) -> SelectorDraft:
    """A random draft: ties (integer scores in -2..0), repeated candidate tokens, ``-inf`` candidates (never a whole
    row: its log q would be NaN, which has no order on the host either), float32 or float64 scores."""
    depth, k = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    cands = torch.randint(0, max(2, k + draw(st.integers(-1, 4))), (depth, k), generator=g)
    scores = torch.randint(-2, 1, (1 + max(depth - 1, 0) * k, k), generator=g).double()
    if draw(st.booleans()):  # uniform rows over random subsets: probabilities 1/m, sums tie across parents
        scores.zero_()
    elif draw(st.booleans()):  # continuous scores too (distinct values, far from ties)
        scores = scores + torch.randn(scores.shape, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.0, 3.0]))
    hole = torch.rand(scores.shape, generator=g) < draw(st.sampled_from([0.0, 0.2, 0.5]))
    hole[torch.arange(scores.shape[0]), torch.randint(0, k, (scores.shape[0],), generator=g)] = False
    scores = scores.masked_fill(hole, float("-inf"))
    scores = scores.to(draw(st.sampled_from([torch.float32, torch.float64])))
    return SelectorDraft(cands, scores[0], scores[1:].reshape(max(depth - 1, 0), k, k), 64)


def _assert_same(host: DraftTree, dev: DeviceTree, real: int) -> None:
    """The device tree's first ``real`` nodes are the host tree's, the rest is DeviceTree's padding."""
    assert host.num_nodes == real
    for name in FIELDS:
        assert torch.equal(getattr(dev, name)[:real], getattr(host, name)), name
    pad = (slice(real, None),)
    assert bool((dev.tokens[pad] == 0).all() and (dev.parents[pad] == -1).all() and (dev.depths[pad] == 1).all())
    assert bool((dev.scores[pad] == float("-inf")).all())


@settings(max_examples=250, deadline=None, derandomize=True, database=None)
@given(draft=selector_drafts(), budget=st.integers(1, 40), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_device_tree_is_the_host_tree(draft, budget, temperature):
    """best_tree's nodes and order, ties and -inf candidates included; count the static bound, real the nodes."""
    host, dev = draft.best_tree(budget, temperature), selector_tree_device(draft, budget, temperature)
    assert dev.real is not None and dev.tokens.shape == (budget,)
    assert dev.count == ddtree_node_count(budget, draft.depth, int(draft.candidates.shape[1]))
    real = int(dev.real)
    assert real <= dev.count
    _assert_same(host, dev, real)


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(draft=selector_drafts())
def test_device_chain_is_the_host_chain(draft):
    host, dev = draft.chain(), selector_chain_device(draft)
    assert dev.real is None and dev.count == draft.depth
    _assert_same(host, dev, draft.depth)


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(draft=selector_drafts(), cut=st.integers(1, 6), budget=st.integers(1, 40),
       temperature=st.sampled_from([0.0, 0.7]))
def test_a_shorter_draft_in_the_same_shapes_is_its_own_tree(draft, cut, budget, temperature):
    """The tree and chain of the first ``d`` depths, built in the shapes of all ``D`` with ``d`` as data (one captured
    tree step for every draft length): the host builders' of the draft cut to ``d`` depths."""
    d = min(cut, draft.depth)
    short = SelectorDraft(draft.candidates[:d], draft.first, draft.following[: d - 1], draft.vocab_size)
    length = torch.tensor(d)
    tree = selector_tree_device(draft, budget, temperature, length)
    _assert_same(short.best_tree(budget, temperature), tree, int(tree.real))
    chain = selector_chain_device(draft, length)
    assert int(chain.real) == d
    _assert_same(short.chain(), chain, d)


def _assert_same_sampled(host: DraftTree, draft: SelectorDraft, sampling: SamplingConfig, drafts: int,
                          length: int | None) -> None:
    """The device twin of ``host`` (``draft`` cut to ``length`` depths, its races in the full draft's shapes): the
    nodes, the draws below the root and each node in draw order, and each one's dense proposal, bit for bit."""
    depth, k = draft.depth, int(draft.candidates.shape[1])
    races = torch.zeros(drafts, depth, k, dtype=torch.float64)
    races[:, : length or depth] = selector_exponentials(sampling, drafts, length or depth, k, 11)
    dev = selector_sampled_device(draft, drafts, draft_temperature(sampling), races,
                                  None if length is None else torch.tensor(length))
    real = int(dev.real)
    assert dev.tree.count == drafts * depth and dev.proposal_rows is not None
    _assert_same(host, dev.tree, real)
    assert host.samples is not None and host.proposal is not None
    for node in range(-1, real):
        assert [t for t in dev.draws[node + 1].tolist() if t >= 0] == host.samples.get(node, []), node
        want = host.proposal.dense(node)  # type: ignore[union-attr]
        got = dev.proposal[int(dev.proposal_rows[node + 1])]
        assert bool((got == 0).all()) if want is None else torch.equal(got, want), node


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(draft=selector_drafts(), drafts=st.integers(1, 9), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       seed=st.integers(0, 50), cut=st.one_of(st.none(), st.integers(1, 6)))
def test_device_sampled_drafts_are_the_host_drafts(draft, drafts, temperature, seed, cut):
    """sample_tree's nodes, draws and per-node proposals, ties, repeated tokens and -inf candidates included, for
    the whole draft and (``cut``) for its first depths built in the whole draft's shapes."""
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    length = None if cut is None else min(cut, draft.depth)
    short = draft if length is None else SelectorDraft(draft.candidates[:length], draft.first,
                                                       draft.following[: length - 1], draft.vocab_size)
    _assert_same_sampled(short.sample_tree(drafts, sampling, 11), draft, sampling, drafts, length)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(draft=selector_drafts(), drafts=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_the_race_draws_what_multinomial_draws(draft, drafts, seed):
    """One call's exponentials, raced depth by depth, draw what ``torch.multinomial(q, 1)`` draws from the same
    keyed generator one call at a time (the host loop's stream before the race; a torch that changes how either
    reads its generator fails here)."""
    sampling = SamplingConfig(temperature=0.8, seed=seed)
    k = int(draft.candidates.shape[1])
    q_first = torch.softmax(draft.first.double() / 0.8, -1)
    q_next = torch.softmax(draft.following.double() / 0.8, -1)
    races = selector_exponentials(sampling, drafts, draft.depth, k, 5)
    gen = torch.Generator().manual_seed(position_key(keyed_seed(sampling) ^ DRAFT_STREAM, 5))
    for j in range(drafts):
        index = -1
        for d in range(draft.depth):
            q = q_first if d == 0 else q_next[d - 1, index]
            index = int(torch.multinomial(q, 1, generator=gen))
            assert int(race_draw(q, races[j, d])) == index


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4)), min_size=1,
                                                  max_size=3))
def test_the_tree_step_writes_the_host_proposals(seed, rows):
    """:func:`tree_program` on a batch of DFlash2 sampled rows (``(drafts, depth)`` per row, ``0`` drafts: no draft;
    ragged depths in the batch's shapes): each row's nodes, and below the root and every node its draws and the
    ``q`` its ``q_row`` points at, are the host tree's (:meth:`SelectorDraft.sample_tree`)."""
    g = torch.Generator().manual_seed(seed)
    k, vocab, depth = 4, 12, max(d for _n, d in rows)
    batch = len(rows)
    plan = captured_module.TreePlan(tuple(("none",) if n == 0 else ("selector_sampled", depth, n, 0.9, k, vocab)
                                          for n, _d in rows))
    cands = torch.randint(0, vocab, (batch, depth, k), generator=g)
    first = torch.randn(batch, k, generator=g, dtype=torch.float64) * 2
    following = torch.randn(batch, max(depth - 1, 0), k, k, generator=g, dtype=torch.float64) * 2
    configs = [SimpleNamespace(sampling=SamplingConfig(temperature=0.9, seed=seed + b)) for b in range(batch)]
    roots = [(0, 7 + 3 * b) for b in range(batch)]
    lengths = [d if n else 0 for n, d in rows]
    width = 1 + max(plan.counts())
    ids, positions = torch.zeros(batch, width, dtype=torch.long), torch.zeros(batch, width, dtype=torch.long)
    parents, depths = torch.zeros(batch, width - 1, dtype=torch.long), torch.zeros(batch, width - 1, dtype=torch.long)
    counts = torch.zeros(batch, dtype=torch.long)
    proposals = Proposals(torch.zeros(batch, width, plan.draws, dtype=torch.long),
                          torch.zeros(batch, plan.q_rows, vocab, dtype=torch.float64),
                          torch.zeros(batch, width, dtype=torch.long))
    captured_module.tree_program(plan, None, torch.tensor(lengths), ids, parents, depths, counts, positions,
                                 proposals=proposals, selector=SelectorDraft(cands, first, following, vocab),
                                 races=captured_module.tree_races(plan, configs, roots, lengths))
    assert proposals.q is not None and proposals.q_row is not None
    for b, (n, d) in enumerate(rows):
        if n == 0:
            assert int(counts[b]) == 0
            continue
        mine = SelectorDraft(cands[b, :d], first[b], following[b, : d - 1], vocab)
        host = mine.sample_tree(n, configs[b].sampling, roots[b][1])
        real = host.num_nodes
        assert int(counts[b]) == real and ids[b, 1 : 1 + real].tolist() == host.tokens.tolist()
        assert parents[b, :real].tolist() == host.parents.tolist() and depths[b, :real].tolist() == host.depths.tolist()
        assert host.samples is not None and host.proposal is not None
        for node, draws in host.samples.items():
            assert [t for t in proposals.draws[b, node + 1].tolist() if t >= 0] == draws, (b, node)
            want = host.proposal.dense(node)  # type: ignore[union-attr]
            assert torch.equal(proposals.q[b, int(proposals.q_row[b, node + 1])], want), (b, node)


def test_skipped_candidates_leave_padding():
    """Candidates of probability 0 are never added: the real count drops below the bound and padding follows."""
    inf = float("-inf")
    cands = torch.tensor([[7, 3, 5], [1, 2, 3]])
    first = torch.tensor([0.0, inf, 0.0], dtype=torch.float64)  # tokens 7 and 5 tie: 5 (lower id) ranks first
    following = torch.tensor([[[0.0, inf, inf], [0.0, 0.0, 0.0], [1.0, inf, 0.0]]], dtype=torch.float64)
    draft = SelectorDraft(cands, first, following, 10)
    dev = selector_tree_device(draft, 8, 1.0)
    assert dev.count == 8 and int(dev.real) == 5  # 2 depth-1 nodes; 7 has 1 possible child, 5 has 2
    assert dev.tokens.tolist() == [5, 7, 1, 1, 3, 0, 0, 0]  # 7's only child (log q 0) before 5's first one
    assert dev.parents.tolist() == [-1, -1, 1, 0, 0, -1, -1, -1]
    _assert_same(draft.best_tree(8, 1.0), dev, 5)


def test_ties_across_parents_keep_rank_tuple_order():
    """A depth-3 prefix below a better-scoring parent ties (bit for bit: -log 3 - log 4 == -log 12 + 0) with one
    below a worse parent that comes first in rank-tuple order: the host pops the latter first, so the kept parents
    must be back in rank-tuple order before their children are ranked (found by a search over uniform rows)."""
    inf = float("-inf")
    cands = torch.tensor([[2, 6, 8, 9], [4, 8, 5, 2], [0, 5, 4, 8]])
    first = torch.tensor([0.0, 0.0, 0.0, inf], dtype=torch.float64)
    following = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [inf, inf, 0.0, inf], [inf, inf, 0.0, inf], [inf, inf, inf, 0.0]],
                              [[inf, inf, inf, 0.0], [0.0, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0], [inf, 0.0, 0.0, inf]]],
                             dtype=torch.float64)
    draft = SelectorDraft(cands, first, following, 10)
    dev = selector_tree_device(draft, 8, 1.0)
    _assert_same(draft.best_tree(8, 1.0), dev, int(dev.real))


def test_building_reads_nothing_back():
    """Neither builder makes a host synchronisation (``.item()``, ``.tolist()``, a mask index, a CPU copy...)."""
    g = torch.Generator().manual_seed(5)
    draft = SelectorDraft(torch.randint(0, 30, (5, 6), generator=g), torch.randn(6, generator=g),
                          torch.randn(4, 6, 6, generator=g).masked_fill(torch.rand(4, 6, 6, generator=g) < 0.2, -1e30),
                          30)
    with SyncCounter() as counter:
        tree = selector_tree_device(draft, 24, 0.7)
        chain = selector_chain_device(draft)
        sampled = selector_sampled_device(draft, 3, 0.7, torch.rand(3, 5, 6, generator=g, dtype=torch.float64))
    assert counter.total == 0, counter.counts
    assert sampled.draws.shape == (16, 3) and sampled.proposal.shape == (16, 30)
    assert tree.tokens.shape == (24,) and chain.tokens.shape == (5,)


# ----------------------------------------------------------------------------------------------- the captured path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("device_selector")
    target = make_tiny_target(base / "target", seed=2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              vocab_size=48, weight_std=0.3, with_tokenizer=False)
    return target, make_tiny_dflash2(base / "drafter", target, seed=4, num_layers=2, target_layer_ids=[0, 1],
                                     block_size=BLOCK, selector_top_k=5, selector_rank=6, conv_kernel_size=3,
                                     conv_group_size=16)


#: (method, rule, T, budget, holes): with ``holes`` most candidates have probability 0, so DFlash2's trees have fewer
#: nodes than the budget (the device tree's real count then differs from its static bound)
CASES = [("dflash2", "coupled", 0.0, 9, False), ("dflash2", "coupled", 0.7, 9, False),
         ("dflash2", "rejection", 0.9, 9, False), ("ddtree-dflash2", "coupled", 0.0, 9, False),
         ("ddtree-dflash2", "coupled", 0.7, 9, False), ("ddtree-dflash2", "rejection", 0.9, 9, False),
         ("ddtree-dflash2", "coupled", 0.7, 16, True), ("ddtree-dflash2", "rejection", 0.9, 16, True)]


@pytest.mark.parametrize("method,accept,temperature,budget,holes", CASES)
def test_captured_equals_eager(pair, method, accept, temperature, budget, holes):
    """compile=True == compile=False (tokens, acceptance, nodes per round) with deep accepted paths; every tree is
    built in the captured tree step and walked on the device (no host walk), the sampled chain (rejection at T > 0)
    too."""
    target = load_target(pair[0], torch.float64, "cpu")
    sampling = SamplingConfig(temperature=temperature, seed=3)
    prompt = [5, 9, 2, 17]
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=14, sampling=sampling))
    config = ARSpecConfig(method=method, budget=budget, max_new_tokens=14, accept=accept, sampling=sampling)
    eager, captured, kinds = _eager_then_captured(target, pair[1], prompt, config, ar.tokens, holes)
    assert captured.tokens == eager.tokens and len(captured.tokens) == 14
    # every DFlash2 tree is built in the captured tree step: its chain sampled through the selector (the rejection
    # rule at T > 0) too
    sampled_chain = method == "dflash2" and accept == "rejection" and temperature > 0
    assert kinds == {"selector_sampled" if sampled_chain else
                     "selector_tree" if method == "ddtree-dflash2" else "selector_chain"}
    assert captured.acceptance_lengths == eager.acceptance_lengths
    assert captured.nodes_per_round == eager.nodes_per_round
    full = budget if method == "ddtree-dflash2" else BLOCK - 1  # a round's nodes when no candidate is skipped
    assert (max(captured.nodes_per_round) < full) if holes else (max(captured.nodes_per_round) == full)
    if accept == "coupled":  # the output is AR's, and the walk went deep
        assert captured.tokens == ar.tokens and max(captured.acceptance_lengths) > 2, captured.acceptance_lengths


def _eager_then_captured(target: Any, drafter_dir: Path, prompt: list[int], config: ARSpecConfig,
                         continuation: list[int], holes: bool) -> tuple[Any, Any, set[str]]:
    """``(eager, captured, the captured tree kinds)`` of one generation whose drafts guess ``continuation``
    (:func:`captured_rounds.guess_selector_drafts`); fails if a captured round walks on the host."""
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CapturedRounds, "_walk_host", lambda *a, **k: pytest.fail("a captured round walked on the host"))
        guess_selector_drafts(mp, len(prompt), continuation, {2, 7}, holes)
        for compile_ in (False, True):
            drafter = as_drafter(load_ar_drafter(drafter_dir, dtype=torch.float64))
            runs.append(speculative_generate(target, drafter, prompt, config, compile=compile_))
    kinds = {row[0] for key in static_target_of(target).graphs.stats.runs if key[0] == "tree"
             for row in key[3].rows} - {"none"}
    return runs[0], runs[1], kinds


@pytest.mark.parametrize("accept,temperature,drafts", [("rejection", 0.9, 3), ("coupled", 0.7, 2),
                                                     pytest.param("rejection", 1.3, 1, marks=pytest.mark.slow)])
def test_sampled_drafts_captured_equal_eager(pair, accept, temperature, drafts):
    """SpecDiff-2 over DFlash2 (drafts walked through the selector, merged, per-node proposals): compile=True ==
    compile=False, with deep accepted paths, every tree built in the captured tree step and no host walk."""
    target = load_target(pair[0], torch.float64, "cpu")
    sampling = SamplingConfig(temperature=temperature, seed=5)
    prompt = [5, 9, 2, 17]
    ar = speculative_generate(target, None, prompt, ARSpecConfig(method="ar", max_new_tokens=14, sampling=sampling))
    config = ARSpecConfig(method="specdiff", drafts=drafts, max_new_tokens=14, accept=accept, sampling=sampling)
    eager, captured, kinds = _eager_then_captured(target, pair[1], prompt, config, ar.tokens, False)
    assert captured.tokens == eager.tokens and len(captured.tokens) == 14
    assert captured.acceptance_lengths == eager.acceptance_lengths
    assert captured.nodes_per_round == eager.nodes_per_round
    assert max(captured.acceptance_lengths) > 1, captured.acceptance_lengths
    assert kinds == {"selector_sampled"}


@pytest.mark.parametrize("method,accept,temperature", [("dflash2", "coupled", 0.7), ("ddtree-dflash2", "coupled", 0.0),
                                                      ("ddtree-dflash2", "rejection", 0.9),
                                                      ("dflash2", "rejection", 0.9), ("specdiff", "rejection", 0.9)])
def test_captured_round_reads_the_device_at_most_twice(pair, method, accept, temperature, monkeypatch):
    """A captured DFlash2 round outside the forwards (tree build, walk, commit) reads the device at most twice,
    and builds its tree with the device builders."""
    target = load_target(pair[0], torch.float64, "cpu")
    model = load_ar_drafter(pair[1], dtype=torch.float64)
    built: list[str] = []
    for name in ("selector_tree_device", "selector_chain_device", "selector_sampled_device"):
        real = getattr(captured_module, name)
        monkeypatch.setattr(captured_module, name, lambda *a, _f=real, _n=name: built.append(_n) or _f(*a))
    config = ARSpecConfig(method=method, budget=9, max_new_tokens=12, accept=accept,
                          sampling=SamplingConfig(temperature=temperature, seed=4))
    res, per_round = captured_round_syncs(target, model, lambda: speculative_generate(
        target, as_drafter(model), [3, 1, 4, 1, 5], config, compile=True))
    assert len(res.tokens) == 12 and len(per_round) == res.rounds
    assert len(built) == res.rounds
    assert max(per_round) <= 2, per_round


@pytest.mark.slow
@pytest.mark.parametrize("method,accept,temperature", [("ddtree-dflash2", "rejection", 0.9),
                                                      ("dflash2", "coupled", 0.7), ("dflash2", "rejection", 0.9),
                                                      ("specdiff", "rejection", 0.9)])
def test_dflash2_tree_steps_trace_as_one_graph(pair, method, accept, temperature):
    """DFlash2's tree step (its DDTree, greedy chain and drafts sampled through the selector) is one graph for
    TorchDynamo (:func:`spiffy.capture.trace_steps`: no host read, no data-dependent shape), and returns the eager
    tokens."""
    config = ARSpecConfig(method=method, budget=9, max_new_tokens=12, accept=accept,
                          sampling=SamplingConfig(temperature=temperature, seed=3))
    runs = []
    for compile_ in (False, True):
        target = load_target(pair[0], torch.float32, "cpu")
        drafter = as_drafter(load_ar_drafter(pair[1], dtype=torch.float32))
        with trace_steps() if compile_ else contextlib.nullcontext():
            runs.append(speculative_generate(target, drafter, [5, 9, 2, 17], config, compile=compile_).tokens)
    assert runs[1] == runs[0]
    kinds = {row[0] for key in static_target_of(target).graphs.stats.runs if key[0] == "tree" for row in key[3].rows}
    sampled = accept == "rejection" and method != "ddtree-dflash2"
    assert kinds == {"selector_sampled" if sampled else "selector_tree" if method == "ddtree-dflash2"
                     else "selector_chain"}
