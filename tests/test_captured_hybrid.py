"""Hybrid targets (Qwen3.5, Qwen3-Next: Gated-DeltaNet layers between full-attention layers) on the captured path.

``compile=True`` runs a hybrid's recurrent layers in static steps (:mod:`spiffy.arspec.captured_recurrent`): each
mixer once over every verification column's root path from the committed state, and a commit bucket that re-advances
the state over the accepted path. On a CPU the static code runs eagerly, so these tests check the code a GPU replays
against the eager loop (``compile=False``, :class:`~spiffy.models.recurrent.RecurrentMixers`, the reference), token
for token: both hybrids, float32 and float64, plain AR, the DFlash chain and DDTree, greedy and sampled (T = 1,
seeded), coupled and rejection rules, one prompt and ragged batches whose rows leave at different rounds, with
oracle drafters (deep accepted paths, acceptance through DDTree's side branches) and real DFlash drafters (the
static drafter reads the hybrid's features). The round stays at two host reads at most and the steps are
idempotent and read nothing back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig

from oracle_drafter import OracleDrafter
from pairwise import pairwise_params

import spiffy.arspec.captured as captured_module
import spiffy.capture.graphs as graphs_module
from captured_rounds import captured_round_syncs
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, ddtree_generate, speculative_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured import StaticTarget, static_target_of, static_unsupported
from spiffy.arspec.captured_drafter import static_drafter_of
from spiffy.arspec.captured_recurrent import StaticRecurrent, root_paths
from spiffy.arspec.stages import (RoundBuffers, TargetRunner, commit, compile_round, prefill, prefill_inputs,
                                  tree_columns, verify)
from spiffy.arspec.tree import build_ddtree
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import StatefulStep, slot_cache_supported, trace_steps
from spiffy.models import load_drafter, load_target, make_tiny_dflash
from spiffy.models.ar_checkpoints import make_tiny_dflash2
from spiffy.models.ar_drafters import load_ar_drafter, make_tiny_dllm_drafter
from spiffy.models.recurrent import branches
from spiffy.models.tiny import make_tiny

torch.set_num_threads(1)
BLOCK = 5
HYBRIDS = ("qwen3_5", "qwen3_next")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``{arch: (target dir, DFlash drafter dir)}``: Qwen3.5 with layers [linear, full, linear], Qwen3-Next with
    [linear, full]."""
    root = tmp_path_factory.mktemp("captured_hybrid")
    out = {}
    for arch, layers in (("qwen3_5", 3), ("qwen3_next", 2)):
        target = make_tiny(arch, root / arch, seed=1, num_hidden_layers=layers)
        out[arch] = target, make_tiny_dflash(root / f"{arch}_dflash", target, seed=2, block_size=BLOCK)
    return out


_TARGETS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _target(dirs, arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """One target per architecture and dtype, loaded once (hypothesis does not take function-scoped fixtures)."""
    key = (str(dirs[arch][0]), dtype)
    if key not in _TARGETS:
        _TARGETS[key] = load_target(dirs[arch][0], dtype, "cpu")
    return _TARGETS[key]


DTYPES = (torch.float32, torch.float64)


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(5, vocab - 8, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(method: str, n: int, temperature: float = 0.0, seed: int = 3, accept: str = "coupled",
            budget: int = 8) -> ARSpecConfig:
    return ARSpecConfig(method=method, budget=budget, max_new_tokens=n, accept=accept,
                        sampling=SamplingConfig(temperature=temperature, seed=seed))


def _oracle(continuation: list[int], n_prompt: int, vocab: int, dtype: torch.dtype, wrong_every: int,
            second: float | None = 2.0) -> OracleDrafter:
    """Confident drafts of the AR continuation; every ``wrong_every``-th position wrong, with the true token second
    (the chain stops there, DDTree accepts through a side branch) or, ``second=None``, not drafted (every path stops
    there: the accepted path is shorter than the tree is deep)."""
    return OracleDrafter(continuation, n_prompt, vocab, BLOCK, wrong_every, dtype=dtype, floor=-6.0, top=3.0,
                         second=second)


#: (temperature, rule): greedy, sampled coupled, sampled rejection
RULES = ((0.0, "coupled"), (1.0, "coupled"), (1.0, "rejection"))


def _named(params: list) -> list:
    """``pairwise_params``' cases with readable ids (``qwen3_5-f32-sampled-rejection``)."""
    def name(v: object) -> str:
        if isinstance(v, torch.dtype):
            return {torch.float32: "f32", torch.float64: "f64"}[v]
        if isinstance(v, tuple):
            return "greedy" if v[0] == 0 else f"sampled-{v[1]}"
        return str(v)
    return [pytest.param(*p.values, marks=p.marks, id="-".join(name(v) for v in p.values)) for p in params]


#: arch x dtype x rule by pairs in the fast tier, the whole grid in the slow tier
GRID = _named(pairwise_params(HYBRIDS, DTYPES, RULES))


@pytest.mark.parametrize("arch, dtype, rule", GRID)
def test_one_prompt_captured_equals_eager(dirs, arch, dtype, rule):
    """One prompt: plain AR, the chain and DDTree with oracle drafts (deep accepted paths; side branches), captured
    == eager token for token, with the same acceptance lengths."""
    target, (temperature, accept) = _target(dirs, arch, dtype), rule
    vocab = int(target.config.vocab_size)
    prompt = _prompt(3, 7, vocab)
    n = 16
    ar = speculative_generate(target, None, prompt, _config("ar", n + BLOCK, temperature, accept=accept)).tokens
    for method in ("ar", "dflash", "ddtree"):
        for wrong_every in ((0,) if method == "ar" else (0, 3)):
            runs = []
            for compile_ in (False, True):
                drafter = None if method == "ar" else _oracle(ar, len(prompt), vocab, dtype, wrong_every)
                runs.append(speculative_generate(target, drafter, prompt, _config(method, n, temperature, accept=accept),
                                                 compile=compile_))
            eager, captured = runs
            assert captured.tokens == eager.tokens, (method, wrong_every)
            assert captured.acceptance_lengths == eager.acceptance_lengths, (method, wrong_every)
            if temperature == 0 or accept == "coupled":  # the coupled walk (and greedy) equals AR itself
                assert captured.tokens == ar[:n], (method, wrong_every)
            if method != "ar" and wrong_every == 0 and accept == "coupled":
                assert max(captured.acceptance_lengths) > 2  # the walk accepted deep paths
    assert static_target_of(target).recurrent is not None  # the hybrid ran on the static recurrent layers


@pytest.mark.parametrize("arch, dtype, rule", GRID)
def test_ragged_batches_captured_equal_eager(dirs, arch, dtype, rule):
    """Three prompts of different lengths (left padding), token budgets and drafts accepted to different depths:
    rows leave the batch at different rounds (the recurrent state rows follow them), captured rows == eager rows."""
    target, (temperature, accept) = _target(dirs, arch, dtype), rule
    vocab = int(target.config.vocab_size)
    prompts = [_prompt(s, n, vocab) for s, n in ((1, 6), (2, 3), (3, 9))]
    lengths, seeds = (15, 6, 11), (3, 4, 5)
    ars = [speculative_generate(target, None, p, _config("ar", 20, temperature, s, accept)).tokens
           for p, s in zip(prompts, seeds)]
    for method in ("ar", "dflash", "ddtree"):
        runs = []
        for compile_ in (False, True):
            cfgs = [_config(method, n, temperature, s, accept) for n, s in zip(lengths, seeds)]
            drafters = None if method == "ar" else [_oracle(a, len(p), vocab, dtype, w)
                                                   for a, p, w in zip(ars, prompts, (0, 3, 4))]
            runs.append([r.tokens for r in speculative_generate_batch(target, drafters, prompts, cfgs,
                                                                      compile=compile_)])
        assert runs[1] == runs[0], method
        assert [len(t) for t in runs[1]] == list(lengths)


@pytest.mark.parametrize("arch, dtype", _named(pairwise_params(HYBRIDS, DTYPES)))
def test_real_dflash_drafters_on_the_static_drafter(dirs, arch, dtype):
    """Random real DFlash drafters (the hybrid's layer features): one prompt through the static drafter (captured
    block forward fed by the captured verification's recorded features), and a batch; captured == eager (the
    chain greedy, DDTree sampled)."""
    target, drafter_dir = _target(dirs, arch, dtype), dirs[arch][1]
    vocab = int(target.config.vocab_size)
    prompts = [_prompt(s, n, vocab) for s, n in ((4, 8), (5, 4))]
    for method, temperature in (("dflash", 0.0), ("ddtree", 1.0)):
        cfgs = [_config(method, n, temperature, s) for n, s in zip((12, 7), (6, 7))]
        runs = []
        for compile_ in (False, True):
            drafters = [as_drafter(load_drafter(drafter_dir, dtype=dtype)) for _ in prompts]
            one = speculative_generate(target, drafters[0], prompts[0], cfgs[0], compile=compile_).tokens
            drafters = [as_drafter(load_drafter(drafter_dir, dtype=dtype)) for _ in prompts]
            batch = [r.tokens for r in speculative_generate_batch(target, drafters, prompts, cfgs, compile=compile_)]
            runs.append((one, batch))
        assert runs[1] == runs[0], method


@pytest.mark.parametrize("method", ["deer", "specdiff", "dflash2"])
def test_host_built_trees_on_hybrids(dirs, tmp_path_factory, method):
    """Methods whose trees are built on the host (DEER and SpecDiff-2 with a dLLM drafter) walk the captured
    verification's hidden states on the host, then commit through the same recurrent commit bucket; DFlash2's chain
    (coupled rule) is built and walked on the device (:mod:`spiffy.arspec.device_selector`) and commits through the
    same bucket: captured == eager (float32, T = 1)."""
    target_dir, _ = dirs["qwen3_5"]
    root = tmp_path_factory.mktemp(f"host_{method}")
    path = (make_tiny_dflash2(root / "d", target_dir, seed=4, block_size=BLOCK) if method == "dflash2" else
            make_tiny_dllm_drafter(root / "d", target_dir, seed=3, block_size=BLOCK))
    target = load_target(target_dir, torch.float32, "cpu")
    prompt = _prompt(6, 7, int(target.config.vocab_size))
    runs = []
    for compile_ in (False, True):
        config = ARSpecConfig(method=method, budget=8, drafts=3, max_new_tokens=10,
                              sampling=SamplingConfig(temperature=1.0, seed=3))
        runs.append(speculative_generate(target, as_drafter(load_ar_drafter(path, dtype=torch.float32)), prompt,
                                         config, compile=compile_))
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].acceptance_lengths == runs[0].acceptance_lengths


def test_round_syncs_at_most_twice_and_steps_read_nothing_back(dirs):
    """A captured DDTree round on a hybrid with the static drafter reads the device at most twice outside the model
    forwards (the recurrent commit included: it is not a forward); every step reads nothing back, and runs twice
    alike (a capture's recording runs its Python once more): the tree step as it is, the fused round (verification,
    walk, recurrent and attention commit) with its state put back in between (a StatefulStep)."""
    target_dir, drafter_dir = dirs["qwen3_5"]
    target, base = load_target(target_dir, torch.float32, "cpu"), load_drafter(drafter_dir, dtype=torch.float32)
    res, per_round = captured_round_syncs(target, base, lambda: ddtree_generate(
        target, base, _prompt(9, 8, int(target.config.vocab_size)), method="ddtree", budget=8, max_new_tokens=12,
        compile=True))
    assert len(res.tokens) == 12 and len(per_round) == res.rounds
    assert static_drafter_of(base) is not None
    assert max(per_round) <= 2, per_round

    static = static_target_of(target)
    recurrent = static.recurrent
    keys = list(static.graphs.stats.runs)
    assert {k[0] for k in keys} == {"round", "tree"}, keys
    committed = {i: tuple(t.clone() for t in s) for i, s in recurrent.state.items()}
    with torch.inference_mode():
        for key in keys:
            outs = []
            step = static.graphs.step(key)
            for _ in range(2):
                restore = step.save() if isinstance(step, StatefulStep) else (lambda: None)
                with SyncCounter() as c:
                    out = static.graphs.run(key)
                assert {k: v for k, v in c.counts.items() if k != "to_cpu"} == {}, (key, c.counts)
                outs.append(([t.clone() for t in tree_leaves(out)] if out is not None else None,
                             {i: tuple(t.clone() for t in s) for i, s in recurrent.pending.items()}))
                restore()
            (out0, pending0), (out1, pending1) = outs
            assert (out0 is None and out1 is None) or all(torch.equal(a, b) for a, b in zip(out0, out1)), key
            for i in pending0:
                assert all(torch.equal(a, b) for a, b in zip(pending0[i], pending1[i])), key
    for i, state in recurrent.state.items():  # put back as it was
        assert all(torch.equal(a, b) for a, b in zip(state, committed[i]))


def test_a_capture_rehearsal_changes_nothing(dirs, monkeypatch):
    """On a GPU a bucket's second call records its step (its Python runs, its tensor writes do not) before the
    replay: every step of the hybrid's captured path (the tree, the fused round with its recurrent commit, the static
    drafter's block) rehearses that here (:data:`spiffy.capture.graphs.REHEARSE`: the step runs and its state is put
    back), and the tokens stay the eager path's."""

    target = _target(dirs, "qwen3_5", torch.float32)
    vocab = int(target.config.vocab_size)
    prompts = [_prompt(s, n, vocab) for s, n in ((21, 5), (22, 9))]
    ars = [speculative_generate(target, None, p, _config("ar", 16, seed=s)).tokens for p, s in zip(prompts, (3, 4))]
    cases = [("ddtree", lambda: [_oracle(a, len(p), vocab, torch.float32, 3, None) for a, p in zip(ars, prompts)]),
             ("dflash", lambda: [as_drafter(load_drafter(dirs["qwen3_5"][1], dtype=torch.float32)) for _ in prompts]),
             ("ar", lambda: None)]
    for method, drafters in cases:
        cfgs = [_config(method, n, seed=s) for n, s in zip((12, 7), (3, 4))]
        eager = [r.tokens for r in speculative_generate_batch(target, drafters(), prompts, cfgs, compile=False)]
        with monkeypatch.context() as m:
            m.setattr(graphs_module, "REHEARSE", True)
            if static_target_of(target) is not None:
                static_target_of(target).release()  # every bucket made afresh, so its second call rehearses
            captured = [r.tokens for r in speculative_generate_batch(target, drafters(), prompts, cfgs, compile=True)]
            assert captured == eager, method
            if method == "ddtree":  # the check can fail: rehearsals that leave the recurrent state advanced
                m.setattr(StaticRecurrent, "save", lambda self, rows: (lambda: None))
                static_target_of(target).release()
                careless = speculative_generate_batch(target, drafters(), prompts, cfgs, compile=True)
                assert [r.tokens for r in careless] != eager


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10**6), lengths=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       budget=st.sampled_from([2, 5, 9]), method=st.sampled_from(["dflash", "ddtree", "ddtree", "ar"]),
       temperature=st.sampled_from([0.0, 1.0]), wrong_every=st.sampled_from([2, 3, 0]),
       second=st.sampled_from([None, 2.0]), arch=st.sampled_from(HYBRIDS))
def test_random_prompts_and_budgets(dirs, seed, lengths, budget, method, temperature, wrong_every, second, arch):
    """Random prompts, lengths, token budgets, tree budgets, methods and oracle miss patterns (float32): captured
    == eager (== AR: the coupled rule)."""
    target = _target(dirs, arch, torch.float32)
    vocab = int(target.config.vocab_size)
    prompts = [_prompt(seed + i, n, vocab) for i, n in enumerate(lengths)]
    news = [6 + (seed + 3 * i) % 9 for i in range(len(prompts))]
    ars = [speculative_generate(target, None, p, _config("ar", 20, temperature, seed + i)).tokens
           for i, p in enumerate(prompts)]
    runs = []
    for compile_ in (False, True):
        cfgs = [_config(method, n, temperature, seed + i, budget=budget) for i, n in enumerate(news)]
        drafters = None if method == "ar" else [_oracle(a, len(p), vocab, torch.float32, wrong_every, second)
                                               for a, p in zip(ars, prompts)]
        runs.append([r.tokens for r in speculative_generate_batch(target, drafters, prompts, cfgs, compile=compile_)])
    assert runs[1] == runs[0]
    assert runs[1] == [a[:n] for a, n in zip(ars, news)]  # the coupled rule: AR's tokens


@pytest.mark.parametrize("arch", HYBRIDS)
def test_tree_nodes_and_committed_state_equal_eager(dirs, arch):
    """One DDTree round of two ragged rows on a :class:`StaticTarget` and on the eager runner (float64): every
    node's hidden state agrees, and after committing a side branch (row 0: a deepest node's path, not a prefix of
    the window) and the root alone (row 1) the committed recurrent states agree, to the float32 rounding of
    transformers' Gated-DeltaNet kernels."""
    target = load_target(dirs[arch][0], torch.float64, "cpu")
    vocab = int(target.config.vocab_size)
    prompts = [_prompt(11, 7, vocab), _prompt(12, 3, vocab)]
    g = torch.Generator().manual_seed(7)
    trees = [build_ddtree(torch.log_softmax(3 * torch.randn(4, vocab, generator=g, dtype=torch.float64), -1), b)
             for b in (12, 7)]
    with torch.inference_mode():
        runner = TargetRunner.for_target(target)
        ids, positions, mask, valid, _ = prefill_inputs(prompts, runner.device, runner.dtype)
        first = prefill(runner, ids, positions, mask, valid)
        roots = [(int(first[b].argmax()), len(p)) for b, p in enumerate(prompts)]
        compiled, widths = compile_round(trees, roots, valid, runner.dtype, RoundBuffers.allocate(2, 13))
        context = runner.context_len
        eager = verify(runner, compiled, tree_columns(trees))
        static = StaticTarget(target, 2, 64, 13, False)
        static.prefill(prompts)
        for b, (tree, (tok, pos)) in enumerate(zip(trees, roots)):  # as CapturedRounds._fill writes a host tree
            n = tree.num_nodes
            static.ids[b], static.parents[b], static.depths[b], static.positions[b] = 0, -1, 1, pos
            static.ids[b, 0] = tok
            static.ids[b, 1 : 1 + n], static.parents[b, :n], static.depths[b, :n] = tree.tokens, tree.parents, tree.depths
            static.positions[b, 1:] += static.depths[b]
        captured = static.verify(2, 13, 4)
        for b, w in enumerate(widths):
            torch.testing.assert_close(captured[b, :w], eager[b, :w], rtol=0, atol=1e-5)
        columns = tree_columns(trees)
        deepest = max(range(len(columns[0])), key=lambda c: (len(_path(columns[0], c)), c))
        keeps = [_path(columns[0], deepest), [0]]
        assert keeps[0] != list(range(len(keeps[0])))  # a side branch: kept rows move
        commit(runner, valid, context, keeps)
        keep = torch.tensor([k + [0] * (5 - len(k)) for k in keeps])
        static.commit(2, keep, torch.tensor([len(k) - 1 for k in keeps]))
    assert static.recurrent is not None and set(static.recurrent.state) == set(runner.recurrent.state)
    for i, (conv, rec) in static.recurrent.state.items():
        want_conv, want_rec = runner.recurrent.state[i]
        torch.testing.assert_close(conv[:2], want_conv, rtol=0, atol=1e-5)
        torch.testing.assert_close(rec[:2], want_rec, rtol=0, atol=1e-5)


def _path(columns: list[int], col: int) -> list[int]:
    """Column ``col``'s root path (parent columns ``columns``)."""
    out = [col]
    while out[-1] != 0:
        out.append(columns[out[-1]])
    return out[::-1]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(seeds=st.lists(st.integers(0, 10**6), min_size=0, max_size=10), pad=st.integers(0, 3))
def test_root_paths_are_the_eager_branches(seeds, pad):
    """Random trees (node ``j``'s parent any earlier node or the root), padded with nodes below the root: every
    column's static path is its root path (the eager branches' prefixes), then the column repeated and not real."""
    parents = [(s % (j + 1)) - 1 for j, s in enumerate(seeds)] + [-1] * pad  # -1: the root
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    length = 1 + max(depths, default=0)
    path, real, depth = root_paths(torch.tensor([parents], dtype=torch.long).view(1, -1),
                                   torch.tensor([depths], dtype=torch.long).view(1, -1), length)
    cols = [-1] + [p + 1 for p in parents]
    prefixes = {b[-1]: b for b in branches(cols)}
    for b in branches(cols):
        for k in range(1, len(b)):
            prefixes.setdefault(b[k - 1], b[:k])
    for c in range(len(cols)):
        want = prefixes[c]
        assert path[0, c].tolist() == want + [c] * (length - len(want))
        assert real[0, c].tolist() == [t < len(want) for t in range(length)]
        assert int(depth[0, c]) == len(want) - 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRIDS)
def test_steps_trace_as_one_graph(dirs, monkeypatch, arch):
    """A hybrid's verification (its Gated-DeltaNet mixers over every column's root path) and its recurrent commit are
    one tensor program each, the property a CUDA graph needs: TorchDynamo traces every bucket whole
    (:func:`spiffy.capture.trace_steps`), and the tokens stay the eager path's."""
    traced: list = []
    real = graphs_module._traced
    monkeypatch.setattr(graphs_module, "_traced", lambda step, key: traced.append(key) or real(step, key))
    target = load_target(dirs[arch][0], torch.float32, "cpu")  # its own: every bucket is built (and traced) here
    vocab = int(target.config.vocab_size)
    prompt = _prompt(8, 6, vocab)
    ar = speculative_generate(target, None, prompt, _config("ar", 14)).tokens
    drafter = _oracle(ar, len(prompt), vocab, torch.float32, 3)
    eager = speculative_generate(target, drafter, prompt, _config("ddtree", 10), compile=False).tokens
    with trace_steps():
        captured = speculative_generate(target, drafter, prompt, _config("ddtree", 10), compile=True).tokens
    assert captured == eager == ar[:10]
    assert {k[0] for k in traced if isinstance(k, tuple)} >= {"round", "tree"}, traced  # the fused round, the tree


def test_static_cache_holds_hybrids_and_refuses_other_kinds(dirs):
    """Full + linear attention fit the static cache; a sliding window or another layer kind is refused, by name."""
    target = load_target(dirs["qwen3_next"][0], torch.float32, "cpu")
    assert static_unsupported(target) is None
    # a CUDA capture of transformers' "eager" experts (spiffy's choice in float64) is refused, by name
    f64 = _target(dirs, "qwen3_next", torch.float64)
    assert f64.config._experts_implementation == "eager" and static_unsupported(f64, capture=True) is None  # a CPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(captured_module, "execution_device", lambda module: torch.device("cuda"))
        assert "experts_implementation='eager'" in static_unsupported(f64, capture=True)
        assert static_unsupported(f64, capture=False) is None and static_unsupported(target, capture=True) is None
    assert slot_cache_supported(target.config) is None
    why = slot_cache_supported(SimpleNamespace(layer_types=["full_attention", "mamba"], num_hidden_layers=2))
    assert why is not None and "not mamba" in why and "linear_attention" in why
    why = slot_cache_supported(SimpleNamespace(layer_types=["linear_attention"] * 2, num_hidden_layers=2))
    assert why is not None and "no full-attention layer" in why
    why = slot_cache_supported(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=64,
                                                    max_window_layers=1, num_hidden_layers=2))
    assert why is not None and "sliding" in why
