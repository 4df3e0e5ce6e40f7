"""The rejection (speculative-sampling) rule is exact in distribution: a statistical test on a tiny enumerable
vocabulary, for a sampled chain (DEER), a deterministic tree (DDTree) and K sampled drafts (SpecDiff-2), against the
exact AR distribution; and a deliberately biased self-selection (pick the draft by the verifier's expected streak,
then plain rejection sampling) that the same test catches.

Two levels:
* one round of the rule on a table-defined target (many samples, fast): the emitted tokens (accepted + bonus),
  continued by plain AR sampling to a fixed length, must be distributed as AR sampling;
* whole generations through :func:`spiffy.arspec.speculative_generate` with a tiny Qwen3 target and a tiny SDAR
  drafter (fewer samples).

The test (:func:`_pearson`): Pearson's chi-square goodness of fit, ``scipy.stats.chisquare``, of the observed
outcome counts against the exact distribution, on bins fixed before sampling: every outcome expected at least
:data:`MIN_EXPECTED` times is a bin, the rarer ones are pooled into one (so the chi-square approximation of the
statistic's null distribution holds). Each test rejects at p < :data:`ALPHA` = 1e-3; seven tests claim exactness
(three rules x one round, three methods x whole generations, DDTree on a hybrid target), so a correct rule fails any
of them with probability at most 7e-3 (Bonferroni) for a random choice of seeds. Every seed is fixed, so the outcome is deterministic.

Power against the biased self-selection (:func:`test_the_sample_size_catches_the_bias`): its output distribution ``b``
is computed exactly (:func:`_biased_round_distribution`, every ordered 4-tuple of drafts enumerated; the sampled
counts fit it), so the test's power at ``n`` samples is that of the noncentral chi-square: ``P(ncx2(df, lam) >
chi2.isf(ALPHA, df))`` with ``lam = n * sum (b - p)^2 / p`` over the pooled bins (``p`` exact), ``scipy.stats.ncx2``.
Unpooled, ``sum (b - p)^2 / p = 0.387`` per sample: the test catches the bias with probability >= 0.99 from
:data:`BIAS_SAMPLES_FOR_POWER` = 259 samples on (a simulation of 2000 multinomial samples of ``b`` agrees), and the
round tests draw :data:`N_ROUND` = 4000. With 4000 samples (70 degrees of freedom) it catches, with probability
>= 0.99, any distortion whose pooled ``sum (b - p)^2 / p`` is at least :data:`SMALLEST_CAUGHT` = 0.023.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Hashable, Mapping

import numpy as np
import pytest
import torch
from scipy import stats

from spiffy.arspec import ARSpecConfig, SamplingConfig, build_ddtree, speculative_generate
from spiffy.arspec.dllm_drafter import as_drafter
from spiffy.arspec.rejection import RejectionRule
from spiffy.arspec.selfselect import build_sampled_tree, draft_paths, expected_streaks, sample_drafts
from spiffy.arspec.tree import DraftTree
from spiffy.models import load_target, make_tiny_target
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter

torch.set_num_threads(1)

V = 5
LENGTH = 3  # tokens compared per round-level sample (root excluded)
ROOT = (1, 3)  # committed prefix + root token


def _table_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed random target: logits of the token after ``prefix`` (a deterministic function of the prefix)."""
    gen = torch.Generator().manual_seed(hash(prefix) & 0xFFFFFFFF)
    return 1.6 * torch.randn(V, generator=gen, dtype=torch.float64)


def _exact(prefix: tuple[int, ...], length: int) -> dict[tuple[int, ...], float]:
    """The exact AR distribution of the next ``length`` tokens after ``prefix`` (temperature 1)."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        ctx = prefix
        for tok in seq:
            prob *= float(torch.softmax(_table_logits(ctx), -1)[tok])
            ctx = ctx + (tok,)
        out[seq] = prob
    return out


class TableTarget:
    """The ``TargetLogits`` interface over a tree, backed by :func:`_table_logits`."""

    def __init__(self, tree: DraftTree, prefix: tuple[int, ...]) -> None:
        self.tree, self.prefix = tree, prefix

    def logits(self, node: int) -> torch.Tensor:
        path: list[int] = []
        parents = self.tree.parents.tolist()
        tokens = self.tree.tokens.tolist()
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        return _table_logits(self.prefix + tuple(reversed(path))).view(1, -1)


class BiasedSelfSelectRule:
    """SpecDiff-2's self-selection as a pre-selection: score every draft by the verifier's expected streak, keep the
    best one only, then plain single-draft rejection sampling on it. Looks at p before the coins: biased."""

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        self.inner = RejectionRule(sampling)

    def accept(self, tree, target, draft_logits, root_position):  # noqa: ANN001, ANN201
        scores = expected_streaks(tree, target, self.sampling)
        best = draft_paths(tree)[max(range(len(scores)), key=scores.__getitem__)]
        tokens = tree.tokens[best]
        chain = build_sampled_tree(tree.proposal, tokens.view(1, -1))
        out = self.inner.accept(chain, _Restricted(target, best), draft_logits, root_position)
        return type(out)([best[i] for i in out.accepted], out.bonus)


class _Restricted:
    """Target logits of a chain that is one path of a larger tree."""

    def __init__(self, target, path: list[int]) -> None:  # noqa: ANN001
        self.target, self.path = target, path

    def logits(self, node: int) -> torch.Tensor:
        return self.target.logits(-1 if node < 0 else self.path[node])


def _proposal(depth: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    return torch.softmax(1.6 * torch.randn(depth, V, generator=gen, dtype=torch.float64), -1)


SPECDIFF_DRAFTS = 4  # K of the SpecDiff-2 round tree


def _make_tree(kind: str, probs: torch.Tensor, sampling: SamplingConfig) -> DraftTree:
    if kind == "chain":
        return build_sampled_tree(probs, sample_drafts(probs, 1, sampling, len(ROOT) - 1))
    if kind == "tree":
        return build_ddtree(torch.log(probs), 6)
    return build_sampled_tree(probs, sample_drafts(probs, SPECDIFF_DRAFTS, sampling, len(ROOT) - 1))


#: significance level of every goodness-of-fit test below (a correct rule fails one with this probability)
ALPHA = 1e-3
#: outcomes expected fewer times than this are pooled into one bin
MIN_EXPECTED = 5.0
#: power the sample size must give against the biased self-selection
POWER = 0.99


def _bins(exact: Mapping[Hashable, float], n: int) -> list[list[Hashable]]:
    """The bins of the test at ``n`` samples, fixed by ``exact`` alone: one per outcome expected >= MIN_EXPECTED
    times, the rest pooled (and the pool merged into the smallest bin if it is itself expected too rarely)."""
    common = [[k] for k, prob in exact.items() if n * prob >= MIN_EXPECTED]
    rare = [k for k, prob in exact.items() if n * prob < MIN_EXPECTED]
    if not rare:
        return common
    if n * sum(exact[k] for k in rare) >= MIN_EXPECTED or not common:
        return common + [rare]
    smallest = min(range(len(common)), key=lambda i: exact[common[i][0]])
    common[smallest] = common[smallest] + rare
    return common


def _binned(dist: Mapping[Hashable, float], bins: list[list[Hashable]]) -> np.ndarray:
    return np.array([sum(dist.get(k, 0.0) for k in b) for b in bins], dtype=np.float64)


def _pearson(counts: Counter, exact: Mapping[Hashable, float], n: int) -> float:
    """p-value of Pearson's chi-square test (``scipy.stats.chisquare``) that ``n`` samples with outcome ``counts``
    follow ``exact``, on the pooled bins of :func:`_bins`."""
    assert sum(counts.values()) == n and set(counts) <= set(exact), "an outcome outside the exact support"
    bins = _bins(exact, n)
    expected = _binned(exact, bins)
    observed = _binned(counts, bins)
    return float(stats.chisquare(observed, n * expected / expected.sum()).pvalue)


def _power(exact: Mapping[Hashable, float], alternative: Mapping[Hashable, float], n: int) -> float:
    """Power of :func:`_pearson` at level ALPHA when the ``n`` samples follow ``alternative``: the noncentral
    chi-square approximation, ``P(ncx2(df, n * sum (a - p)^2 / p) > chi2.isf(ALPHA, df))`` over the pooled bins."""
    bins = _bins(exact, n)
    p, a = _binned(exact, bins), _binned(alternative, bins)
    dof = len(bins) - 1
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, dof), dof, n * float(((a - p) ** 2 / p).sum())))


def _round_samples(kind: str, rule_cls, n: int) -> Counter:  # noqa: ANN001
    probs = _proposal(LENGTH - 1)
    counts: Counter = Counter()
    continuation = torch.Generator().manual_seed(1234)
    for seed in range(n):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        tree = _make_tree(kind, probs, sampling)
        out = rule_cls(sampling).accept(tree, TableTarget(tree, ROOT), None, len(ROOT) - 1)
        seq = tuple(tree.tokens[out.accepted].tolist()) + (out.bonus,)
        while len(seq) < LENGTH:  # continue with plain AR sampling
            p = torch.softmax(_table_logits(ROOT + seq), -1)
            seq = seq + (int(torch.multinomial(p, 1, generator=continuation)),)
        counts[seq[:LENGTH]] += 1
    return counts


N_ROUND = 4000
#: fewest samples from which on the round test catches the biased self-selection with probability >= POWER
#: (recomputed by :func:`test_the_sample_size_catches_the_bias`)
BIAS_SAMPLES_FOR_POWER = 259
#: pooled sum (b - p)^2 / p of the smallest distortion N_ROUND samples catch with probability >= POWER
SMALLEST_CAUGHT = 0.023


@pytest.fixture(scope="module")
def exact_round():
    return _exact(ROOT, LENGTH)


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``norm(max(0, p - q))`` over the last axis."""
    left = np.maximum(p - q, 0.0)
    return left / left.sum(axis=-1, keepdims=True)


def _biased_round_distribution() -> dict[tuple[int, ...], float]:
    """The exact distribution of a round of :class:`BiasedSelfSelectRule` continued by AR sampling to LENGTH = 3
    tokens, written independently of the library.

    Every ordered SPECDIFF_DRAFTS-tuple of drafts ``(a, b)``, each drawn from ``q_1 x q_2``, is enumerated; the first
    draft with the highest expected streak ``m_1(a) (1 + m_2(a, b))`` is chosen (``m_d = min(1, p_d / q_d)``); single
    draft rejection sampling on it emits ``(a, b, AR)`` with probability ``m_1 m_2``, ``(a, residual_2, AR)`` with
    ``m_1 (1 - m_2)`` and ``(residual_1, AR, AR)`` with ``1 - m_1``.
    """
    assert LENGTH == 3

    def p(prefix: tuple[int, ...]) -> np.ndarray:
        return torch.softmax(_table_logits(ROOT + prefix), -1).numpy()

    q = _proposal(LENGTH - 1).numpy()  # [2, V]
    p1 = p(())
    p2 = np.stack([p((a,)) for a in range(V)])  # [a, b]
    p3 = np.stack([np.stack([p((a, b)) for b in range(V)]) for a in range(V)])  # [a, b, c]
    m1 = np.minimum(1.0, p1 / q[0])
    m2 = np.minimum(1.0, p2 / q[1])
    streak = (m1[:, None] * (1.0 + m2)).reshape(-1)  # per draft a * V + b
    drafts = np.array(list(itertools.product(range(V * V), repeat=SPECDIFF_DRAFTS)))  # [(V * V)^K, K]
    weight = np.prod(np.outer(q[0], q[1]).reshape(-1)[drafts], axis=1)
    chosen = drafts[np.arange(len(drafts)), np.argmax(streak[drafts], axis=1)]  # argmax: the first of the best
    p_chosen = np.bincount(chosen, weights=weight, minlength=V * V)
    after_first_rejection = _residual(p1, q[0])[:, None, None] * p2[:, :, None] * p3  # [y, z, c]
    second_residual = _residual(p2, q[1])  # [a, z]
    out = np.zeros((V, V, V))
    for draft, mass in enumerate(p_chosen):
        a, b = divmod(draft, V)
        out[a, b] += mass * m1[a] * m2[a, b] * p3[a, b]
        out[a] += mass * m1[a] * (1 - m2[a, b]) * second_residual[a][:, None] * p3[a]
        out += mass * (1 - m1[a]) * after_first_rejection
    return {seq: float(out[seq]) for seq in itertools.product(range(V), repeat=LENGTH)}


@pytest.mark.parametrize("kind", [pytest.param("chain", marks=pytest.mark.slow), "tree",
                                  pytest.param("specdiff", marks=pytest.mark.slow)])  # the fast tier: the tree
def test_rejection_round_matches_the_exact_distribution(kind, exact_round):
    counts = _round_samples(kind, RejectionRule, N_ROUND)
    assert _pearson(counts, exact_round, N_ROUND) >= ALPHA, kind


@pytest.mark.slow
def test_biased_self_selection_is_caught(exact_round):
    counts = _round_samples("specdiff", BiasedSelfSelectRule, N_ROUND)
    assert _pearson(counts, exact_round, N_ROUND) < ALPHA  # not AR sampling ...
    assert _pearson(counts, _biased_round_distribution(), N_ROUND) >= ALPHA  # ... but the distortion computed below


def test_the_sample_size_catches_the_bias(exact_round):
    """The round test's power against the biased self-selection, from the bias's exact distribution."""
    biased = _biased_round_distribution()
    assert sum(biased.values()) == pytest.approx(1.0, abs=1e-12)
    assert sum((biased[k] - p) ** 2 / p for k, p in exact_round.items()) == pytest.approx(0.387, abs=5e-4)
    too_few = [n for n in range(1, N_ROUND + 1) if _power(exact_round, biased, n) < POWER]
    enough = max(too_few) + 1  # power >= POWER from ``enough`` samples on
    assert enough == BIAS_SAMPLES_FOR_POWER <= N_ROUND
    # the noncentral chi-square approximates the statistic's law: simulate the test on the biased rule's multinomial
    bins = _bins(exact_round, enough)
    p, b = _binned(exact_round, bins), _binned(biased, bins)
    pvalues = stats.chisquare(np.random.default_rng(0).multinomial(enough, b, size=2000), enough * p, axis=1).pvalue
    assert float(np.mean(pvalues < ALPHA)) >= POWER - 0.01
    # at N_ROUND, any distortion whose pooled sum (b - p)^2 / p reaches SMALLEST_CAUGHT is caught as often
    dof = len(_bins(exact_round, N_ROUND)) - 1
    assert stats.ncx2.sf(stats.chi2.isf(ALPHA, dof), dof, SMALLEST_CAUGHT * N_ROUND) >= POWER


# ---------------------------------------------------------------------------------------------- whole generations

E2E_V = 4
E2E_NEW = 3
E2E_N = 1500
E2E_PROMPT = [0, 2]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("rejection_e2e")
    # weight scales chosen so that the 64 outcomes are spread (35 of them expected >= 5 times in E2E_N samples)
    target_dir = make_tiny_target(base / "t", seed=5, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                  vocab_size=E2E_V, weight_std=0.2, with_tokenizer=False)
    drafter_dir = make_tiny_dllm_drafter(base / "d", target_dir, seed=4, block_size=4, hidden_size=16, num_layers=1,
                                         num_heads=2, num_kv_heads=1, weight_std=0.5)
    target = load_target(target_dir, torch.float64, "cpu")
    return target, as_drafter(load_ar_drafter(drafter_dir, dtype=torch.float64))


def _exact_generation(target) -> dict[tuple[int, ...], float]:  # noqa: ANN001
    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(E2E_V), repeat=E2E_NEW):
            ids = torch.tensor([E2E_PROMPT + list(seq)])
            logp = torch.log_softmax(target(ids).logits[0].double(), -1)
            out[seq] = math.exp(sum(float(logp[len(E2E_PROMPT) - 1 + i, t]) for i, t in enumerate(seq)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["deer", "ddtree", "specdiff"])
def test_rejection_generation_matches_the_exact_distribution(tiny_pair, method):
    target, drafter = tiny_pair
    exact = _exact_generation(target)
    counts: Counter = Counter()
    rounds = 0
    for seed in range(E2E_N):
        cfg = ARSpecConfig(method=method, budget=2, drafts=3, accept="rejection", max_new_tokens=E2E_NEW,
                           sampling=SamplingConfig(temperature=1.0, seed=seed))
        res = speculative_generate(target, drafter, E2E_PROMPT, cfg)
        counts[tuple(res.tokens)] += 1
        rounds += res.rounds
    assert rounds < E2E_N * (E2E_NEW - 1)  # drafts were accepted (fewer rounds than plain AR)
    assert _pearson(counts, exact, E2E_N) >= ALPHA, method


@pytest.fixture(scope="module")
def tiny_hybrid_pair(tmp_path_factory, tiny_pair):
    """A Qwen3.5 target (transformers' class: a Gated-DeltaNet layer, then full attention) over the same 4-token
    vocabulary, random weights of std 0.4 so the outcomes spread, with the same kind of dLLM drafter."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    base = tmp_path_factory.mktemp("rejection_hybrid")
    config = Qwen3_5TextConfig(vocab_size=E2E_V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, full_attention_interval=2,
                               linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                               linear_value_head_dim=8, max_position_embeddings=64, eos_token_id=None)
    torch.manual_seed(6)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.4)
    model.save_pretrained(base / "t")
    drafter_dir = make_tiny_dllm_drafter(base / "d", base / "t", seed=4, block_size=4, hidden_size=16, num_layers=1,
                                         num_heads=2, num_kv_heads=1, weight_std=0.5, mask_token_id=E2E_V - 1)
    target = load_target(base / "t", torch.float64, "cpu")
    return target, as_drafter(load_ar_drafter(drafter_dir, dtype=torch.float64))


#: whole generations on the hybrid (its reference Gated-DeltaNet kernels make a generation several times slower)
HYBRID_N = 500


@pytest.mark.slow
def test_rejection_on_a_hybrid_target_matches_the_exact_distribution(tiny_hybrid_pair):
    """DDTree (branching trees: the linear-attention layer runs branch by branch and is re-advanced over the accepted
    path) under the rejection rule on a hybrid target: the whole-generation outcomes follow the exact AR distribution
    (a seventh exactness claim: at most 7e-3 for the module). Fewer samples than the Qwen3 tests: it is there to
    catch a wrong recurrent state (it fails when the state is not re-advanced over the accepted path), whose
    distortion is large, not the small biases the Qwen3 tests are sized for."""
    target, drafter = tiny_hybrid_pair
    exact = _exact_generation(target)
    assert sum(p * HYBRID_N >= MIN_EXPECTED for p in exact.values()) >= 9  # the outcomes are spread
    counts: Counter = Counter()
    rounds = 0
    for seed in range(HYBRID_N):
        cfg = ARSpecConfig(method="ddtree", budget=2, accept="rejection", max_new_tokens=E2E_NEW,
                           sampling=SamplingConfig(temperature=1.0, seed=seed))
        res = speculative_generate(target, drafter, E2E_PROMPT, cfg)
        counts[tuple(res.tokens)] += 1
        rounds += res.rounds
    assert rounds < HYBRID_N * (E2E_NEW - 1)
    assert _pearson(counts, exact, HYBRID_N) >= ALPHA
