"""The rejection (speculative-sampling) rule is exact in distribution: a statistical test on a tiny enumerable
vocabulary, for a sampled chain (DEER), a deterministic tree (DDTree) and K sampled drafts (SpecDiff-2), against the
exact AR distribution; and a deliberately biased self-selection (pick the draft by the verifier's expected streak,
then plain rejection sampling) that the same test catches.

Two levels:
* one round of the rule on a table-defined target (many samples, fast): the emitted tokens (accepted + bonus),
  continued by plain AR sampling to a fixed length, must be distributed as AR sampling;
* whole generations through :func:`spiffy.arspec.speculative_generate` with a tiny Qwen3 target and a tiny SDAR
  drafter (fewer samples).
Every seed is fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

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


def _make_tree(kind: str, probs: torch.Tensor, sampling: SamplingConfig) -> DraftTree:
    if kind == "chain":
        return build_sampled_tree(probs, sample_drafts(probs, 1, sampling, len(ROOT) - 1))
    if kind == "tree":
        return build_ddtree(torch.log(probs), 6)
    return build_sampled_tree(probs, sample_drafts(probs, 4, sampling, len(ROOT) - 1))


def _chi_square_z(counts: Counter, exact: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's chi-square over bins with expected count >= 5 (the rest pooled), as a Wilson-Hilferty z-score
    (about N(0, 1) when the samples follow ``exact``)."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for seq, prob in exact.items():
        expected = n * prob
        if expected < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    k = 2.0 / (9.0 * dof)
    return ((stat / dof) ** (1 / 3) - (1 - k)) / math.sqrt(k)


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


@pytest.fixture(scope="module")
def exact_round():
    return _exact(ROOT, LENGTH)


@pytest.mark.parametrize("kind", ["chain", "tree", "specdiff"])
def test_rejection_round_matches_the_exact_distribution(kind, exact_round):
    counts = _round_samples(kind, RejectionRule, N_ROUND)
    z = _chi_square_z(counts, exact_round, N_ROUND)
    assert z < 4.0, (kind, z)


def test_biased_self_selection_is_caught(exact_round):
    counts = _round_samples("specdiff", BiasedSelfSelectRule, N_ROUND)
    z = _chi_square_z(counts, exact_round, N_ROUND)
    assert z > 6.0, z  # far outside what exact sampling gives (|z| < 4 above)


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
    assert _chi_square_z(counts, exact, E2E_N) < 4.0
