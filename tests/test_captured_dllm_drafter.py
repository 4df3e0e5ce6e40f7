"""The dLLM drafter's round forward on the captured path (:mod:`spiffy.arspec.captured_dllm_drafter`).

On a CPU the static drafter's step runs eagerly with the static shapes a GPU captures (a context cache of slots with
a length per row, the committed tokens and the block padded to their bucket, masks instead of shapes), so these tests
check the code a GPU replays against the eager :class:`~spiffy.arspec.dllm_drafter.DLLMDrafter` (the reference):
every round's draft logits (to rounding: attention over a padded key set sums in another order), and the tokens and
acceptance lengths exactly, in float32 and float64, for DEER, SpecDiff-2 and DDTree-dLLM, greedy and sampled,
coupled and rejection rules, single prompts and ragged batches.

Deep accepted paths need a drafter that agrees with the target: :func:`guessing` makes the real dLLM forward (cache,
masks, positions) rank a known continuation's token first (or second, behind a wrong one, at chosen positions), as
tensor operations on the forward's position ids, so the static step runs it too.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from captured_rounds import RecordedDrafts, assert_ragged_batch, captured_round_syncs, prompt_ids, rejection_round_syncs
from spiffy.arspec import ARSpecConfig, SamplingConfig, ddtree_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured_dllm_drafter import static_dllm_drafter_model, static_dllm_drafter_of
from spiffy.arspec.dllm_drafter import DLLMDrafter
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import trace_steps
from spiffy.models import load_target, make_tiny_target, moe_dispatch
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.sdar import SDARForCausalLM

torch.set_num_threads(1)
BLOCK = 6
METHODS = ("deer", "specdiff", "ddtree-dllm")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("captured_dllm_drafter")
    target_dir = make_tiny_target(root / "target", seed=5, num_layers=2)
    return target_dir, make_tiny_dllm_drafter(root / "dllm", target_dir, seed=1, block_size=BLOCK)


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["f32", "f64"])
def pair(dirs, request):
    return load_target(dirs[0], request.param, "cpu"), load_ar_drafter(dirs[1], dtype=request.param)


_FORWARD = SDARForCausalLM.forward


def _guessing_forward(self, input_ids, *args, position_ids=None, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
    out = _FORWARD(self, input_ids, *args, position_ids=position_ids, **kw)
    if getattr(self, "guess", None) is None:
        return out
    real = out.logits  # SDAR is unshifted: the row at position p predicts the token at p
    pos = position_ids.expand(real.shape[0], -1)
    vocab, size = int(real.shape[-1]), int(self.guess.numel())
    at = pos.clamp(0, size - 1)
    token, known = self.guess[at], (pos < size) & (self.guess[at] >= 0)
    second = known & self.second[at]
    hot = F.one_hot(token.clamp(min=0), vocab).to(real.dtype)
    wrong = F.one_hot((token.clamp(min=0) + 1) % vocab, vocab).to(real.dtype)
    weight = torch.where(second, 6.0, 8.0).to(real.dtype) * known
    out.logits = real * 0.1 + hot * weight.unsqueeze(-1) + wrong * (8.0 * second).to(real.dtype).unsqueeze(-1)
    return out


@pytest.fixture
def guessing(monkeypatch):
    """Make SDAR models with a ``guess`` table guess (the class's own forward, so rows still share a forward and the
    static drafter runs it); returns ``make(base, prompts, continuations, second)``."""
    monkeypatch.setattr(SDARForCausalLM, "forward", _guessing_forward)

    def make(base: SDARForCausalLM, prompts: list[list[int]], continuations: list[list[int]],
             second: set[int]) -> SDARForCausalLM:
        """A copy of ``base`` guessing row ``b``'s continuation at positions ``len(prompts[b]) + i`` (the rows'
        position ranges must not overlap) and putting it second at continuation indices ``second``."""
        model = SDARForCausalLM(base.config).to(base.dtype)
        model.load_state_dict(base.state_dict())
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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("accept,temperature", [("coupled", 0.0), ("coupled", 0.8), ("rejection", 0.9)])
def test_static_dllm_drafter_equals_eager(pair, guessing, monkeypatch, method, accept, temperature):
    """One prompt: the static drafter's drafts are the eager drafter's every round; tokens (== plain AR under the
    coupled rule) and acceptance lengths are equal, with deep accepted paths and branching trees."""
    _one_prompt(pair, guessing, monkeypatch, lambda m: m, method, accept, temperature)


def _one_prompt(pair: Any, guessing: Any, monkeypatch: pytest.MonkeyPatch, variant: Any, method: str, accept: str,
                temperature: float, steps: int = 1) -> Any:
    """Decode one prompt eagerly and captured with ``variant(base)`` guessing AR's continuation (``steps``
    denoising steps): the drafts equal every round (to rounding), the tokens and acceptance lengths exactly (under
    the coupled rule AR's, with deep accepted paths), one bucket replay per round. Returns the static drafter."""
    target, base = pair
    prompt, n, seed = prompt_ids(4, 7), 18, 6
    ar = ddtree_generate(target, None, prompt, method="ar", max_new_tokens=n, temperature=temperature, seed=seed)
    model = guessing(variant(base), [prompt], [ar.tokens], {2, 9})
    drafts = RecordedDrafts(monkeypatch)
    config = ARSpecConfig(method=method, budget=6, drafts=3, max_new_tokens=n, accept=accept,
                          sampling=SamplingConfig(temperature=temperature, seed=seed))
    eager, captured = [speculative_generate_batch(target, [DLLMDrafter(model, denoise_steps=steps)], [prompt], config,
                                                  compile=c)[0] for c in (False, True)]
    assert captured.tokens == eager.tokens
    assert captured.acceptance_lengths == eager.acceptance_lengths
    if accept == "coupled":
        assert captured.tokens == ar.tokens and max(captured.acceptance_lengths) > 2
    drafts.assert_close(target.dtype)
    static = static_dllm_drafter_of(model)
    assert static is not None
    assert sum(static.graphs.stats.runs.values()) == len(drafts.static) - 1  # + the prompt's
    return static


@pytest.mark.parametrize("attention_block", [0, 5], ids=["root", "aligned"])
@pytest.mark.parametrize("accept,temperature", [("coupled", 0.0), ("rejection", 0.9), ("coupled", 0.8)])
def test_static_dllm_drafter_batches(pair, guessing, monkeypatch, accept, temperature, attention_block):
    """Ragged batches (prompts of different lengths, rows leaving at different rounds, a method per row), in the
    root layout and the aligned one (the rows' roots at different offsets in their attention blocks): the static
    drafter's rows draft what each eager row drafts, and give the eager rows' tokens and acceptance lengths."""
    target, base = pair
    prompts = [prompt_ids(1, 2), prompt_ids(2, 17), prompt_ids(3, 33)]  # positions 2.., 17.., 33..: disjoint guess tables
    lengths, seeds = [12, 6, 10], (1, 2, 3)
    configs = [ARSpecConfig(method=m, budget=6, drafts=3, max_new_tokens=n, accept=accept,
                            sampling=SamplingConfig(temperature=temperature, seed=s))
               for m, n, s in zip(METHODS, lengths, seeds)]
    ars = [ddtree_generate(target, None, p, method="ar", max_new_tokens=n, temperature=temperature, seed=s).tokens
           for p, n, s in zip(prompts, lengths, seeds)]
    model = guessing(_aligned(base, attention_block) if attention_block else base, prompts, ars, {3})
    drafts = RecordedDrafts(monkeypatch)
    eager = speculative_generate_batch(target, [DLLMDrafter(model) for _ in prompts], prompts, configs,
                                       compile=False)
    captured = speculative_generate_batch(target, [DLLMDrafter(model) for _ in prompts], prompts, configs,
                                          compile=True)
    assert_ragged_batch(eager, captured, lengths, ars, accept, drafts, static_dllm_drafter_of(model), target.dtype)


def test_static_dllm_drafter_buckets_are_reused(pair):
    """One static drafter per model: a second prompt and a second call replay the buckets the first one built (the
    last rounds' shorter blocks depend on how many drafts were accepted; a new one may be built)."""
    target, base = pair
    kw = {"method": "ddtree-dllm", "budget": 8, "max_new_tokens": 10, "compile": True}
    ddtree_generate(target, base, prompt_ids(5, 6), **kw)
    static = static_dllm_drafter_of(base)
    assert static is not None
    built = dict(static.graphs.stats.capture_seconds)
    runs = Counter(static.graphs.stats.runs)
    assert (1, BLOCK) in built and all(s >= 0 for s in built.values())
    ddtree_generate(target, base, prompt_ids(6, 11), **kw)
    ddtree_generate(target, base, prompt_ids(6, 11), method="deer", max_new_tokens=10, compile=True)
    assert static_dllm_drafter_of(base) is static
    after = static.graphs.stats.capture_seconds
    assert {k: after[k] for k in built} == built  # no bucket built again
    assert all(block < BLOCK for _rows, block in set(after) - set(built))  # at most a shorter last block is new
    assert static.graphs.stats.runs[(1, BLOCK)] > runs[(1, BLOCK)] > 1


def test_static_dllm_drafter_step_makes_no_host_sync(pair):
    """The drafter's forward (a bucket's step: tokens in, logits out, the committed K/V written) reads nothing back
    from the device and may run twice; nor does a whole draft stage."""
    target, base = pair
    ddtree_generate(target, base, prompt_ids(8, 5), method="ddtree-dllm", budget=8, max_new_tokens=8, compile=True)
    static = static_dllm_drafter_of(base)
    assert int(static.counts[0]) > 0  # the last round's tokens are staged
    lengths = static.lengths.clone()
    with torch.inference_mode():  # as generation runs it
        first = static.graphs.run((1, BLOCK)).clone()
        with SyncCounter() as step_counter:
            logits = static.graphs.run((1, BLOCK))
    # idempotent (a capture's rehearsal runs the step twice): same logits, the lengths left to draft()
    assert torch.equal(first, logits) and torch.equal(static.lengths, lengths)
    with torch.inference_mode():
        with SyncCounter() as draft_counter:
            drafts = static.draft([(3, 40)], [BLOCK - 1])
    for counter in (step_counter, draft_counter):
        assert {k: v for k, v in counter.counts.items() if k != "to_cpu"} == {}, counter.counts
    assert logits.shape[:2] == (1, BLOCK - 1) and drafts[0].shape[0] == BLOCK - 1


@pytest.mark.parametrize("budget", [1, 8, 64])
def test_ddtree_dllm_round_syncs_at_most_twice(pair, budget):
    """A captured DDTree-dLLM round outside the forwards (the static drafter's inputs and readout, tree build, mask,
    walk, commit, the drafter's next tokens) reads the device at most twice (issue 36)."""
    target, base = pair
    res, per_round = captured_round_syncs(target, base, lambda: ddtree_generate(
        target, base, prompt_ids(9, 8), method="ddtree-dllm", budget=budget, max_new_tokens=12, compile=True))
    assert len(res.tokens) == 12 and len(per_round) == res.rounds
    assert static_dllm_drafter_of(base) is not None  # the draft stage counted is the static drafter's
    assert max(per_round) <= 2, per_round


def test_aligned_layout_round_syncs_at_most_twice(pair):
    """In the aligned layout too, a captured DDTree-dLLM round reads the device at most twice (the cache's advance
    to the root's attention block is computed on the device)."""
    target, _ = pair
    model = _aligned(pair[1], 4)
    res, per_round = captured_round_syncs(target, model, lambda: ddtree_generate(
        target, model, prompt_ids(9, 8), method="ddtree-dllm", budget=8, max_new_tokens=12, compile=True))
    assert len(res.tokens) == 12 and len(per_round) == res.rounds
    assert static_dllm_drafter_of(model) is not None and static_dllm_drafter_of(model).aligned == 4
    assert max(per_round) <= 2, per_round


@pytest.mark.parametrize("method", ["deer", "specdiff"])
def test_sampled_rejection_round_syncs_at_most_twice(pair, method):
    """DEER's chain and SpecDiff-2's drafts sampled from the drafter, merged into a tree and walked by the rejection
    rule at T > 0, all on the device: a round reads the device at most twice (issue 36)."""
    target, base = pair
    per_round = rejection_round_syncs(target, base, prompt_ids(9, 8), method, drafts=3)
    assert max(per_round) <= 2, per_round


def _aligned(model: SDARForCausalLM, attention_block: int) -> SDARForCausalLM:
    """A copy of ``model`` drafting in the ``"aligned"`` layout with SDAR blocks of ``attention_block`` positions."""
    out = copy.deepcopy(model)
    out.config.drafter_config = {**out.config.drafter_config, "layout": "aligned", "attention_block": attention_block}
    return out


@pytest.mark.parametrize("attention_block", [4, 8])
@pytest.mark.parametrize("method,accept,temperature", [("deer", "coupled", 0.0), ("ddtree-dllm", "coupled", 0.8),
                                                       ("specdiff", "rejection", 0.9)])
def test_aligned_layout_drafts_what_the_eager_drafter_drafts(pair, guessing, monkeypatch, attention_block, method,
                                                              accept, temperature):
    """The ``"aligned"`` layout (a plain SDAR checkpoint's: the cache holds complete attention blocks, the rest of
    the root's block runs again every round, block-causal over positions): the static drafter's drafts are the
    eager drafter's every round, tokens and acceptance lengths equal, with attention blocks shorter and longer than
    the drafted block."""
    static = _one_prompt(pair, guessing, monkeypatch, lambda m: _aligned(m, attention_block), method, accept,
                         temperature)
    assert static.aligned == attention_block


@pytest.mark.parametrize("steps,attention_block", [(2, 0), (3, 0), (3, 4), pytest.param(5, 3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("method,accept,temperature", [("ddtree-dllm", "coupled", 0.0), ("deer", "rejection", 0.9),
                                                       ("specdiff", "coupled", 0.8)])
def test_denoising_steps_draft_what_the_eager_drafter_drafts(pair, guessing, monkeypatch, steps, attention_block,
                                                             method, accept, temperature):
    """``denoise_steps > 1`` (each step fixes the most confident positions and re-runs the block on the cache): the
    static drafter's steps on the device draft what the eager drafter's host loop drafts, every round, in the root
    and the aligned layouts, with the eager tokens and acceptance lengths."""
    static = _one_prompt(pair, guessing, monkeypatch, lambda m: _aligned(m, attention_block) if attention_block else m,
                         method, accept, temperature, steps)
    assert static.denoise_steps == steps and static.aligned == attention_block


def test_other_drafters_keep_the_eager_drafter(pair, dirs):
    """A subclassed drafter keeps the eager drafter on the captured path (the static drafter is not made), with the
    eager path's tokens."""
    target, base = pair
    other = load_ar_drafter(dirs[1], dtype=base.dtype)

    class Sub(DLLMDrafter):
        pass

    prompt = prompt_ids(2, 4)
    assert static_dllm_drafter_model([Sub(other)], target) is None
    config = ARSpecConfig(method="deer", max_new_tokens=6)
    runs = [speculative_generate_batch(target, [Sub(other)], [prompt], config, compile=c)[0].tokens
            for c in (True, False)]
    assert runs[0] == runs[1]
    assert static_dllm_drafter_of(other) is None
    # rows of two models or of two step counts, or a model shared with rows without a drafter, keep the eager
    # drafters too
    assert static_dllm_drafter_model([DLLMDrafter(base), DLLMDrafter(other)], target) is None
    assert static_dllm_drafter_model([DLLMDrafter(base), DLLMDrafter(base, denoise_steps=2)], target) is None
    aligned = _aligned(base, 4)
    assert static_dllm_drafter_model([DLLMDrafter(aligned), DLLMDrafter(aligned)], target) is aligned
    assert static_dllm_drafter_model([DLLMDrafter(base), None], target) is None
    assert static_dllm_drafter_model([DLLMDrafter(base), DLLMDrafter(base)], target) is base


@pytest.mark.parametrize("family,dtype", [("dream", torch.float64), ("llada", torch.float64),
                                          ("llada_moe", torch.float64), ("llada_moe", torch.float32),
                                          ("sdar_moe", torch.float32), ("llada2", torch.float32)])
def test_other_families_draft_what_the_eager_drafter_drafts(family, dtype, request, tmp_path, monkeypatch):
    """Dream (shifted: the row before a position predicts it), LLaDA and the MoE families (SDAR-MoE and LLaDA2.0 in
    their plain checkpoints' aligned layout; float32 experts grouped in the step, float64 ones one by one): every
    round's drafts of a ragged batch are the eager drafters', and the tokens and acceptance lengths equal."""
    path = request.getfixturevalue(f"tiny_{family}")
    model = load_ar_drafter(path, dtype=dtype)
    target_dir = make_tiny_target(tmp_path / "target", seed=3, num_layers=2, vocab_size=int(model.config.vocab_size),
                                  with_tokenizer=False)
    target = load_target(target_dir, dtype, "cpu")
    grouped: list[int] = []  # expert calls that ran grouped (static shapes)
    real = moe_dispatch._grouped
    monkeypatch.setattr(moe_dispatch, "_grouped", lambda *a: grouped.append(1) or real(*a))
    assert DLLMDrafter(model).shifted == (family == "dream")
    assert DLLMDrafter(model).layout == ("aligned" if family in ("sdar_moe", "llada2") else "root")
    prompts = [[t % int(model.config.vocab_size) for t in prompt_ids(i, n)] for i, n in ((1, 5), (2, 3), (3, 9))]
    config = ARSpecConfig(method="ddtree-dllm", budget=6, max_new_tokens=8,
                          sampling=SamplingConfig(temperature=0.7, seed=4))
    drafts = RecordedDrafts(monkeypatch)
    runs = []
    for compile_ in (False, True):
        grouped.clear()
        runs.append(speculative_generate_batch(target, [DLLMDrafter(model) for _ in prompts], prompts, config,
                                               compile=compile_))
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert [r.acceptance_lengths for r in runs[0]] == [r.acceptance_lengths for r in runs[1]]
    drafts.assert_close(dtype)
    assert static_dllm_drafter_of(model) is not None
    # the static drafter's MoE experts ran grouped where torch._grouped_mm takes the dtype (the eager ones never)
    assert bool(grouped) == (family.endswith(("_moe", "2")) and dtype == torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada_moe", "sdar_moe"])
def test_moe_drafter_step_traces_as_one_graph(family, request, tmp_path):
    """An MoE drafter's step (its experts grouped, in bfloat16: the dtype a CUDA graph's grouped products take) is
    one graph for TorchDynamo: no host read, no data-dependent shape (:func:`spiffy.capture.trace_steps`), and it
    gives the eager tokens (greedy, coupled: the target's own, whatever the drafts)."""
    model = load_ar_drafter(request.getfixturevalue(f"tiny_{family}"), dtype=torch.bfloat16)
    target_dir = make_tiny_target(tmp_path / "target", seed=3, num_layers=2, vocab_size=int(model.config.vocab_size),
                                  with_tokenizer=False)
    target = load_target(target_dir, torch.bfloat16, "cpu")
    config = ARSpecConfig(method="deer", max_new_tokens=10, sampling=SamplingConfig(temperature=0.0, seed=1))
    runs = []
    for compile_ in (False, True):
        with trace_steps(compile_):
            runs.append(speculative_generate_batch(target, [DLLMDrafter(model)], [[3, 1, 4, 1, 5]], config,
                                                   compile=compile_)[0].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 10
    assert static_dllm_drafter_of(model).graphs.stats.runs


@pytest.mark.slow
@pytest.mark.parametrize("attention_block", [0, 4])
def test_denoising_step_traces_as_one_graph(dirs, attention_block):
    """The step with its further denoising steps (ranking, fixing, re-running) is one graph for TorchDynamo (no host
    read, no data-dependent shape: :func:`spiffy.capture.trace_steps`), with the eager tokens."""
    target = load_target(dirs[0], torch.float32, "cpu")
    base = load_ar_drafter(dirs[1], dtype=torch.float32)
    model = _aligned(base, attention_block) if attention_block else base
    config = ARSpecConfig(method="ddtree-dllm", budget=6, max_new_tokens=10,
                          sampling=SamplingConfig(temperature=0.7, seed=3))
    runs = []
    for compile_ in (False, True):
        with trace_steps(compile_):
            runs.append(speculative_generate_batch(target, [DLLMDrafter(model, denoise_steps=3)], [prompt_ids(4, 5)],
                                                   config, compile=compile_)[0].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 10
    assert static_dllm_drafter_of(model).graphs.stats.runs


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3), method=st.sampled_from(METHODS),
       temperature=st.sampled_from([0.0, 0.7]), accept=st.sampled_from(["coupled", "rejection"]),
       seed=st.integers(0, 1000), attention_block=st.sampled_from([0, 3, 5]), steps=st.sampled_from([1, 1, 2, 3]))
def test_static_equals_eager_property(dirs, lengths, method, temperature, accept, seed, attention_block, steps):
    """Any prompts (1-3 rows, 1-12 tokens), method, rule, temperature, layout (root, or aligned with attention
    blocks of 3 or 5) and denoising steps (1-3): compile=True gives compile=False's tokens and acceptance lengths
    (float64; the drafter guesses the first row's continuation, so commits are long)."""
    target = _float64(dirs)
    prompts = [prompt_ids(seed + i, n) for i, n in enumerate(lengths)]
    n = 9
    ar = ddtree_generate(target, None, prompts[0], method="ar", max_new_tokens=n, temperature=temperature, seed=seed)
    config = ARSpecConfig(method=method, budget=5, drafts=2, max_new_tokens=n, accept=accept,
                          sampling=SamplingConfig(temperature=temperature, seed=seed))
    with pytest.MonkeyPatch.context() as mp:  # (hypothesis runs the test many times: no function-scoped fixture)
        mp.setattr(SDARForCausalLM, "forward", _guessing_forward)
        model = _float64_drafter(dirs, attention_block)
        if getattr(model, "guess", None) is None or model.guess.numel() != 32:  # 12 prompt + 9 new tokens fit
            model.guess, model.second = torch.full((32,), -1, dtype=torch.long), torch.zeros(32, dtype=torch.bool)
        # written in place: a bucket recorded in an earlier example replays the tensors it was recorded with
        model.guess.fill_(-1)
        model.guess[len(prompts[0]) : len(prompts[0]) + n] = torch.tensor(ar.tokens)
        model.second.zero_()
        model.second[len(prompts[0]) + 2] = True
        runs = [speculative_generate_batch(target, [DLLMDrafter(model, denoise_steps=steps) for _ in prompts], prompts,
                                           config, compile=c) for c in (True, False)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert [r.acceptance_lengths for r in runs[0]] == [r.acceptance_lengths for r in runs[1]]
    assert static_dllm_drafter_of(model) is not None
    if accept == "coupled":
        assert runs[0][0].tokens == ar.tokens


_LOADED: dict[str, object] = {}


def _float64(dirs):  # noqa: ANN001, ANN202  (hypothesis runs the test many times: load once)
    if "target" not in _LOADED:
        _LOADED["target"] = load_target(dirs[0], torch.float64, "cpu")
    return _LOADED["target"]


def _float64_drafter(dirs, attention_block: int = 0):  # noqa: ANN001, ANN202
    """The float64 drafter, in the root layout (``attention_block`` 0) or aligned to blocks of ``attention_block``."""
    if "drafter" not in _LOADED:
        _LOADED["drafter"] = load_ar_drafter(dirs[1], dtype=torch.float64)
    key = f"drafter-{attention_block}"
    if attention_block and key not in _LOADED:
        _LOADED[key] = _aligned(_LOADED["drafter"], attention_block)
    return _LOADED[key if attention_block else "drafter"]
