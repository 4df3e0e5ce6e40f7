"""Batched AR speculative decoding: row b of a batch equals prompt b decoded alone (float64, tiny Qwen3 pair).

Ragged prompts (left padding), per-row seeds, per-row stop tokens / limits (rows leaving the batch at different
rounds), and oracle drafters that accept different amounts per row, through side branches of the DDTree tree (so
the per-row K/V compaction moves rows that are not a prefix of the verified window).
"""

from __future__ import annotations

import pytest
import torch

from spiffy.arspec import ARSpecConfig, DFlashDrafter, SamplingConfig, ddtree_generate, speculative_generate
from spiffy.arspec.batch import ddtree_generate_batch, speculative_generate_batch
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.models.dflash import DFlashDraftModel
from spiffy.verify import compile_tree, compile_tree_rows

torch.set_num_threads(1)

BLOCK = 6
SAMPLINGS = [(0.0, 1.0, 0), (1.0, 1.0, 5)]  # (temperature, top_p, top_k)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("arspec_batch")
    target_dir = make_tiny_target(root / "target", seed=3, num_layers=2, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=4, num_layers=1, block_size=BLOCK)
    return load_target(target_dir, torch.float64, "cpu"), load_drafter(drafter_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (6, 2, 9, 4)]


class Oracle(DFlashDraftModel):
    """The real DFlash computation (features, cache) with logits replaced by a known continuation; at the depths in
    ``second_at`` the true token is ranked second. Records the target features of every call."""

    def __init__(self, base: DFlashDraftModel, continuation: list[int], n_prompt: int, second_at: tuple[int, ...]):
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.to(base.dtype)
        self.rotary_emb = base.rotary_emb
        self.continuation, self.n_prompt, self.second_at = list(continuation), n_prompt, set(second_at)
        self.features: list[torch.Tensor] = []
        self._block_positions: list[int] = []

    def forward(self, target_hidden, noise_embedding, position_ids, past_key_values=None, **kw):  # noqa: ANN001
        self.features.append(target_hidden.clone())
        self._block_positions = position_ids.view(-1).tolist()[target_hidden.shape[1]:]
        return super().forward(target_hidden, noise_embedding, position_ids, past_key_values=past_key_values, **kw)

    def compute_logits(self, hidden, lm_head):  # noqa: ANN001
        real = super().compute_logits(hidden, lm_head)
        out = torch.full_like(real, -30.0)
        for depth, pos in enumerate(self._block_positions[1:], start=1):
            i = pos - self.n_prompt
            if 0 <= i < len(self.continuation):
                tok = self.continuation[i]
                out[depth - 1, (tok + 1) % real.shape[-1] if depth in self.second_at else tok] = 0.0
                if depth in self.second_at:
                    out[depth - 1, tok] = -1.0
        return out


def _config(method: str, n: int, sampling: tuple, seed: int, stop: tuple[int, ...] = ()) -> ARSpecConfig:
    t, p, k = sampling
    return ARSpecConfig(method=method, budget=24, max_new_tokens=n, stop_token_ids=stop,
                        sampling=SamplingConfig(temperature=t, top_p=p, top_k=k, seed=seed))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_batch_rows_equal_single_prompts(pair, prompts, method, sampling):
    """Real (random) drafter: every row equals its solo run, rounds and acceptance included."""
    target, drafter = pair
    seeds = [7, 8, 9, 10]
    t, p, k = sampling
    solo = [ddtree_generate(target, drafter, pr, method=method, budget=24, max_new_tokens=14, temperature=t, top_p=p,
                            top_k=k, seed=s) for pr, s in zip(prompts, seeds)]
    batch = ddtree_generate_batch(target, drafter, prompts, method=method, budget=24, max_new_tokens=14,
                                  temperature=t, top_p=p, top_k=k, seed=seeds)
    assert [len(r.tokens) for r in batch] == [14] * 4
    for a, b in zip(solo, batch):
        assert b.tokens == a.tokens
        assert b.acceptance_lengths == a.acceptance_lengths and b.nodes_per_round == a.nodes_per_round
    if sampling[0] > 0:  # per-row seeds matter: seed 7 on every row gives other tokens somewhere
        same_seed = ddtree_generate_batch(target, drafter, prompts, method=method, budget=24, max_new_tokens=14,
                                          temperature=t, top_p=p, top_k=k, seed=7)
        assert [r.tokens for r in same_seed] != [r.tokens for r in batch]


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_rows_accept_and_finish_differently(pair, prompts, method, sampling):
    """Oracle drafters: rows accept different lengths (side branches for DDTree), stop on their own stop token or
    limit, and each drafter is fed exactly its own row's target features."""
    target, drafter = pair
    seeds = [3, 4, 5, 6]
    limits = [23, 9, 17, 30]
    misses = [(2, 4), (), (3,), (1, 5)]
    ref = [ddtree_generate(target, None, pr, method="ar", max_new_tokens=40, temperature=sampling[0],
                           top_p=sampling[1], top_k=sampling[2], seed=s).tokens for pr, s in zip(prompts, seeds)]
    stops = [(ref[0][12],), (), (), ()]  # row 0 ends on a stop token (at its first occurrence)
    configs = [_config(method, n, sampling, s, st) for n, s, st in zip(limits, seeds, stops)]
    solo_models = [Oracle(drafter, r, len(pr), m) for r, pr, m in zip(ref, prompts, misses)]
    batch_models = [Oracle(drafter, r, len(pr), m) for r, pr, m in zip(ref, prompts, misses)]
    solo = [speculative_generate(target, DFlashDrafter(m), pr, c) for m, pr, c in zip(solo_models, prompts, configs)]
    batch = speculative_generate_batch(target, [DFlashDrafter(m) for m in batch_models], prompts, configs)
    first_stop = ref[0].index(ref[0][12]) + 1
    assert [len(r.tokens) for r in batch] == [first_stop, 9, 17, 30]
    assert batch[0].stopped and not batch[1].stopped
    for b, (a, r) in enumerate(zip(solo, batch)):
        assert r.tokens == a.tokens == ref[b][: len(r.tokens)]
        assert r.acceptance_lengths == a.acceptance_lengths
    assert len({tuple(r.acceptance_lengths) for r in batch}) == 4  # rows really committed different amounts
    assert max(max(r.acceptance_lengths) for r in batch) == BLOCK
    for sm, bm in zip(solo_models, batch_models):
        assert len(sm.features) == len(bm.features)
        for fs, fb in zip(sm.features, bm.features):
            torch.testing.assert_close(fb, fs, rtol=1e-9, atol=1e-9)


def test_compile_tree_rows_matches_compile_tree():
    parents = [torch.tensor([-1, 0, 0, 1]), torch.tensor([-1]), torch.tensor([], dtype=torch.long)]
    trees = [(torch.arange(len(p)) + 10 * b, torch.arange(len(p)) + 5, p) for b, p in enumerate(parents)]
    pre = [(torch.tensor([b]), torch.tensor([4])) for b in range(3)]
    ctx = torch.tensor([[True, True, False], [False, True, True], [True, False, True]])
    compiled, rows = compile_tree_rows(trees, pre, ctx, dtype=torch.float64)
    assert rows == [5, 2, 1] and tuple(compiled.attention_mask.shape) == (3, 1, 5, 8)
    for b, ((tok, pos, par), p) in enumerate(zip(trees, pre)):
        one = compile_tree(tok, pos, par, 3, dtype=torch.float64, prefix_rows=p)
        r = rows[b]
        assert torch.equal(compiled.input_ids[b, :r], one.input_ids[0])
        assert torch.equal(compiled.position_ids[b, :r], one.position_ids[0])
        visible = compiled.attention_mask[b, 0] == 0
        assert torch.equal(visible[:r, 3 : 3 + r], one.attention_mask[0, 0, :, 3:] == 0)
        assert torch.equal(visible[:r, :3], ctx[b].expand(r, 3))
        assert not visible[:r, 3 + r :].any()  # never another row's padding
        assert torch.equal(visible[r:, 3:], torch.eye(5, dtype=torch.bool)[r:])  # padding sees only itself


def test_batch_errors(pair, prompts):
    target, drafter = pair
    with pytest.raises(ConfigError):
        ddtree_generate_batch(target, drafter, [], method="ddtree")
    with pytest.raises(ConfigError):
        ddtree_generate_batch(target, drafter, [[1, 2], []], method="ddtree")
    with pytest.raises(ConfigError):
        ddtree_generate_batch(target, drafter, prompts, seed=[1, 2])
    with pytest.raises(ConfigError):
        ddtree_generate_batch(target, None, prompts, method="dflash")
    shared = DFlashDrafter(drafter)
    with pytest.raises(ConfigError):
        speculative_generate_batch(target, [shared, shared], prompts[:2], ARSpecConfig(method="dflash"))
    out = ddtree_generate_batch(target, None, prompts[:2], method="ar", max_new_tokens=0)
    assert [r.tokens for r in out] == [[], []]


@pytest.mark.parametrize("seed", range(4))
def test_compile_one_host_tree_equals_the_staged_layout(seed, monkeypatch):
    """A batch of one host tree takes its own short path (bit-set rows for small trees, a NumPy walk for large
    ones; a whole fill or a broadcast row of cached columns); it lays out exactly what the staged path (forced here
    through a batch of two, second row dropped) lays out: random trees, prefixes and cached-column visibility. The
    AR round's entry (depths below the root, :func:`compile_round`) gives the same inputs."""
    import spiffy.verify.backend as backend
    from spiffy.arspec.stages import RoundBuffers, compile_round
    from spiffy.arspec.tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    for n, n_pre in ((0, 1), (1, 1), (7, 2), (40, 1), (60, 0), (250, 1)):
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)], dtype=torch.long)
        depths = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(parents.tolist()):
            depths[i] = 1 if p < 0 else int(depths[p]) + 1
        tree = (torch.randint(0, 99, (n,), generator=g), depths + 7, parents)
        pre = (torch.tensor([3] * n_pre), torch.tensor([7] * n_pre))
        ctx = torch.rand(1, 6, generator=g) < 0.7
        one, rows = compile_tree_rows([tree], [pre], ctx, dtype=torch.float32)
        spy = []
        monkeypatch.setattr(backend, "compile_one_host_tree", lambda *a: spy.append(a))
        two, rows2 = compile_tree_rows([tree, tree], [pre, pre], ctx.expand(2, 6), dtype=torch.float32)
        monkeypatch.undo()
        assert not spy and rows == rows2[:1] == [n_pre + n]
        assert torch.equal(one.input_ids, two.input_ids[:1]) and torch.equal(one.position_ids, two.position_ids[:1])
        assert torch.equal(one.attention_mask, two.attention_mask[:1])
        if n_pre == 1:
            draft = DraftTree(tree[0], parents, depths, torch.zeros(n, dtype=torch.float64))
            staged, _ = compile_round([draft], [(3, 7)], ctx, torch.float32, RoundBuffers.allocate(1, 1 + n))
            assert torch.equal(staged.input_ids, one.input_ids) and torch.equal(staged.position_ids, one.position_ids)
            assert torch.equal(staged.attention_mask, one.attention_mask)


@pytest.mark.parametrize("seed", range(3))
def test_mask_workspace_rounds_equal_fresh_masks(seed):
    """A generation's batch-of-one masks written into one workspace (only the columns that changed since the last
    round) equal masks compiled fresh, round after round: the context growing by uneven commits, trees of every
    size (both visibility builders), now and then a hidden cached column (holes), float32 and bfloat16."""
    from spiffy.verify.host_tree import MaskWorkspace, compile_one_host_tree

    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        workspace = MaskWorkspace()
        context = int(torch.randint(1, 20, (1,), generator=g))
        for _round in range(12):
            n = int(torch.randint(0, 260 if _round % 4 == 3 else 40, (1,), generator=g))
            parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
            depths = []
            for p in parents:
                depths.append(1 if p < 0 else depths[p] + 1)
            tree = (torch.randint(0, 99, (n,), generator=g), torch.tensor(depths, dtype=torch.long),
                    torch.tensor(parents, dtype=torch.long))
            visible = torch.ones(1, context, dtype=torch.bool)
            if _round % 5 == 4:
                visible[0, int(torch.randint(0, context, (1,), generator=g))] = False
            fresh = compile_one_host_tree(tree, ([5], [context]), visible, dtype, position_offset=context)
            reused = compile_one_host_tree(tree, ([5], [context]), visible, dtype, position_offset=context,
                                           workspace=workspace)
            assert all(torch.equal(a, b) for a, b in zip(fresh, reused)), (dtype, _round, n)
            context += int(torch.randint(1, 1 + min(n, 8) + 1, (1,), generator=g))  # the root and a few accepted
