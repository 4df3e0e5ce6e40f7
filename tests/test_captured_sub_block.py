"""Fast-dLLM v2's sub-block cache (``cache="dual"``, the official ``use_block_cache``) on the static path.

A step forwards either the whole block (refreshing the kept block K/V) or one sub-block over the kept K/V, written
back in place (:mod:`spiffy.decoding.fast_dllm_v2_sub_block`). On a CPU the static path runs the code a GPU captures:
every forward's logits must equal eager's bit for bit (float32, float64 and bfloat16: the same kernels on the same
values), eagerly and under emulated CUDA-graph replays, so the generated tokens do too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_cases import fast_dllm_v2, ragged_prompts  # noqa: F401 - fixtures
import spiffy.capture.graphs as graphs_module
from spiffy.api import generate
from spiffy.bench.syncs import SyncCounter
from spiffy.capture import emulate_replays, trace_steps
from spiffy.decoding import make_session
from spiffy.decoding.batch import run_baseline
from spiffy.decoding.captured import static_states_of
from spiffy.errors import ConfigError
from spiffy.models.loading import load_model
from spiffy.selfspec.freedave import freedave_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

#: one token per step on the tiny random model (its probabilities stay below 0.5): a sub-block takes 4 steps, the
#: first refreshing and the others a sub-block call once its first column is decoded (a refresh again before that)
KW = dict(gen_length=16, block_length=8, small_block_size=4, threshold=0.5, cache="dual")


def _recorded_forwards(session) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """From now on, after each of ``session.forward_states``'s calls in order: its output and the block K/V the
    sub-block cache keeps (every layer's keys and values stacked), copies."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = session.forward_states

    def forward_states(states, rows=None):
        out = real(states, rows)
        kept = torch.stack([t for kv in session._sub_block.kept for t in kv])
        seen.append((out.clone(), kept.clone()))
        return out

    session.forward_states = forward_states
    return seen


def _kinds(model) -> dict[str, int]:
    """The sub-block cache's static buckets built on ``model`` so far, per kind (refresh / sub_block)."""
    keys = static_states_of(model).graphs.stats.capture_seconds
    return {kind: sum(1 for k in keys if k[0] == f"fast_dllm_v2_{kind}") for kind in ("refresh", "sub_block")}


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sub_block_forwards_bitwise(tiny_fast_dllm_v2, dtype: torch.dtype, replay: bool) -> None:
    """Every forward of a baseline generation (refreshes and sub-block calls), static against eager, bit for bit,
    and the block K/V kept after it:
    a prompt sharing the first block with the masks, one as long as a block (skipped, nothing cached before the
    first block) and one with a prefill; buckets of both kinds are built and replayed."""
    model = load_model(tiny_fast_dllm_v2, dtype=dtype)
    for length in (3, 8, 11):
        prompt = ragged_prompts([length])[0][None]
        eager, static = (make_session(model, prompt, seed=length, **KW) for _ in range(2))
        static.use_static()
        seen_eager, seen_static = _recorded_forwards(eager), _recorded_forwards(static)
        with emulate_replays(replay):
            run_baseline(eager)
            run_baseline(static)
        assert len(seen_static) == len(seen_eager) >= 8  # 16 tokens, one per step: the block commits are not here
        for i, ((a, kept_a), (b, kept_b)) in enumerate(zip(seen_eager, seen_static)):
            assert a.dtype == dtype and torch.equal(a, b), (length, i)
            assert torch.equal(kept_a, kept_b), (length, i)  # the in-place writes too (no later call reads them)
        assert torch.equal(static.x, eager.x) and static.nfe == eager.nfe
    kinds = _kinds(model)
    assert kinds["refresh"] >= 2 and kinds["sub_block"] >= 2, kinds
    stats = static_states_of(model).graphs.stats
    assert sum(stats.runs.values()) > len(stats.runs)  # buckets are run again (replayed under emulation)
    assert (stats.captures > 0) == replay


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 13), block=st.sampled_from([4, 8]), small=st.sampled_from([1, 2, 4]),
       threshold=st.sampled_from([0.0125, 0.5, 1.0]), temp=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 50),
       replay=st.booleans())
def test_sub_block_tokens_equal_eager(fast_dllm_v2, length: int, block: int, small: int, threshold: float,
                                      temp: float, seed: int, replay: bool) -> None:
    """Random prompts, block and sub-block sizes, thresholds, T = 0 and seeded T > 0, buckets run eagerly or replayed:
    ``compile=True`` gives eager's tokens and forward count."""
    model = fast_dllm_v2
    prompt = torch.randint(5, 250, (1, length), generator=torch.Generator().manual_seed(seed))
    kw = {**KW, "block_length": block, "small_block_size": min(small, block), "threshold": threshold,
          "temperature": temp, "seed": seed}
    eager = generate(model, prompt, compile=False, **kw)
    with emulate_replays(replay):
        static = generate(model, prompt, compile=True, **kw)
    assert static.tokens == eager.tokens and torch.equal(static.sequences, eager.sequences)
    assert (static.nfe, static.steps) == (eager.nfe, eager.steps)
    assert static.stats["capture"]["buckets"] >= 1


def test_one_sub_block_bucket_per_block(tiny_fast_dllm_v2) -> None:
    """The sub-block's place is data: a block builds one sub-block bucket however many sub-blocks it decodes (and
    one refresh bucket), each run several times."""
    model = load_model(tiny_fast_dllm_v2, dtype=torch.float32)  # its own: no bucket built before
    prompt = ragged_prompts([5])[0][None]
    out = generate(model, prompt, compile=True, **{**KW, "gen_length": 24})  # 3 blocks of 2 sub-blocks
    assert out.tokens == generate(model, prompt, compile=False, **{**KW, "gen_length": 24}).tokens
    stats = static_states_of(model).graphs.stats
    built = set(stats.capture_seconds)
    per_kind = {kind: [k for k in built if k[0] == f"fast_dllm_v2_{kind}"] for kind in ("refresh", "sub_block")}
    assert len(per_kind["refresh"]) == len(per_kind["sub_block"]) == 3, per_kind
    assert all(stats.runs[k] >= 2 for k in per_kind["sub_block"])  # both sub-blocks of a block: one bucket


def test_built_buckets_read_one_value_per_step(fast_dllm_v2) -> None:
    """With its buckets built, a step asks the host for one value: the block's first masked column, which decides
    the call (as officially); the calls themselves read nothing back (a CUDA graph holds them)."""
    model = fast_dllm_v2
    prompt = ragged_prompts([5])[0][None]
    s = make_session(model, prompt, **KW)
    s.use_static()
    s.begin_block(0)
    for _ in range(2):  # a refresh (nothing kept yet), then the same state again: the sub-block is refreshed again
        s.forward_states(s.x)
    s.x[0, s.block_bounds(0)[0]] = 7  # the sub-block's first column decoded: a sub-block call
    s.forward_states(s.x)
    for _ in range(2):
        with SyncCounter() as counter:
            s.forward_states(s.x)
        assert {k: v for k, v in counter.counts.items() if k != "to_cpu"} == {"__int__": 1}


@pytest.mark.slow
def test_sub_block_steps_trace_as_one_graph(tiny_fast_dllm_v2, monkeypatch) -> None:
    """Both calls are one tensor program each (TorchDynamo traces every bucket whole, no value read back), and the
    traced steps give eager's tokens."""
    traced: list = []
    real = graphs_module._traced
    monkeypatch.setattr(graphs_module, "_traced", lambda step, key: traced.append(key) or real(step, key))
    prompt = ragged_prompts([5])[0][None]
    eager = generate(load_model(tiny_fast_dllm_v2, dtype=torch.float32), prompt, compile=False, **KW)
    with trace_steps():
        static = generate(load_model(tiny_fast_dllm_v2, dtype=torch.float32), prompt, compile=True, **KW)
    assert static.tokens == eager.tokens
    assert {k[0] for k in traced} == {"fast_dllm_v2_refresh", "fast_dllm_v2_sub_block"}, traced


def test_drafts_still_refused(fast_dllm_v2) -> None:
    """Drafts cannot be verified over a sub-block cache (a state's logits depend on which earlier state refreshed
    the kept K/V): refused on the static path as on the eager one, naming the fix."""
    model = fast_dllm_v2
    prompt = ragged_prompts([5])[0][None]
    kw = {**KW, "threshold": 0.5}
    graph = freedave_graph(model, make_session(model, prompt, **kw).config, 3)
    for compile_setting in (False, True):
        with pytest.raises(ConfigError, match="sub-block cache.*fix: use cache='prefix'"):
            generate(model, prompt, graph=graph, budget=len(graph), compile=compile_setting, **kw)
