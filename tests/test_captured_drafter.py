"""The DFlash drafter's block forward on the captured path (:mod:`spiffy.arspec.captured_drafter`).

On a CPU the static drafter's step runs eagerly with the static shapes a GPU captures (a context cache of slots with
a length per row, the block padded to its bucket, masks instead of shapes), so these tests check the code a GPU
replays against the eager drafter (the reference): every round's draft logits (to rounding: attention over a padded
key set sums in another order), and the tokens and acceptance lengths exactly, in float32 and float64, for DFlash and
DDTree at several budgets, greedy and sampled, coupled and rejection rules, single prompts and ragged batches.

Deep accepted paths need a drafter that agrees with the target: :func:`guessing` makes the real DFlash computation
(features, context cache, block forward) rank a known continuation's token first (or second, behind a wrong one, at
chosen positions), as tensor operations on the block's position ids, so the static step can run it too.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from captured_rounds import RecordedDrafts, assert_ragged_batch, prompt_ids
from spiffy.arspec import ARSpecConfig, SamplingConfig, ddtree_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured import static_target_of
from spiffy.arspec.captured_drafter import static_drafter_of
from spiffy.arspec.drafter import DFlashDrafter
from spiffy.bench.syncs import SyncCounter
from spiffy.models import load_target
from spiffy.models.ar_checkpoints import make_tiny_dflash, make_tiny_target
from spiffy.models.dflash import DFlashDraftModel, load_drafter

torch.set_num_threads(1)
BLOCK = 6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("captured_drafter")
    target_dir = make_tiny_target(root / "target", seed=3, num_layers=2, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=4, num_layers=2, block_size=BLOCK)
    return target_dir, drafter_dir


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["f32", "f64"])
def pair(dirs, request):
    return load_target(dirs[0], request.param, "cpu"), load_drafter(dirs[1], dtype=request.param)


_FORWARD, _LOGITS = DFlashDraftModel.forward, DFlashDraftModel.compute_logits


def _guessing_forward(self, target_hidden, noise_embedding, position_ids, *args, **kw):  # noqa: ANN001, ANN202
    if getattr(self, "guess", None) is not None:  # the block's positions, for compute_logits (no host read)
        self.block_positions, self.read_row = position_ids.view(-1, position_ids.shape[-1])[:, -noise_embedding.shape[1]:], 0
    return _FORWARD(self, target_hidden, noise_embedding, position_ids, *args, **kw)


def _guessing_logits(self, hidden, lm_head):  # noqa: ANN001, ANN202
    real = _LOGITS(self, hidden, lm_head)
    if getattr(self, "guess", None) is None:
        return real
    if hidden.dim() == 2:  # the eager drafter reads out one row at a time, in batch order
        pos = self.block_positions[self.read_row, 1 : 1 + hidden.shape[0]]
        self.read_row += 1
    else:  # the static drafter reads out every row at once
        pos = self.block_positions[:, 1 : 1 + hidden.shape[1]]
    vocab, size = int(real.shape[-1]), int(self.guess.numel())
    at = pos.clamp(0, size - 1)
    token, known = self.guess[at], (pos < size) & (self.guess[at] >= 0)
    second = known & self.second[at]
    hot = F.one_hot(token.clamp(min=0), vocab).to(real.dtype)
    wrong = F.one_hot((token.clamp(min=0) + 1) % vocab, vocab).to(real.dtype)
    weight = torch.where(second, 6.0, 8.0).to(real.dtype) * known
    return real * 0.1 + hot * weight.unsqueeze(-1) + wrong * (8.0 * second).to(real.dtype).unsqueeze(-1)


@pytest.fixture
def guessing(monkeypatch):
    """Make DFlash models with a ``guess`` table guess (the class's own methods, so rows still share a forward and
    the static drafter runs them); returns ``make(base, prompts, continuations, second)``."""
    monkeypatch.setattr(DFlashDraftModel, "forward", _guessing_forward)
    monkeypatch.setattr(DFlashDraftModel, "compute_logits", _guessing_logits)

    def make(base: DFlashDraftModel, prompts: list[list[int]], continuations: list[list[int]],
             second: set[int]) -> DFlashDraftModel:
        """A copy of ``base`` guessing row ``b``'s continuation at positions ``len(prompts[b]) + i`` (the rows'
        position ranges must not overlap) and putting it second at continuation indices ``second``."""
        model = DFlashDraftModel(base.config).to(base.dtype)
        model.load_state_dict(base.state_dict())
        model.rotary_emb = base.rotary_emb
        size = max(len(p) + len(c) for p, c in zip(prompts, continuations))
        model.guess = torch.full((size,), -1, dtype=torch.long)
        model.second = torch.zeros(size, dtype=torch.bool)
        for p, c in zip(prompts, continuations):
            assert (model.guess[len(p) : len(p) + len(c)] < 0).all(), "the rows' positions overlap"
            model.guess[len(p) : len(p) + len(c)] = torch.tensor(c)
            for i in second:
                if i < len(c):
                    model.second[len(p) + i] = True
        return model.eval()

    return make


@pytest.mark.parametrize("method,budget,temperature", [("dflash", None, 0.0), ("ddtree", 3, 0.0), ("ddtree", 8, 0.9),
                                                       ("ddtree", 24, 0.0), ("dflash", None, 0.7)])
def test_static_drafter_equals_eager(pair, guessing, monkeypatch, method, budget, temperature):
    """One prompt: the static drafter's drafts are the eager drafter's every round; tokens (== plain AR) and
    acceptance lengths are equal, with deep accepted paths and branching trees."""
    target, base = pair
    prompt, n, seed = prompt_ids(7, 9), 16, 5
    ar = ddtree_generate(target, None, prompt, method="ar", max_new_tokens=n, temperature=temperature, seed=seed)
    model = guessing(base, [prompt], [ar.tokens], {2, 7})
    drafts = RecordedDrafts(monkeypatch)
    kw = {"method": method, "budget": budget, "max_new_tokens": n, "temperature": temperature, "seed": seed}
    eager = ddtree_generate(target, model, prompt, compile=False, **kw)
    captured = ddtree_generate(target, model, prompt, compile=True, **kw)
    assert captured.tokens == eager.tokens == ar.tokens
    assert captured.acceptance_lengths == eager.acceptance_lengths and max(captured.acceptance_lengths) > 2
    drafts.assert_close(target.dtype)
    assert sum(static_drafter_of(model).graphs.stats.runs.values()) == len(drafts.static) - 1  # + the prompt's


@pytest.mark.parametrize("accept,temperature", [("coupled", 0.0), ("rejection", 0.9), ("coupled", 0.8)])
def test_static_drafter_batches(pair, guessing, monkeypatch, accept, temperature):
    """Ragged batches (prompts of different lengths, rows leaving at different rounds): the static drafter's rows
    draft what each eager row drafts, and give the eager rows' tokens and acceptance lengths."""
    target, base = pair
    prompts = [prompt_ids(1, 2), prompt_ids(2, 17), prompt_ids(3, 33)]  # positions 2.., 17.., 33..: disjoint guess tables
    lengths = [12, 6, 10]
    configs = [ARSpecConfig(method="ddtree", budget=6, max_new_tokens=m, accept=accept,
                            sampling=SamplingConfig(temperature=temperature, seed=s)) for m, s in zip(lengths, (1, 2, 3))]
    ars = [ddtree_generate(target, None, p, method="ar", max_new_tokens=m, temperature=temperature, seed=s).tokens
           for p, m, s in zip(prompts, lengths, (1, 2, 3))]
    model = guessing(base, prompts, ars, {3})
    drafts = RecordedDrafts(monkeypatch)
    eager = speculative_generate_batch(target, [DFlashDrafter(model, BLOCK) for _ in prompts], prompts, configs,
                                       compile=False)
    captured = speculative_generate_batch(target, [DFlashDrafter(model, BLOCK) for _ in prompts], prompts, configs,
                                          compile=True)
    assert_ragged_batch(eager, captured, lengths, ars, accept, drafts, static_drafter_of(model), target.dtype)


def test_static_drafter_buckets_are_reused(pair):
    """One static drafter per model: a second prompt and a second call replay the buckets the first one built (the
    last rounds' shorter blocks depend on how many drafts were accepted; a new one may be built)."""
    target, base = pair
    kw = {"method": "ddtree", "budget": 8, "max_new_tokens": 10, "compile": True}
    ddtree_generate(target, base, prompt_ids(5, 6), **kw)
    static = static_drafter_of(base)
    assert static is not None and static_target_of(target) is not None
    built = dict(static.graphs.stats.capture_seconds)
    runs = Counter(static.graphs.stats.runs)
    assert (1, BLOCK) in built and all(s >= 0 for s in built.values())
    ddtree_generate(target, base, prompt_ids(6, 11), **kw)
    assert static_drafter_of(base) is static
    after = static.graphs.stats.capture_seconds
    assert {k: after[k] for k in built} == built  # no bucket built again
    assert all(block < BLOCK for _rows, block in set(after) - set(built))  # at most a shorter last block is new
    assert static.graphs.stats.runs[(1, BLOCK)] > runs[(1, BLOCK)] > 1


def test_static_drafter_step_makes_no_host_sync(pair):
    """The drafter's block forward (a bucket's step: features in, logits out, the new context's K/V written) reads
    nothing back from the device and may run twice; nor does a whole draft stage read anything back (the roots and
    depths go down in one copy)."""
    target, base = pair
    ddtree_generate(target, base, prompt_ids(8, 5), method="ddtree", budget=8, max_new_tokens=8, compile=True)
    static = static_drafter_of(base)
    assert int(static.counts[0]) > 0  # the last round's context is staged
    lengths = static.lengths.clone()
    with torch.inference_mode():  # as generation runs it
        first = static.graphs.run((1, BLOCK)).clone()  # built: counted from here on
        with SyncCounter() as step_counter:
            logits = static.graphs.run((1, BLOCK))
    # idempotent (a capture's rehearsal runs the step twice): same logits, the lengths left to draft()
    assert torch.equal(first, logits) and torch.equal(static.lengths, lengths)
    with torch.inference_mode():
        with SyncCounter() as draft_counter:
            drafts = static.draft([(3, 40)], [BLOCK - 1])
    # "to_cpu": the forward's .to(device) of its inputs, a no-op on a CPU run (towards the GPU on a GPU)
    for counter in (step_counter, draft_counter):
        assert {k: v for k, v in counter.counts.items() if k != "to_cpu"} == {}, counter.counts
    assert logits.shape[:2] == (1, BLOCK - 1)
    assert drafts[0].shape[0] == BLOCK - 1


def test_other_drafters_keep_the_eager_drafter(pair, dirs):
    """A subclassed model (its own forward) keeps the eager drafter on the captured path, with the same tokens."""
    target, base = pair

    class Scaled(DFlashDraftModel):
        def compute_logits(self, hidden, lm_head):  # noqa: ANN001, ANN202
            return super().compute_logits(hidden, lm_head) * 2.0

    model = Scaled(base.config).to(base.dtype)
    model.load_state_dict(base.state_dict())
    model.rotary_emb = base.rotary_emb
    kw = {"method": "ddtree", "budget": 4, "max_new_tokens": 6}
    prompt = prompt_ids(2, 4)
    assert ddtree_generate(target, model, prompt, compile=True, **kw).tokens == ddtree_generate(
        target, model, prompt, compile=False, **kw).tokens
    assert static_drafter_of(model) is None
