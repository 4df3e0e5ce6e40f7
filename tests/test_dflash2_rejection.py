"""The rejection rule over DFlash2 drafts is exact in distribution: the same statistical test as
``tests/test_arspec_rejection.py`` (Pearson's chi-square against the exact AR distribution, pooled bins, level
``ALPHA = 1e-3``, every seed fixed), with the DFlash2 selector's proposals instead of position-wise marginals.

A DFlash2 proposal at depth ``d`` depends on the token drafted before it, and it covers only the ``K`` candidates of
that depth (``q = 0`` elsewhere: the residual ``max(0, p - q)`` keeps the rest of ``p``). Three draft structures:

* ``chain``: one draft walked through the selector at the target's temperature (the official package's ``T > 0``
  draft), accepted with ``min(1, p / q(. | previous))``;
* ``tree``: DDTree over the selector (deterministic children: point-mass proposals);
* ``specdiff``: four drafts walked through the selector, merged into one tree; below each node the draws are i.i.d.
  from ``q(. | that node's token)`` (``DraftTree.proposal`` is per node), recursive rejection sampling.

One round on a table-defined target (many samples), then whole generations through
:func:`spiffy.arspec.speculative_generate` with a tiny Qwen3 target and a tiny DFlash2 drafter (methods ``dflash2``,
``ddtree-dflash2`` and ``specdiff`` over it). Six tests claim exactness here: a correct rule fails one with
probability at most 6e-3 for a random choice of seeds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_arspec_rejection import E2E_N, E2E_NEW, E2E_PROMPT, E2E_V, LENGTH, ROOT, N_ROUND, TableTarget, ALPHA
from test_arspec_rejection import _exact, _exact_generation, _pearson, _table_logits

from spiffy.arspec import ARSpecConfig, SamplingConfig, SelectorDraft, as_drafter, speculative_generate
from spiffy.arspec.rejection import RejectionRule
from spiffy.models import load_ar_drafter, load_target, make_tiny_dflash2, make_tiny_target

torch.set_num_threads(1)

V = 5
K = 3  # candidates per depth: two tokens of every depth have q = 0


def _selector_draft(depth: int) -> SelectorDraft:
    gen = torch.Generator().manual_seed(7)
    cands = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(depth)])
    first = 1.3 * torch.randn(K, generator=gen, dtype=torch.float64)
    following = 1.3 * torch.randn(depth - 1, K, K, generator=gen, dtype=torch.float64)
    return SelectorDraft(cands, first, following, V)


def _tree(kind: str, draft: SelectorDraft, sampling: SamplingConfig):  # noqa: ANN202
    if kind == "chain":
        return draft.sample_tree(1, sampling, len(ROOT) - 1)
    if kind == "tree":
        return draft.best_tree(6, float(sampling.temperature))
    return draft.sample_tree(4, sampling, len(ROOT) - 1)


@pytest.fixture(scope="module")
def exact_round():
    return _exact(ROOT, LENGTH)


@pytest.mark.parametrize("kind", ["chain", pytest.param("tree", marks=pytest.mark.slow),
                                  pytest.param("specdiff", marks=pytest.mark.slow)])
def test_rejection_round_over_the_selector_matches_the_exact_distribution(kind, exact_round):
    draft = _selector_draft(LENGTH - 1)
    counts: Counter = Counter()
    continuation = torch.Generator().manual_seed(4321)
    accepted = 0
    for seed in range(N_ROUND):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        tree = _tree(kind, draft, sampling)
        out = RejectionRule(sampling).accept(tree, TableTarget(tree, ROOT), draft, len(ROOT) - 1)
        accepted += len(out.accepted)
        seq = tuple(tree.tokens[out.accepted].tolist()) + (out.bonus,)
        while len(seq) < LENGTH:  # continue with plain AR sampling
            p = torch.softmax(_table_logits(ROOT + seq), -1)
            seq = seq + (int(torch.multinomial(p, 1, generator=continuation)),)
        counts[seq[:LENGTH]] += 1
    assert accepted > N_ROUND // 4  # the drafts were accepted often: the test exercises the rule, not the residual
    assert _pearson(counts, exact_round, N_ROUND) >= ALPHA, kind


@pytest.mark.slow  # the power check: the round test's own failure, shown once per CI run
def test_a_marginal_proposal_for_the_selectors_draws_is_caught(exact_round):
    """Power check: treating the selector's conditional draws as if they came from the depth's marginal (the
    proposal a position-wise drafter would give) is biased, and the round test sees it."""
    draft = _selector_draft(LENGTH - 1)
    q1 = torch.softmax(draft.first, -1)
    marginal = torch.zeros(V, dtype=torch.float64)
    marginal[draft.candidates[1]] = q1 @ torch.softmax(draft.following[0], -1)
    counts: Counter = Counter()
    continuation = torch.Generator().manual_seed(4321)
    for seed in range(N_ROUND):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        tree = draft.sample_tree(1, sampling, len(ROOT) - 1)
        first = tree.proposal.dense(-1)  # type: ignore[union-attr]
        tree.proposal.rows = {n: ((draft.candidates[0], first[draft.candidates[0]]) if n < 0 else  # type: ignore[union-attr]
                                  (draft.candidates[1], marginal[draft.candidates[1]])) for n in tree.proposal.rows}  # type: ignore[union-attr]
        out = RejectionRule(sampling).accept(tree, TableTarget(tree, ROOT), draft, len(ROOT) - 1)
        seq = tuple(tree.tokens[out.accepted].tolist()) + (out.bonus,)
        while len(seq) < LENGTH:
            p = torch.softmax(_table_logits(ROOT + seq), -1)
            seq = seq + (int(torch.multinomial(p, 1, generator=continuation)),)
        counts[seq[:LENGTH]] += 1
    assert _pearson(counts, exact_round, N_ROUND) < ALPHA


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("dflash2_rejection")
    target_dir = make_tiny_target(base / "t", seed=5, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                  vocab_size=E2E_V, weight_std=0.2, with_tokenizer=False)
    drafter_dir = make_tiny_dflash2(base / "d", target_dir, seed=4, block_size=4, selector_top_k=3, selector_rank=4,
                                    conv_kernel_size=2, conv_group_size=4)
    return load_target(target_dir, torch.float64, "cpu"), load_ar_drafter(drafter_dir, dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash2", "ddtree-dflash2", "specdiff"])
def test_rejection_generation_over_dflash2_matches_the_exact_distribution(tiny_pair, method):
    target, model = tiny_pair
    exact = _exact_generation(target)
    counts: Counter = Counter()
    rounds = 0
    for seed in range(E2E_N):
        cfg = ARSpecConfig(method=method, budget=2, drafts=3, accept="rejection", max_new_tokens=E2E_NEW,
                           sampling=SamplingConfig(temperature=1.0, seed=seed))
        res = speculative_generate(target, as_drafter(model), E2E_PROMPT, cfg)
        counts[tuple(res.tokens)] += 1
        rounds += res.rounds
    assert rounds < E2E_N * (E2E_NEW - 1)  # drafts were accepted (fewer rounds than plain AR)
    assert _pearson(counts, exact, E2E_N) >= ALPHA, method
