"""The static (captured on a GPU) path of dLLM forwards, ``compile=True``, against eager, the reference.

On a CPU the static path runs the code a GPU captures, eagerly, on the model's static buffers with the states padded
to their bucket: its logits must equal eager's bit for bit (float32 and float64), so every method's tokens, states and
forward counts do too (baseline, Spiffy on an oracle graph, FreeDave, SSD; LLaDA and Dream, every cache mode, SDAR,
LLaDA2.0 and Fast-dLLM v2's prefix cache, T = 0 and seeded T > 0, single prompts and ragged batches), and a bucket
built once serves later prompts and calls.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_cases import (dream, fast_dllm_v2, left_pad, llada, llada2, llada_moe, ragged_prompts,  # noqa: F401 - fixtures
                         sdar, sdar_moe, static_forward_pairs)
import spiffy.capture.graphs as graphs_module
from spiffy.api import generate
from spiffy.bench.overheads import spiffy_sync_counts
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import emulate_replays, trace_steps
from spiffy.cli.main import main
from spiffy.decoding import make_session
from spiffy.decoding.captured import static_states_of
from spiffy.errors import ConfigError
from spiffy.models.loading import load_model
from spiffy.selfspec.freedave import freedave_graph
from spiffy.selfspec.oracle import oracle_graph_from_records, record_trajectory
from spiffy.selfspec.ssd import ssd_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

GEN, BLOCK = 16, 8
#: every (family, cache mode) with a static path: LLaDA and Dream (no cache, prefix, dual), SDAR's committed cache,
#: LLaDA2.0 (the official recompute and the committed cache), Fast-dLLM v2's committed cache (its sub-block cache,
#: "dual", forwards one state of one prompt: tests/test_captured_sub_block.py)
FAMILY_CACHES = [(f, c) for f in ("llada", "dream") for c in ("none", "prefix", "dual")] + [
    ("sdar", "prefix"), ("llada2", "none"), ("llada2", "prefix"), ("fast_dllm_v2", "prefix")]


def _kw(cache: str, temp: float, seed: int, family: str = "") -> dict:
    if family == "fast_dllm_v2":  # its threshold rule in sub-blocks (no step schedule): 0.0125 takes 1-3 per step
        return dict(gen_length=GEN, block_length=BLOCK, small_block_size=4, threshold=0.0125, cache=cache,
                    temperature=temp, seed=seed)
    return dict(gen_length=GEN, block_length=BLOCK, steps=GEN // 2, cache=cache, temperature=temp, seed=seed)


def _graph(model, method: str, prompt: torch.Tensor, kw: dict):
    """``(graph, budget)`` of ``method``: none (baseline), Spiffy on the prompt's oracle graph, FreeDave, SSD."""
    if method == "baseline":
        return None, None
    if method == "spiffy":
        s = make_session(model, prompt[None], **kw)
        graph = oracle_graph_from_records(record_trajectory(s), s.mask_id)
        return graph, len(graph.nodes)
    make = freedave_graph if method == "freedave" else ssd_graph
    graph = make(model, make_session(model, prompt[None], **kw).config, 3)
    return graph, len(graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"])
def test_forward_states_bitwise(request, family: str, dtype: torch.dtype) -> None:
    """Logits of N = 3 states equal eager's bit for bit, per cache mode and block (the inputs are copies: a
    static path reading the session's own tensors, or padding the states, would not be checked by this)."""
    model = load_model(request.getfixturevalue(f"tiny_{family}"), dtype=dtype)
    prompt = ragged_prompts([5])[0]
    for cache in [c for f, c in FAMILY_CACHES if f == family]:
        for block, (a, b) in enumerate(static_forward_pairs(model, prompt, _kw(cache, 0.0, 0, family), seed=1)):
            assert a.dtype == dtype and torch.equal(a, b), f"{family} cache={cache} block={block}"


#: the families' static caches (MoE families: one, as the dense ones cover the cache code) and the dtype traced
TRACED = [("llada", ("none", "prefix", "dual"), torch.float32), ("dream", ("prefix", "dual"), torch.float32),
          ("sdar", ("prefix",), torch.float32), ("fast_dllm_v2", ("prefix",), torch.float32),
          ("llada2", ("prefix",), torch.bfloat16), ("llada_moe", ("prefix",), torch.bfloat16),
          ("sdar_moe", ("prefix",), torch.bfloat16)]


@pytest.mark.parametrize("family,caches,dtype", [
    pytest.param(*t, id=t[0], marks=pytest.mark.slow) for t in TRACED])  # seconds each: the slow tier
def test_static_forwards_trace_as_one_graph(request, monkeypatch, family: str, caches: tuple, dtype: torch.dtype
                                            ) -> None:
    """Every family's static forward is one tensor program, the property a CUDA graph needs: TorchDynamo traces
    each bucket's step whole, with no value read back (:func:`spiffy.capture.trace_steps`), and its logits are the
    untraced step's. The MoE families in bfloat16: their experts run grouped (``torch._grouped_mm``, whose tracing
    takes bfloat16 only, the dtype CUDA runs them in)."""
    traced: list = []
    real = graphs_module._traced
    monkeypatch.setattr(graphs_module, "_traced", lambda step, key: traced.append(key) or real(step, key))
    prompt = ragged_prompts([5])[0]
    for cache in caches:  # each on models of its own: no bucket is built before the one traced
        path = request.getfixturevalue(f"tiny_{family}")
        plain = static_forward_pairs(load_model(path, dtype=dtype), prompt, _kw(cache, 0.0, 0, family), seed=1)
        with trace_steps():
            traced_pairs = static_forward_pairs(load_model(path, dtype=dtype), prompt, _kw(cache, 0.0, 0, family),
                                                seed=1)
        for (_e, a), (_f, b) in zip(plain, traced_pairs):
            assert torch.equal(a, b), f"{family} cache={cache}"
    assert len(traced) >= len(caches), traced


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family_cache=st.sampled_from(FAMILY_CACHES), method=st.sampled_from(["baseline", "spiffy", "freedave", "ssd"]),
       temp=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 50), length=st.integers(2, 9), replay=st.booleans())
def test_captured_tokens_equal_eager(request, family_cache: tuple[str, str], method: str, temp: float, seed: int,
                                     length: int, replay: bool) -> None:
    """... with the static path's buckets run eagerly or replayed as a GPU replays them
    (:func:`spiffy.capture.emulate_replays`)."""
    family, cache = family_cache
    with emulate_replays(replay):
        _tokens_equal(request.getfixturevalue(family), family, cache, method, temp, seed, length)


def _tokens_equal(model, family: str, cache: str, method: str, temp: float, seed: int, length: int) -> None:
    """``method``'s generation of a random prompt of ``length`` tokens, static against eager: the same tokens,
    states, forward and step counts."""
    prompt = torch.randint(5, 250, (length,), generator=torch.Generator().manual_seed(seed))
    kw = _kw(cache, temp, seed, family)
    graph, budget = _graph(model, method, prompt, kw)
    eager = generate(model, prompt[None], graph=graph, budget=budget, compile=False, **kw)
    static = generate(model, prompt[None], graph=graph, budget=budget, compile=True, **kw)
    assert static.tokens == eager.tokens
    assert torch.equal(static.sequences, eager.sequences)
    assert (static.nfe, static.steps) == (eager.nfe, eager.steps)
    assert static.stats["capture"]["buckets"] >= 1 and "capture" not in eager.stats


@pytest.mark.parametrize("method", ["baseline", "spiffy", "freedave", "ssd"])
def test_fast_dllm_v2_tokens_equal_eager(fast_dllm_v2, method: str) -> None:
    """Fast-dLLM v2 every method (the property test above draws it among the other families), T = 0 and seeded
    T > 0, a prompt sharing its first block with the masks, one as long as a block (the official loop ignores it)
    and one with a prefill: the static path's tokens are eager's."""
    for temp, seed, length in ((0.0, 3, 5), (1.0, 4, 8), (1.0, 5, 11)):
        _tokens_equal(fast_dllm_v2, "fast_dllm_v2", "prefix", method, temp, seed, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_dllm_v2_ragged_forward_bitwise(tiny_fast_dllm_v2, dtype: torch.dtype) -> None:
    """Ragged Fast-dLLM v2 batches, every layout its offsets take (a prompt shorter than a block, one of exactly a
    block whose prompt block is skipped, longer ones with a prefill; and a batch with nothing prefilled, whose cache
    starts after the skipped block): the static logits of batch rows (``rows``) and of the batch's own call equal
    eager's bit for bit, block by block, the logits shift included."""
    model = load_model(tiny_fast_dllm_v2, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    for lengths in ([5, 8, 13, 16], [8, 3]):
        ids, am = left_pad(ragged_prompts(lengths))
        eager, static = (make_session(model, ids, attention_mask=am, **_kw("prefix", 0.0, 0, "fast_dllm_v2"))
                         for _ in range(2))
        static.use_static()
        assert eager.static is None and static.static is not None
        for block in range(eager.num_blocks):
            eager.begin_block(block)
            static.begin_block(block)
            rows = torch.tensor([0, len(lengths) - 1, 1, 1])
            states = eager.x[rows].clone()
            start, end = eager.block_bounds(block)
            states[1:, start:end] = torch.randint(5, 250, (3, end - start), generator=g)
            for s, r in ((states, rows), (eager.x, None)):
                a, b = eager.forward_states(s, r), static.forward_states(s, r)
                assert a.dtype == dtype and torch.equal(a, b), (lengths, block, r is None)
            eager.end_block(block)
            static.end_block(block)
        assert static.nfe == eager.nfe


@pytest.mark.parametrize("family,cache", [("llada", "none"), ("llada", "prefix"), ("dream", "dual"),
                                          ("fast_dllm_v2", "prefix")])
def test_ragged_batch_equal_eager(request, family: str, cache: str) -> None:
    """Batched rows (left padding, a ``rows`` vector per forward) on the static path equal eager, with Spiffy
    (Fast-dLLM v2: a prompt of exactly a block, whose prompt block is skipped, and one with a prefill among them)."""
    model = request.getfixturevalue(family)
    prompts = ragged_prompts([4, 7, 2] if family == "llada" else [4, 8, 11])
    ids, am = left_pad(prompts)
    kw = _kw(cache, 1.0, 0, family)
    graph, budget = _graph(model, "freedave", prompts[0], kw)
    for g, b in ((None, None), (graph, budget)):
        eager = generate(model, ids, attention_mask=am, seeds=[7, 11, 5], graph=g, budget=b, compile=False, **kw)
        static = generate(model, ids, attention_mask=am, seeds=[7, 11, 5], graph=g, budget=b, compile=True, **kw)
        assert static.tokens == eager.tokens and static.nfe == eager.nfe
        assert static.stats["capture"]["runs"] >= 1


def test_buckets_are_reused_across_prompts_and_calls(dream) -> None:
    """A second prompt of the same length, and the same call again, build no new bucket: they only run them."""
    kw = _kw("prefix", 0.0, 0)
    a, b = ragged_prompts([6, 6])
    first = generate(dream, a[None], compile=True, **kw)
    built = first.stats["capture"]["buckets"]
    stats = static_states_of(dream).graphs.stats
    assert built == len(stats.capture_seconds) >= 2  # one per block window at least
    runs = sum(stats.runs.values())
    second = generate(dream, b[None], compile=True, **kw)
    third = generate(dream, a[None], compile=True, **kw)
    assert len(stats.capture_seconds) == built  # no new bucket
    assert sum(stats.runs.values()) == runs + second.nfe + third.nfe  # every forward, the block refreshes included
    assert third.tokens == first.tokens


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_dual_cache_buckets_serve_every_block(request, family: str) -> None:
    """A dual cache's forward has the same shapes at every block (the block between the cached rest), and so does
    the refresh: a generation builds one refresh bucket and one per states count, however many blocks it has, and the
    tokens are eager's; a prefix cache's window shrinks block by block, so it builds a bucket per block."""
    model = request.getfixturevalue(family)
    prompt = ragged_prompts([5])[0][None]
    built = {}
    for cache in ("dual", "prefix"):
        kw = dict(gen_length=32, block_length=8, steps=32, cache=cache)  # 4 blocks, one state per forward
        eager = generate(model, prompt, compile=False, **kw)
        states = static_states_of(model)  # the module's model: other tests' buckets may be there already
        before = set() if states is None else set(states.graphs.stats.capture_seconds)
        static = generate(model, prompt, compile=True, **kw)
        assert static.tokens == eager.tokens and static.nfe == eager.nfe == 32
        built[cache] = set(static_states_of(model).graphs.stats.capture_seconds) - before
    assert len(built["dual"]) == 2 and sum(k[0] == "refresh" for k in built["dual"]) == 1, built["dual"]
    assert len(built["prefix"]) == 1 + 4, built["prefix"]


def test_compile_setting_checked(fast_dllm_v2) -> None:
    """A ``compile=`` value that is no setting is refused naming the accepted ones, never ignored; Fast-dLLM v2's
    caches both run static (its sub-block cache: tests/test_captured_sub_block.py)."""
    with pytest.raises(ConfigError, match="--compile on\\|off\\|inductor\\|auto"):
        generate(fast_dllm_v2, torch.tensor([[5, 6, 7]]), gen_length=8, block_length=8, compile="maybe")
    for cache in ("prefix", "dual"):
        out = generate(fast_dllm_v2, torch.tensor([[5, 6, 7]]), gen_length=8, block_length=8, cache=cache,
                       compile=True)
        assert out.stats["capture"]["buckets"] >= 1


@pytest.mark.parametrize("moe_family", ["llada2", "llada_moe", "sdar_moe"])
def test_moe_capture_on_cuda_needs_grouped_experts(request, moe_family: str, sdar, llada, monkeypatch) -> None:
    """A CUDA capture of an MoE model runs its experts grouped (tests/test_moe_dispatch.py); where they cannot run
    grouped (here: float64, which torch._grouped_mm does not take) it is refused with a typed error naming why, for
    every MoE family, LLaDA-MoE's bidirectional session included; in bfloat16 it is not refused, nor are the dense
    SDAR and LLaDA (their forwards make no host read: test_static_forward_makes_no_host_sync)."""
    import spiffy.decoding.base as base_module
    import spiffy.decoding.sdar as sdar_module

    f64 = request.getfixturevalue(moe_family)
    bf16 = load_model(request.getfixturevalue(f"tiny_{moe_family}"), dtype=torch.bfloat16)
    moe = make_session(f64, torch.tensor([[5, 6, 7]]), **_kw("prefix", 0.0, 0))
    accepted = [make_session(m, torch.tensor([[5, 6, 7]]), **_kw("prefix", 0.0, 0)) for m in (bf16, sdar, llada)]
    cuda = lambda model: torch.device("cuda")  # noqa: E731 - what model_device answers on a GPU
    monkeypatch.setattr(sdar_module, "model_device", cuda)
    monkeypatch.setattr(base_module, "model_device", cuda)
    with pytest.raises(ConfigError, match="MoE.*float64.*compile=False"):
        moe.use_static(capture=True)
    for session in accepted:
        session.use_static(capture=True)
        assert session.static is not None and session.static.captured


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="TorchInductor compiles C++ on a CPU: no compiler here")
def test_inductor_fused_forwards_give_the_eager_tokens(llada) -> None:
    """``compile="inductor"``: every static forward compiled by TorchInductor before its capture (fused C++ kernels
    on a CPU); in float64 the baseline and Spiffy on FreeDave's graph give the eager tokens and forward counts (fused
    kernels round differently; float64 leaves no near tie to flip) and the buckets report themselves fused."""
    prompt = ragged_prompts([5])[0][None]
    kw = _kw("prefix", 0.0, 0)
    graph, budget = _graph(llada, "freedave", prompt[0], kw)
    for g, b in ((None, None), (graph, budget)):
        eager = generate(llada, prompt, graph=g, budget=b, compile=False, **kw)
        fused = generate(llada, prompt, graph=g, budget=b, compile="inductor", **kw)
        assert fused.tokens == eager.tokens and fused.nfe == eager.nfe
        assert fused.stats["capture"]["fused"] and fused.stats["capture"]["buckets"] >= 1


def test_cli_compile_in_dllm_mode(capsys, tiny_llada) -> None:
    """``--compile on`` is a dLLM-mode flag now, and prints the tokens of ``--compile off``."""
    out = []
    for flag in ("on", "off"):
        code = main(["generate", "--model", str(tiny_llada), "--prompt", "def f(x):", "--gen-length", "8",
                     "--block-length", "4", "--steps", "4", "--cache", "prefix", "--dtype", "float64", "--no-chat",
                     "--json", "--no-progress", "--compile", flag])
        assert code == 0
        out.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert out[0]["tokens"] == out[1]["tokens"] and out[0]["nfe"] == out[1]["nfe"]
    assert out[0]["stats"]["capture"]["buckets"] >= 1 and "capture" not in out[1]["stats"]


@pytest.mark.parametrize("family,cache", [(f, c) for f, c in FAMILY_CACHES if f != "llada2"])  # float64 MoE: per expert
def test_static_forward_makes_no_host_sync(request, family: str, cache: str) -> None:
    """A built bucket's forward (the inputs copied in, the model's call), and the cache's block-start refresh, ask the
    host for nothing, left padding and batch rows or not: a CUDA graph can hold them. ``to_cpu`` is left out: on a
    CPU run the model's ``.to(device)`` moves are counted (to the CPU), on a GPU they stay on the device and are
    no-ops."""
    model = request.getfixturevalue(family)
    for ids, am in ((torch.tensor([[5, 6, 7, 8]]), None), left_pad(ragged_prompts([4, 2]))):
        s = make_session(model, ids, attention_mask=am, **_kw(cache, 0.0, 0, family))
        s.use_static()
        s.begin_block(0)
        rows = None if am is None else torch.tensor([0, 1, 1])
        states = s.x.repeat(3, 1) if am is None else s.x[rows]
        s.forward_states(states, rows)  # builds the bucket
        with SyncCounter() as counter:
            s.begin_block(0)  # again: the cache's refresh bucket is built
            s.forward_states(states, rows)
        counts = {k: v for k, v in counter.counts.items() if k != "to_cpu"}
        # with batch rows: the one check that they index the batch (before the step, not inside it)
        assert counts == ({} if rows is None else {"__bool__": 1}), (family, cache, am is not None)


@pytest.mark.parametrize("budget", [1, 5, 9])
def test_spiffy_step_syncs_bound(budget: int) -> None:
    """Host synchronisations per Spiffy step on the synthetic LLaDA model (V = 4096, one 16-step block, a 10-node
    graph), D* = 1, 5 and 9, eager and static: at most 2 (12.25 eager before issue 37, then 8.5 eager and 4.75
    static). Each drafting step reads its ranking once (masked count, probability and token tables: pruning and
    deduplication run on the host copy) and each walk step its match flags once; the rule's schedule is read once
    per block. Never accepting, every step is one forward with the full drafting work (15 rankings + 15 walk reads
    + 1 schedule read = 31 over 16 steps); accepting, a walk step costs no ranking."""
    for static in (False, True):
        res = spiffy_sync_counts(4096, 16, 10, budget, static=static)
        spiffy, baseline = res["spiffy"], res["baseline"]
        assert spiffy["steps"] == spiffy["forwards"] == 16 and spiffy["accepted"] == 0
        assert spiffy["per_step"] <= 2 and spiffy["by_call"] == {"tolist": 31}, (static, res)
        assert baseline["by_call"] == {"tolist": 1}, (static, res)  # the block's schedule
    accepting = spiffy_sync_counts(4096, 16, 10, budget, static=True, scenario="drafts accepted")["spiffy"]
    assert accepting["accepted"] > 0 and accepting["steps"] == 16 and accepting["per_step"] <= 2, accepting
