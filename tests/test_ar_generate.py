"""Lossless AR speculative decoding: DDTree == DFlash chain == AR, token for token (float64, tiny Qwen3 pair)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spiffy.ar import ARGenerationResult, ddtree_generate
from spiffy.ar.checkpoints import make_tiny_dflash, make_tiny_target
from spiffy.models import load_target
from spiffy.ar.drafter import DFlashDraftModel, load_drafter
from spiffy.ar.sampling import sample_tokens
from spiffy.errors import ConfigError

torch.set_num_threads(1)

BLOCK = 8
SAMPLING = [  # (temperature, top_p, top_k)
    (0.0, 1.0, 0),
    (1.0, 1.0, 0),
    (1.0, 0.8, 0),
    (1.0, 1.0, 5),
    (0.7, 0.9, 12),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ar_generate")
    target_dir = make_tiny_target(root / "target", seed=3, num_layers=3, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=4, num_layers=2, block_size=BLOCK)
    target = load_target(target_dir, torch.float64, "cpu")
    drafter = load_drafter(drafter_dir, dtype=torch.float64)
    return target, drafter, target_dir, root


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 250, (6,), generator=torch.Generator().manual_seed(11)).tolist()


class OracleDrafter(DFlashDraftModel):
    """The real drafter computation (context cache, features) with its logits replaced by a known continuation.

    Slot ``k`` of a block at position ``p`` predicts the continuation's token at position ``p + k``. With
    ``second_at`` the true token is ranked second (behind a wrong one) at those depths: the DFlash chain then
    stops there while DDTree, which also keeps runners-up, still reaches full depth. Records every call's context.
    """

    def __init__(self, base: DFlashDraftModel, continuation: list[int], n_prompt: int, second_at: tuple[int, ...] = ()):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.to(base.dtype)
        self.rotary_emb = base.rotary_emb
        self.continuation = list(continuation)
        self.n_prompt = n_prompt
        self.second_at = set(second_at)
        self.calls: list[tuple[torch.Tensor, list[int]]] = []
        self._block_positions: list[int] = []

    def forward(self, target_hidden, noise_embedding, position_ids, past_key_values=None, **kw):  # noqa: ANN001
        pos = position_ids.view(-1).tolist()
        n_ctx = target_hidden.shape[1]
        self.calls.append((target_hidden.clone(), pos[:n_ctx]))
        self._block_positions = pos[n_ctx:]
        out = super().forward(target_hidden, noise_embedding, position_ids, past_key_values=past_key_values, **kw)
        self.last_block = (noise_embedding.clone(), pos[n_ctx:], out.clone())
        return out

    def compute_logits(self, hidden, lm_head):  # noqa: ANN001
        real = super().compute_logits(hidden, lm_head)
        out = torch.full_like(real, -30.0)
        vocab = real.shape[-1]
        for depth, pos in enumerate(self._block_positions[1:], start=1):
            i = pos - self.n_prompt
            if 0 <= i < len(self.continuation):
                tok = self.continuation[i]
                if depth in self.second_at:
                    out[depth - 1, (tok + 1) % vocab] = 0.0
                    out[depth - 1, tok] = -1.0
                else:
                    out[depth - 1, tok] = 0.0
        return out


def _run(target, drafter, prompt, method, budget=16, n=20, sampling=(0.0, 1.0, 0), **kw) -> ARGenerationResult:
    t, p, k = sampling
    return ddtree_generate(
        target, drafter, prompt, method=method, budget=budget, max_new_tokens=n,
        temperature=t, top_p=p, top_k=k, seed=kw.pop("seed", 7), **kw,
    )


def test_ar_equals_transformers_greedy(pair, prompt):
    target, drafter, _, _ = pair
    ours = _run(target, None, prompt, "ar", n=20)
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert ours.tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("sampling", SAMPLING[1:3])
def test_ar_sampling_equals_cache_free_reference(pair, prompt, sampling):
    """Seeded AR through the tree code path == a full-recompute loop drawing position-keyed noise."""
    target, _, _, _ = pair
    t, p, k = sampling
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            logits = target(torch.tensor([seq])).logits[0, -1:]
            seq.append(int(sample_tokens(logits, [len(seq)], temperature=t, top_p=p, top_k=k, seed=7)[0]))
    assert _run(target, None, prompt, "ar", n=16, sampling=sampling).tokens == seq[len(prompt):]


@pytest.mark.parametrize("sampling", SAMPLING)
def test_methods_agree_with_random_drafter(pair, prompt, sampling):
    target, drafter, _, _ = pair
    ar = _run(target, drafter, prompt, "ar", sampling=sampling)
    assert len(ar.tokens) == 20
    for method, budget in [("dflash", 0), ("ddtree", 1), ("ddtree", 48)]:
        res = _run(target, drafter, prompt, method, budget=budget, sampling=sampling)
        assert res.tokens == ar.tokens, (method, budget)


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[1], SAMPLING[4]])
def test_oracle_drafter_accepts_full_depth(pair, prompt, sampling):
    target, drafter, _, _ = pair
    n = 29
    ar = _run(target, drafter, prompt, "ar", n=n + BLOCK, sampling=sampling)
    for method, budget in [("dflash", 0), ("ddtree", 8), ("ddtree", 40)]:
        oracle = OracleDrafter(drafter, ar.tokens, len(prompt))
        res = _run(target, oracle, prompt, method, budget=budget, n=n, sampling=sampling)
        assert res.tokens == ar.tokens[:n]
        # every round commits a whole block (or what is left of max_new_tokens)
        done = 1
        for committed in res.acceptance_lengths:
            assert committed == min(BLOCK, n - done), (method, budget, res.acceptance_lengths)
            done += committed
        assert res.rounds == -(-(n - 1) // BLOCK)
        assert res.tau == pytest.approx((n - 1) / res.rounds)


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[3]])
def test_tree_recovers_runner_up_tokens_that_stop_the_chain(pair, prompt, sampling):
    """True tokens ranked second at depths 2 and 5: the chain stops, DDTree accepts full blocks via side branches
    (accepted rows are not a prefix of the verified rows, so the K/V compaction is exercised)."""
    target, drafter, _, _ = pair
    n = 33
    ar = _run(target, drafter, prompt, "ar", n=n + BLOCK, sampling=sampling)
    chain = _run(target, OracleDrafter(drafter, ar.tokens, len(prompt), (2, 5)), prompt, "dflash", n=n, sampling=sampling)
    tree = _run(target, OracleDrafter(drafter, ar.tokens, len(prompt), (2, 5)), prompt, "ddtree", budget=32, n=n, sampling=sampling)
    assert chain.tokens == tree.tokens == ar.tokens[:n]
    assert max(chain.acceptance_lengths) == 2
    assert tree.acceptance_lengths[:-1] == [BLOCK] * (len(tree.acceptance_lengths) - 1)
    assert tree.tau > chain.tau


def test_drafter_context_is_features_of_committed_rows(pair, prompt):
    target, drafter, _, _ = pair
    n = 26
    ar = _run(target, drafter, prompt, "ar", n=n + BLOCK)
    oracle = OracleDrafter(drafter, ar.tokens, len(prompt), (3,))
    res = _run(target, oracle, prompt, "ddtree", budget=24, n=n)
    assert res.tokens == ar.tokens[:n]
    feats = torch.cat([f for f, _ in oracle.calls], dim=1)[0]
    positions = [p for _, ps in oracle.calls for p in ps]
    assert positions == list(range(len(positions)))  # every committed row exactly once, in order
    seq = torch.tensor([prompt + res.tokens])
    with torch.no_grad():
        hs = target(seq, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i + 1][0, : len(positions)] for i in oracle.target_layer_ids], dim=-1)
    assert torch.allclose(feats, expected, atol=1e-9)
    # the drafter's context cache holds exactly that context: its last draft equals one cache-free forward
    emb, block_pos, out = oracle.last_block
    fresh = drafter(feats.unsqueeze(0), emb, torch.tensor(positions + block_pos).view(1, -1))
    assert torch.allclose(out, fresh, atol=1e-9)


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[2]])
def test_stop_tokens_end_generation_exactly(pair, prompt, sampling):
    target, drafter, _, _ = pair
    ar_long = _run(target, drafter, prompt, "ar", n=40, sampling=sampling)
    # a token whose first occurrence lies mid-block
    idx = next(i for i in range(3, 40) if ar_long.tokens[i] not in ar_long.tokens[:i])
    stop = ar_long.tokens[idx]
    expected = ar_long.tokens[: idx + 1]
    for method, budget, oracle in [("ar", 0, False), ("dflash", 0, True), ("ddtree", 16, True), ("ddtree", 16, False)]:
        d = OracleDrafter(drafter, ar_long.tokens, len(prompt)) if oracle else drafter
        res = _run(target, d, prompt, method, budget=budget, n=40, sampling=sampling, stop_token_ids=[stop, 10_000])
        assert res.tokens == expected, method
        assert res.stopped
        assert sum(res.acceptance_lengths) + 1 == len(res.tokens)
    # the very first token can be the stop token
    first = _run(target, drafter, prompt, "ddtree", n=40, sampling=sampling, stop_token_ids=ar_long.tokens[0])
    assert first.tokens == ar_long.tokens[:1] and first.rounds == 0 and first.stopped


def test_max_new_tokens_is_never_exceeded(pair, prompt):
    target, drafter, _, _ = pair
    ar = _run(target, drafter, prompt, "ar", n=30)
    for n in (0, 1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3):
        for method in ("ar", "dflash", "ddtree"):
            d = OracleDrafter(drafter, ar.tokens, len(prompt)) if method != "ar" else None
            res = _run(target, d, prompt, method, n=n)
            assert res.tokens == ar.tokens[:n], (method, n)
            assert not res.stopped


def test_generated_mask_token_is_kept(pair, prompt, tmp_path):
    target, drafter, target_dir, _ = pair
    ar = _run(target, drafter, prompt, "ar", n=20)
    mask_id = ar.tokens[4]  # make the drafter's mask token one the target actually generates
    masked = load_drafter(make_tiny_dflash(tmp_path / "d", target_dir, seed=4, num_layers=2, block_size=BLOCK, mask_token_id=mask_id), dtype=torch.float64)
    assert masked.mask_token_id == mask_id
    for method in ("dflash", "ddtree"):
        res = _run(target, masked, prompt, method, n=20)
        assert res.tokens == ar.tokens and mask_id in res.tokens


def test_statistics_are_consistent(pair, prompt):
    target, drafter, _, _ = pair
    ar = _run(target, drafter, prompt, "ar", n=30)
    res = _run(target, OracleDrafter(drafter, ar.tokens, len(prompt), (4,)), prompt, "ddtree", budget=20, n=22)
    assert res.method == "ddtree" and res.budget == 20 and res.block_size == BLOCK
    assert res.num_prompt_tokens == len(prompt)
    assert res.rounds == len(res.acceptance_lengths) == len(res.nodes_per_round)
    assert sum(res.histogram) == res.rounds
    assert all(res.histogram[k] == res.acceptance_lengths.count(k) for k in range(len(res.histogram)))
    assert res.tau == pytest.approx(sum(res.acceptance_lengths) / res.rounds)
    assert max(res.nodes_per_round) <= 20
    assert set(res.stage_times) == {"draft", "tree_build", "compile", "verify", "commit"}
    assert all(v >= 0 for v in res.stage_times.values())
    assert res.seconds >= res.prefill_seconds >= 0 and res.time_per_output_token >= 0
    d = res.to_dict()
    assert d["tokens"] == res.tokens and d["tau"] == res.tau
    plain = _run(target, None, prompt, "ar", n=22)
    assert plain.rounds == 21 and plain.tau == 1.0 and set(plain.nodes_per_round) == {0}
    zero = _run(target, drafter, prompt, "ddtree", budget=0, n=22)  # budget 0: no drafts, plain AR cost
    assert zero.tokens == plain.tokens and set(zero.nodes_per_round) == {0} and zero.budget == 0


def test_input_forms_and_errors(pair, prompt):
    target, drafter, _, _ = pair
    base = _run(target, drafter, prompt, "ddtree", n=6).tokens
    assert _run(target, drafter, torch.tensor(prompt), "ddtree", n=6).tokens == base
    assert _run(target, drafter, torch.tensor([prompt]), "ddtree", n=6).tokens == base
    with pytest.raises(ConfigError, match="budget"):
        ddtree_generate(target, drafter, prompt, budget=-1)
    with pytest.raises(ConfigError, match="temperature"):
        ddtree_generate(target, drafter, prompt, temperature=-0.5)
    with pytest.raises(ConfigError, match="top_p"):
        ddtree_generate(target, drafter, prompt, temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="method"):
        ddtree_generate(target, drafter, prompt, method="beam")
    with pytest.raises(ConfigError, match="drafter"):
        ddtree_generate(target, None, prompt, method="ddtree")
    with pytest.raises(ConfigError, match="batch"):
        ddtree_generate(target, drafter, torch.tensor([prompt, prompt]))


def test_public_import():
    from spiffy.ar import ddtree_generate as a
    import spiffy

    assert spiffy.ddtree_generate is a


def test_h1_tiny_qwen3_fixture_if_available(request, tmp_path):
    """Same equality on the shared tiny Qwen3 checkpoint (tests/conftest.py), when that fixture exists."""
    try:
        target_dir = Path(request.getfixturevalue("tiny_qwen3"))
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py has no tiny_qwen3 fixture yet")
    target = load_target(target_dir, torch.float64, "cpu")
    drafter = load_drafter(make_tiny_dflash(tmp_path / "d", target_dir, seed=0, block_size=BLOCK), dtype=torch.float64)
    ids = [1, 2, 3, 4]
    for sampling in (SAMPLING[0], SAMPLING[1]):
        ar = _run(target, drafter, ids, "ar", n=12, sampling=sampling)
        tree = _run(target, drafter, ids, "ddtree", budget=16, n=12, sampling=sampling)
        oracle = _run(target, OracleDrafter(drafter, ar.tokens + [0] * BLOCK, len(ids)), ids, "ddtree", n=12, sampling=sampling)
        assert ar.tokens == tree.tokens == oracle.tokens
