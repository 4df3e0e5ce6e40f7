"""DDTree construction and tree compilation: brute-force optimality, structure, mask (property-based)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spiffy.arspec.tree import build_chain, build_ddtree
from spiffy.errors import ConfigError
from spiffy.verify import DraftStructure, compile_packed


def _logprobs(draw_vals: list[float], depth: int, vocab: int) -> torch.Tensor:
    logits = torch.tensor(draw_vals, dtype=torch.float64).view(depth, vocab)
    return torch.log_softmax(logits, dim=-1)


def _brute_force(lp: torch.Tensor) -> list[tuple[float, tuple[int, ...]]]:
    """Every prefix of length 1..L with its score, summed left to right like the builder does."""
    depth, vocab = lp.shape
    vals = lp.tolist()
    out = []
    for length in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            s = vals[0][seq[0]]
            for d in range(1, length):
                s = s + vals[d][seq[d]]
            out.append((s, seq))
    return out


def _sequences(tree) -> list[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    seqs: list[tuple[int, ...]] = []
    for t, p in zip(toks, pars):
        seqs.append((seqs[p] if p >= 0 else ()) + (t,))
    return seqs


tree_case = st.integers(1, 3).flatmap(
    lambda depth: st.integers(2, 4).flatmap(
        lambda vocab: st.tuples(
            st.just(depth),
            st.just(vocab),
            st.lists(
                st.one_of(st.floats(-4, 4, allow_nan=False), st.sampled_from([0.0, 1.0, -1.0])),
                min_size=depth * vocab,
                max_size=depth * vocab,
            ),
            st.integers(0, sum(vocab**d for d in range(1, depth + 1)) + 3),
        )
    )
)


@settings(max_examples=150, deadline=None)
@given(tree_case)
def test_tree_equals_brute_force_top_prefixes(case):
    depth, vocab, vals, budget = case
    lp = _logprobs(vals, depth, vocab)
    tree = build_ddtree(lp, budget)
    everything = _brute_force(lp)
    n_expected = min(budget, len(everything))
    assert tree.num_nodes == n_expected
    seqs = _sequences(tree)
    # the chosen scores are exactly the top-B scores of all prefixes
    best = sorted((s for s, _ in everything), reverse=True)[:n_expected]
    assert sorted(tree.scores.tolist(), reverse=True) == best
    # each node's score is the product probability (log-sum) of its prefix
    for seq, score in zip(seqs, tree.scores.tolist()):
        assert score == next(s for s, q in everything if q == seq)
    # when scores are all distinct the optimal set is unique: it must be exactly the brute-force one
    scores = [s for s, _ in everything]
    if len(set(scores)) == len(scores):
        top = {q for _, q in sorted(everything, key=lambda x: -x[0])[:n_expected]}
        assert set(seqs) == top


@settings(max_examples=100, deadline=None)
@given(tree_case)
def test_tree_structure_parents_first_and_pop_order(case):
    depth, vocab, vals, budget = case
    lp = _logprobs(vals, depth, vocab)
    tree = build_ddtree(lp, budget)
    seqs = _sequences(tree)
    assert len(set(seqs)) == len(seqs), "a prefix appears twice"
    for i, (p, d) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist())):
        assert p < i, "parents must precede children"
        assert d == (1 if p < 0 else tree.depths[p].item() + 1)
        assert d <= depth
    s = tree.scores.tolist()
    assert all(a >= b for a, b in zip(s, s[1:])), "nodes must come out best-first"
    # siblings carry distinct tokens, so the walk's child lookup is unambiguous
    assert len(tree.children_lookup()) == tree.num_nodes


def test_budget_edge_cases():
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]], dtype=torch.float64), dim=-1)
    assert build_ddtree(lp, 0).num_nodes == 0
    one = build_ddtree(lp, 1)
    assert one.tokens.tolist() == [0] and one.parents.tolist() == [-1] and one.depths.tolist() == [1]
    every = build_ddtree(lp, 3 * 2 + 9 + 100)  # budget > V * L and > the number of prefixes
    assert every.num_nodes == 3 + 9
    assert sorted(_sequences(every)) == sorted(
        [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    )
    with pytest.raises(ConfigError, match="budget"):
        build_ddtree(lp, -1)
    assert build_ddtree(lp[:0], 5).num_nodes == 0


def test_tree_deterministic_and_large_vocab():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(15, 5000, generator=g), dim=-1)
    a, b = build_ddtree(lp, 300), build_ddtree(lp, 300)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.num_nodes == 300
    # probability-1 tokens (log-prob exactly 0) tie with their parent: parents still come first
    peaked = torch.full((4, 7), float("-inf"), dtype=torch.float64)
    peaked[:, 3] = 0.0
    t = build_ddtree(peaked, 10)
    assert t.tokens.tolist()[:4] == [3, 3, 3, 3] and t.parents.tolist()[:4] == [-1, 0, 1, 2]


def test_chain_is_argmax_path():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    chain = build_chain(logits)
    assert chain.tokens.tolist() == [1, 0, 2]
    assert chain.parents.tolist() == [-1, 0, 1]
    assert chain.depths.tolist() == [1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(tree_case, st.integers(0, 6), st.integers(0, 50))
def test_compiled_mask_is_ancestor_visibility(case, ctx_len, root_pos):
    depth, vocab, vals, budget = case
    tree = build_ddtree(_logprobs(vals, depth, vocab), budget)
    n = tree.num_nodes
    structure = DraftStructure(
        tokens=list(tree.tokens.split(1)),
        positions=list((tree.depths + root_pos).split(1)),
        parents=[(p,) if p >= 0 else () for p in tree.parents.tolist()],
        visibility="ancestors",
    )
    comp = compile_packed(
        structure, context_len=ctx_len, dtype=torch.float64,
        prefix_rows=(torch.tensor([7]), torch.tensor([root_pos])),
    )
    r = n + 1
    assert comp.input_ids.tolist() == [[7] + tree.tokens.tolist()]
    assert comp.position_ids.tolist() == [[root_pos] + (tree.depths + root_pos).tolist()]
    mask = comp.attention_mask[0, 0]
    assert mask.shape == (r, ctx_len + r)
    visible = mask == 0
    assert bool(visible[:, :ctx_len].all()), "the committed context is visible to every row"
    pars = tree.parents.tolist()

    def ancestors_or_self(i: int) -> set[int]:
        out = {i}
        while pars[i] >= 0:
            i = pars[i]
            out.add(i)
        return out

    expected = torch.zeros(r, r, dtype=torch.bool)
    expected[:, 0] = True  # the root (bonus) is everyone's ancestor
    for i in range(n):
        for j in ancestors_or_self(i):
            expected[i + 1, j + 1] = True
    assert torch.equal(visible[:, ctx_len:], expected)
    hidden = mask[~visible]
    assert bool((hidden == torch.finfo(torch.float64).min).all())


def _oracle_tree(lp: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """The straightforward DDTree: every depth's full ranking (value descending, ties by token id ascending, one
    stable sort), top ``K = min(B, V)`` of each, and the textbook best-first heap over rank tuples."""
    import heapq

    depth_limit, vocab = lp.shape
    k = min(budget, vocab)
    vals_t, ids_t = torch.sort(lp, dim=-1, descending=True, stable=True)
    vals, ids = vals_t[:, :k].double().tolist(), ids_t[:, :k].tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap = [(-vals[0][0], (0,), 0, -1, 0.0)]
    while heap and len(tokens) < budget:
        neg, ranks, d, parent, parent_score = heapq.heappop(heap)
        node, r = len(tokens), ranks[-1]
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        scores.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (-(parent_score + vals[d][r + 1]), ranks[:-1] + (r + 1,), d, parent, parent_score))
        if d + 1 < depth_limit:
            heapq.heappush(heap, (-(-neg + vals[d + 1][0]), ranks + (0,), d + 1, node, -neg))
    return tokens, parents, depths, scores


@pytest.mark.parametrize("direct", [True, False], ids=["direct top-k", "chunk bound"])
@pytest.mark.parametrize("seed", range(6))
def test_fast_builder_equals_heap_oracle_on_random_logits(seed, direct, monkeypatch):
    """The builder (comb bound, only reachable ranks; or the small-vocabulary direct top-k) builds exactly the
    oracle's tree: same nodes, same order, same scores, same tie-breaks, for budgets 1..1024, vocabularies on both
    sides of the chunked path, with ties."""
    import spiffy.arspec.tree_ranks as tree_module

    monkeypatch.setattr(tree_module, "_DIRECT_TOPK_MAX_VOCAB", 1 << 30 if direct else 0)
    g = torch.Generator().manual_seed(seed)
    for case in range(4):
        depth = int(torch.randint(1, 17, (1,), generator=g))
        vocab = int(torch.randint(2, 3000, (1,), generator=g)) if case else int(torch.randint(2, 40, (1,), generator=g))
        scale = float(torch.rand(1, generator=g)) * 8
        logits = torch.randn(depth, vocab, generator=g) * scale
        if case % 2:  # many exact ties: integer logits (and identical rows when the scale is 0)
            logits = torch.round(logits)
        lp = torch.log_softmax(logits, dim=-1)
        for budget in (1, 2, 5, 16, 31, 64, 100, 256, 513, 1024):
            tree = build_ddtree(lp, budget)
            tokens, parents, depths, scores = _oracle_tree(lp, budget)
            assert tree.tokens.tolist() == tokens, (seed, case, depth, vocab, budget)
            assert tree.parents.tolist() == parents
            assert tree.depths.tolist() == depths
            assert tree.scores.tolist() == scores


def test_fast_builder_equals_oracle_with_filtered_rows():
    """-inf log-probabilities (a top-k filtered drafter) and a bound that is not finite take the full-ranking path
    and still match the oracle."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 2000, generator=g) * 3
    keep = torch.topk(logits, 20, dim=-1).indices
    filtered = torch.full_like(logits, float("-inf")).scatter(1, keep, logits.gather(1, keep))
    lp = torch.log_softmax(filtered, dim=-1)
    for budget in (8, 64, 200):  # 200 > the 120 finite comb prefixes of depth 1 alone
        tree = build_ddtree(lp, budget)
        tokens, parents, depths, scores = _oracle_tree(lp, budget)
        assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()) == (tokens, parents, depths)
        assert tree.scores.tolist() == scores


def test_fast_builder_equals_oracle_on_every_path(monkeypatch):
    """Real-sized rows: wide and narrow chunks, vocabularies with and without a tail block, the bound selected on
    the host and on the device, candidates ranked on the host and on the device, float32 / float64 / bfloat16
    log-probabilities (bfloat16: many exact ties): always the oracle's tree, node for node, with the same scores."""
    import spiffy.arspec.tree_ranks as tree_module
    from spiffy.bench.synthetic import synthetic_draft_logits

    used: set[str] = set()

    def spy(name, record):
        real = getattr(tree_module, name)

        def wrapped(*args):
            used.add(record(*args))
            return real(*args)

        monkeypatch.setattr(tree_module, name, wrapped)

    spy("_comb_bound", lambda summary, budget: f"bound on {'host' if summary.numel() <= 1024 else 'device'}")
    spy("_rank_on_host", lambda *args: "rank on host")
    spy("_rank_on_device", lambda *args: "rank on device")
    spy("_direct_top_k", lambda *args: "direct top-k")
    spy("top_ranked", lambda *args: "top_ranked")
    widths: set[int | None] = set()
    for vocab, depth, dtype, seed in ((30_000, 16, torch.float32, 0), (30_011, 12, torch.float64, 1),
                                      (20_480, 16, torch.bfloat16, 2), (4_099, 9, torch.float32, 3),
                                      (24_576, 15, torch.float32, 4)):
        logits = synthetic_draft_logits(depth, vocab, seed=seed)
        if seed == 4:  # a flat drafter: the comb bound lets most chunks through, each row's own top-k is cheaper
            logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5
        if seed % 2:  # exact ties between tokens (and between prefixes across depths)
            logits = torch.round(logits * 2) / 2
        # a depth's best token in its last column (the tail block when the chunks do not divide V) or its first
        logits[0::2, -1] = logits[0::2].amax(dim=-1) + 0.5
        logits[1::2, 0] = logits[1::2].amax(dim=-1) + 0.5
        lp = torch.log_softmax(logits.double(), dim=-1).to(dtype)
        for budget in (1, 3, 16, 64, 100, 300, 1024):
            widths.add(tree_module._chunk_width(vocab, budget))
            tree = build_ddtree(lp, budget)
            tokens, parents, depths, scores = _oracle_tree(lp, budget)
            assert tree.tokens.tolist() == tokens, (vocab, dtype, budget)
            assert tree.parents.tolist() == parents and tree.depths.tolist() == depths
            assert tree.scores.tolist() == scores
    # uniform rows: every prefix of a depth ties with every other, so the pop order is the rank-tuple order alone
    uniform = torch.full((3, 4096), -math.log(4096), dtype=torch.float32)
    for budget in (5, 300, 1024):
        tree = build_ddtree(uniform, budget)
        tokens, parents, depths, scores = _oracle_tree(uniform, budget)
        assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()) == (tokens, parents, depths)
    assert used >= {"bound on host", "bound on device", "rank on host", "rank on device", "direct top-k",
                    "top_ranked"}, used
    assert {256, 128, 64} <= widths, widths


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(17, 90), st.integers(1, 400), st.integers(0, 2**31 - 1),
       st.sampled_from(["peaked", "flat", "ties"]))
def test_lazy_ranks_grow_into_the_oracle_tree(depth, vocab, budget, seed, kind):
    """Random small-vocabulary rows with budgets past the first 16 ranks: depths are ranked further only as the
    heap reaches their end (a flat row's first depth all the way to K, several times over), ties included, and the
    tree is the oracle's over full rankings, node for node."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * (0.3 if kind == "flat" else 3.0)
    if kind == "ties":
        logits = torch.round(logits)
    lp = torch.log_softmax(logits, dim=-1)
    tree = build_ddtree(lp, budget)
    tokens, parents, depths, scores = _oracle_tree(lp, budget)
    assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()) == (tokens, parents, depths)
    assert tree.scores.tolist() == scores
