"""What a CUDA graph needs from the captured AR path's steps, proven on a CPU.

A GPU captures each bucket's step once and replays it; that is transparent only when the step is one static tensor
program (no host read, no branch on a tensor value, no data-dependent shape) and when recording it (its Python runs
once more, its tensor writes do not happen) leaves no trace. Here, without a GPU:

* every step a generation builds (DDTree's tree from the drafts; the fused round: verification forward, walk and
  commit; the static drafter's block) is traced by TorchDynamo as **one graph** (:func:`spiffy.capture.trace_steps`,
  ``fullgraph=True``) under both rules, greedy and sampled, point-mass and sampled proposals, and still returns the
  eager loop's tokens;
* a step with a host read or a data-dependent shape is refused by that check (it can fail);
* the fused round, which commits what it verified, rehearses a recording at each bucket's second call and changes
  nothing (:data:`spiffy.capture.graphs.REHEARSE`), and a rehearsal that did not put the state back would change the
  tokens;
* buckets beyond the bound are dropped, least recently run first, and built again when asked;
* ``compile="inductor"`` (every step compiled by TorchInductor before its capture) gives the eager tokens.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

import spiffy.capture.graphs as graphs_module
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter, ddtree_generate
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured import static_target_of
from spiffy.arspec.captured_drafter import static_drafter_of
from spiffy.batch_invariance import batch_invariant
from spiffy.capture import (StatefulStep, StepGraphs, StepNotCapturable, compile_fuses, emulate_replays,
                            resolve_compile, trace_steps)
from spiffy.cli.main import build_parser
from spiffy.errors import ConfigError
from spiffy.models import load_target
from spiffy.models.ar_checkpoints import make_tiny_dflash, make_tiny_target
from spiffy.models.dflash import load_drafter

torch.set_num_threads(1)
BLOCK = 5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("captured_steps")
    target_dir = make_tiny_target(root / "target", seed=5, num_layers=2, with_tokenizer=False)
    drafter_dir = make_tiny_dflash(root / "drafter", target_dir, seed=6, num_layers=1, block_size=BLOCK)
    return target_dir, drafter_dir


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (6, 3)]


def _generate(dirs, method: str, accept: str, temperature: float, compile: bool, budget: int = 6) -> list[list[int]]:
    """A ragged batch of two prompts on freshly loaded models (so every bucket is built, and traced, anew)."""
    target = load_target(dirs[0], torch.float32, "cpu")
    drafter = load_drafter(dirs[1], dtype=torch.float32)
    prompts = _prompts()
    configs = [ARSpecConfig(method=method, budget=budget, max_new_tokens=n, accept=accept,
                            sampling=SamplingConfig(temperature=temperature, seed=s))
               for n, s in zip((9, 6), (1, 2))]
    drafters = [None if method == "ar" else as_drafter(drafter) for _ in prompts]
    out = speculative_generate_batch(target, drafters, prompts, configs, compile=compile)
    if compile and method != "ar":
        assert static_drafter_of(drafter) is not None  # the drafter's block ran as a step too
    assert static_target_of(target) is not None or not compile
    return [r.tokens for r in out]


#: (method, rule, temperature): plain AR, DDTree's coupled walk greedy and sampled, DDTree's point-mass children and
#: the sampled drafts of the DFlash chain and SpecDiff-2 under the rejection rule (tracing takes seconds a case:
#: plain AR's fused round runs in the fast tier, the tree, drafter and walk variants in the slow tier)
CASES = [("ar", "coupled", 0.0), pytest.param("ddtree", "coupled", 0.0, marks=pytest.mark.slow),
         pytest.param("ddtree", "coupled", 0.8, marks=pytest.mark.slow),
         pytest.param("ddtree", "rejection", 0.8, marks=pytest.mark.slow),
         pytest.param("dflash", "rejection", 0.8, marks=pytest.mark.slow),
         pytest.param("specdiff", "rejection", 0.8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("method,accept,temperature", CASES)
def test_every_step_traces_as_one_graph(dirs, monkeypatch, method, accept, temperature):
    """Every bucket a ragged batch builds is traced whole (no value read back), and the tokens are eager's."""
    traced: list[Any] = []
    real = graphs_module._traced
    monkeypatch.setattr(graphs_module, "_traced", lambda step, key: traced.append(key) or real(step, key))
    eager = _generate(dirs, method, accept, temperature, compile=False)
    with trace_steps():
        captured = _generate(dirs, method, accept, temperature, compile=True)
    assert captured == eager
    rounds = [k for k in traced if isinstance(k, tuple) and k[0] == "round"]
    assert rounds, traced  # the fused round (verify + walk + commit) is a traced step
    plans = {k[4] for k in rounds}
    assert {p.rule for p in plans} == {"coupled" if temperature == 0 else accept}
    assert {p.sampled for p in plans} == {method in ("dflash", "specdiff") and accept == "rejection"}
    if method != "ar":
        assert any(isinstance(k, tuple) and len(k) == 2 for k in traced), traced  # the drafter's (rows, block)
    trees = [k for k in traced if isinstance(k, tuple) and k[0] == "tree"]
    # every tree is built in a step of its own: DDTree's, and the drafts sampled from the drafter (DFlash's chain
    # under the rejection rule, SpecDiff-2's joint drafts: drawn, merged and their proposals handed to the walk)
    assert bool(trees) == (method != "ar"), traced
    kind = {"ddtree": "ddtree", "dflash": "sampled", "specdiff": "sampled"}.get(method)
    assert all(row[0] in (kind, "none") for k in trees for row in k[3].rows), traced


def test_a_host_read_or_a_data_dependent_shape_is_refused():
    """The trace check can fail: a step that reads a value back, or whose output shape depends on the data."""
    x = torch.tensor([3.0, 0.0, 1.0])
    steps = {"read": lambda: x * float(x.sum()), "nonzero": lambda: x.nonzero(),
             "branch": lambda: x if x[0] > 0 else -x, "pure": lambda: torch.where(x > 0, x, -x).cumsum(0)}
    graphs = StepGraphs(lambda key: steps[key], torch.device("cpu"))
    with trace_steps():
        for name in ("read", "nonzero", "branch"):
            with pytest.raises(StepNotCapturable, match=name):
                graphs.run(name)
        assert torch.equal(graphs.run("pure"), torch.tensor([3.0, 3.0, 4.0]))
    assert torch.equal(StepGraphs(lambda key: steps[key], torch.device("cpu")).run("read"), x * 4)  # not traced


def test_a_stateful_step_rehearsal_is_put_back():
    """A rehearsed recording at a bucket's second call (where a GPU records it) leaves a :class:`StatefulStep`'s
    state as the real run makes it."""
    state = torch.zeros(1)

    def make(key: Any) -> StatefulStep:
        def save():
            saved = state.clone()
            return lambda: state.copy_(saved)
        return StatefulStep(lambda: state.add_(1), save)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_module, "REHEARSE", True)
        graphs = StepGraphs(make, torch.device("cpu"))
        graphs.run("k")
        assert float(state) == 1.0
        graphs.run("k")
        assert float(state) == 2.0


def test_buckets_beyond_the_bound_are_dropped_least_recent_first():
    """At most ``max_buckets`` steps are kept: the least recently run goes first, is counted as dropped, and is built
    again (by its factory) when asked; the others keep their steps."""
    built: list = []

    def make(key: Any):
        built.append(key)
        return lambda: torch.tensor([float(key)])

    graphs = StepGraphs(make, torch.device("cpu"), max_buckets=2)
    with emulate_replays(False):  # (the count of recorded graphs below: none without a GPU or the emulation)
        for key in (1, 2, 1, 3):  # 2 is the least recently run when 3 comes
            assert float(graphs.run(key)) == key
        assert 1 in graphs and 3 in graphs and 2 not in graphs and graphs.stats.dropped == 1
        assert float(graphs.run(2)) == 2.0 and built == [1, 2, 3, 2] and 1 not in graphs
    assert graphs.stats.as_dict()["dropped"] == 2 and graphs.stats.as_dict()["graphs"] == 0  # nothing captured


def test_only_a_pools_first_recording_empties_the_allocator_cache(monkeypatch):
    """On CUDA a bucket's second call records it through ``torch.cuda.graph``, which empties the allocator's cache
    before it records: the first recording of a pool lets it, later ones keep the cache (buckets recorded
    mid-generation), and ``torch.cuda.empty_cache`` works again after each. No GPU here: the CUDA calls are stood in
    for by ones that do what the real ones do at the point that matters (``torch.cuda.graph`` empties on entry)."""
    emptied: list[int] = []

    class Capture:  # torch.cuda.graph's entry empties the cache, then records the block's kernels
        def __init__(self, graph: Any, pool: Any = None) -> None:
            self.pool = pool

        def __enter__(self) -> None:
            torch.cuda.empty_cache()

        def __exit__(self, *exc: Any) -> None:
            return None

    class Graph:
        def replay(self) -> None:
            return None

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    graphs = StepGraphs(lambda key: (lambda: torch.tensor([float(key)])), torch.device("cpu"))
    graphs.capture = True  # as on CUDA
    for key in (1, 1, 1, 2, 2, 3, 3, 3):
        assert float(graphs.run(key)) == key
    assert graphs.stats.captures == 3 and emptied == [1]
    torch.cuda.empty_cache()
    assert emptied == [1, 1]  # itself again after the recordings


@pytest.mark.parametrize("method,accept,temperature,budget", [
    ("ddtree", "coupled", 0.0, 6), ("ddtree", "coupled", 0.0, 2), ("ddtree", "rejection", 0.8, 6),
    ("dflash", "rejection", 0.8, 6), ("specdiff", "rejection", 0.8, 6), ("ar", "coupled", 0.8, 6)])
def test_a_capture_rehearsal_changes_nothing(dirs, monkeypatch, method, accept, temperature, budget):
    """Buckets rehearsing a recording at their second call (a GPU's capture) return the eager tokens (budget 2: a
    tree narrower than the draft is deep, so the commit moves past the verified window); the check can fail: with
    rehearsals that do not put the committed state back, the tokens change."""
    monkeypatch.setattr(graphs_module, "EMULATE_REPLAYS", False)  # the rehearsal, not the emulated replay
    eager = _generate(dirs, method, accept, temperature, compile=False, budget=budget)
    monkeypatch.setattr(graphs_module, "REHEARSE", True)
    assert _generate(dirs, method, accept, temperature, compile=True, budget=budget) == eager

    def careless(step):  # noqa: ANN001 - a rehearsal that forgets the state it changed
        step()

    monkeypatch.setattr(StepGraphs, "_rehearse", staticmethod(careless))
    assert _generate(dirs, method, accept, temperature, compile=True, budget=budget) != eager


def test_the_inductor_setting(dirs):
    """``compile="inductor"`` turns the captured path on with fused steps, on the CLI too; it is refused inside the
    batch-invariant mode (whose exact sums fused kernels would replace), by name."""
    cpu = torch.device("cpu")
    assert resolve_compile("inductor", cpu) and compile_fuses("inductor") and compile_fuses("Inductor")
    assert not any(compile_fuses(s) for s in (True, "on", None, "auto", False))
    assert build_parser().parse_args(["generate", "--model", "m", "--compile", "inductor"]).compile == "inductor"
    with batch_invariant(), pytest.raises(ConfigError, match="batch-invariant.*fix: pass compile=True"):
        compile_fuses("inductor")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="TorchInductor compiles C++ on a CPU: no compiler here")
def test_inductor_fused_steps_give_the_eager_tokens(dirs, monkeypatch):
    """Every step compiled by TorchInductor (fused C++ kernels on a CPU, what a GPU compiles to Triton) before it is
    captured: plain AR and DDTree give the eager tokens in float64 (fused kernels round differently; float64 leaves
    no near tie to flip) and the buckets report themselves fused."""
    compiled: list[Any] = []
    real = graphs_module._fused
    monkeypatch.setattr(graphs_module, "_fused", lambda step: compiled.append(step) or real(step))
    target = load_target(dirs[0], torch.float64, "cpu")
    drafter = load_drafter(dirs[1], dtype=torch.float64)
    prompt = _prompts()[0]
    for method in ("ar", "ddtree"):
        kw = {"method": method, "budget": 6, "max_new_tokens": 8}
        eager = ddtree_generate(target, drafter, prompt, compile=False, **kw)
        fused = ddtree_generate(target, drafter, prompt, compile="inductor", **kw)
        assert fused.tokens == eager.tokens and fused.acceptance_lengths == eager.acceptance_lengths, method
    stats = static_target_of(target).graphs.stats
    assert stats.fused and stats.as_dict()["fused"] and {k[0] for k in stats.runs} >= {"round", "tree"}
    drafting = static_drafter_of(drafter).graphs.stats
    # every bucket's step compiled: DDTree's target and drafter buckets (plain AR's went with its narrower target)
    assert drafting.fused and len(compiled) >= len(stats.runs) + len(drafting.runs)
