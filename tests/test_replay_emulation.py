"""A CUDA graph's replay emulated on a CPU (:mod:`spiffy.capture.replay`): the emulation has a graph's semantics, and
the captured paths give eager's tokens under it.

A replay runs the recorded kernels only: Python values the step read are frozen at the recording, a tensor the host
rebinds afterwards is never read, the outputs are the same tensors at every replay, and a graph recorded earlier in
the same pool may overwrite them. The first tests show the
emulation has exactly those properties (each is a way a step can be right eagerly and wrong on a GPU); the others run
the captured AR and dLLM paths under it against eager, and show one such bug it found (a DFlash drafter reading the
target's layer outputs through hooks that a replay does not run) fixed, and caught when put back.
"""

from __future__ import annotations

import pytest
import torch

from batch_cases import dream, llada, sdar  # noqa: F401 - fixtures
import spiffy.capture.graphs as graphs_module
from spiffy.api import generate
from spiffy.arspec import ARSpecConfig, SamplingConfig, as_drafter
from spiffy.arspec.batch import speculative_generate_batch
from spiffy.arspec.captured import StaticTarget
from spiffy.capture import StatefulStep, StepGraphs, emulate_replays
from spiffy.capture.replay import RecordedStep
from spiffy.models import load_ar_drafter, load_target, make_tiny_dflash, make_tiny_target
from spiffy.selfspec.freedave import freedave_graph

CPU = torch.device("cpu")


def _graphs(step) -> StepGraphs:  # noqa: ANN001
    return StepGraphs(lambda key: step, CPU)


def test_a_python_value_is_frozen_at_the_recording():
    """The first call runs eagerly, the second records (the Python runs once more), every later call replays: a
    Python number the step read stays what it was at the recording, as on a GPU."""
    scale = {"k": 1.0}
    x = torch.ones(2)
    graphs = _graphs(lambda: x * scale["k"])
    with emulate_replays():
        assert float(graphs.run("a")[0]) == 1.0  # eager
        scale["k"] = 2.0
        assert float(graphs.run("a")[0]) == 2.0  # recorded now
        scale["k"] = 3.0
        assert float(graphs.run("a")[0]) == 2.0  # replayed: frozen
        x.fill_(5.0)
        assert float(graphs.run("a")[0]) == 10.0  # a buffer written in place is read
    assert graphs.stats.captures == 1


def test_the_call_that_records_is_a_knob(monkeypatch):
    """``RECORD_AT_CALL`` = 3: the first two calls run the step (its Python too), the third records, later ones
    replay (a bucket called twice is then never recorded)."""
    monkeypatch.setattr(graphs_module, "RECORD_AT_CALL", 3)
    scale = {"k": 1.0}
    x = torch.ones(1)
    graphs = _graphs(lambda: x * scale["k"])
    seen = []
    with emulate_replays():
        for k in (1.0, 2.0, 3.0, 4.0):
            scale["k"] = k
            seen.append(float(graphs.run("a")[0]))
    assert seen == [1.0, 2.0, 3.0, 3.0] and graphs.stats.captures == 1


def test_a_rebound_tensor_is_not_read_and_outputs_are_overwritten():
    """A tensor the host rebinds after the recording is not what a replay reads (it reads the recorded one), and a
    replay's outputs are the same tensor every call, overwritten by the next."""
    holder = {"x": torch.ones(3)}
    graphs = _graphs(lambda: holder["x"] + 1)
    with emulate_replays():
        graphs.run("a")
        recorded = graphs.run("a")
        holder["x"] = torch.full((3,), 7.0)  # rebound: the eager step would read it
        again = graphs.run("a")
        assert again is recorded and float(again[0]) == 2.0
        before = recorded.clone()
        graphs.run("a")
        assert torch.equal(recorded, before)


def test_views_in_place_writes_and_uninitialised_memory_replay_as_recorded():
    """Views and in-place operations act on the recorded tensors themselves (a buffer the step writes is written at
    every replay); memory a step takes uninitialised keeps what the last replay left (a graph does not refill it)."""
    state = torch.zeros(4)
    step = StatefulStep(lambda: state[1:3].add_(1.0), lambda: (lambda saved=state.clone(): state.copy_(saved)))
    graphs = StepGraphs(lambda key: step, CPU)
    with emulate_replays():
        graphs.run("a")  # eager: +1
        graphs.run("a")  # recorded (its run put back), replayed: +1
        graphs.run("a")  # replayed: +1
    assert state.tolist() == [0.0, 3.0, 3.0, 0.0]
    scratch = RecordedStep(lambda: torch.empty(3).fill_(4.0) + torch.arange(3.0))
    assert scratch.replay().tolist() == [4.0, 5.0, 6.0]


def test_outputs_of_a_later_recording_are_clobbered_by_an_earlier_ones_replay():
    """One pool for a StepGraphs' graphs: a graph recorded earlier may use, when it replays, scratch memory that a
    later recording took for its outputs (it was free then). The emulation overwrites a later bucket's outputs when
    an earlier one replays, so a caller that reads outputs after another bucket's replay reads garbage, as it might
    on a GPU; outputs read in time, and an earlier bucket's outputs after a later one's replay, are intact."""
    x = torch.arange(3.0)
    steps = {"early": lambda: x * 2, "late": lambda: x + 10}
    graphs = StepGraphs(lambda key: steps[key], CPU)
    with emulate_replays():
        for _ in range(2):  # built, then recorded: "early" first
            graphs.run("early")
            graphs.run("late")
        late = graphs.run("late")
        assert late.tolist() == [10.0, 11.0, 12.0]
        early = graphs.run("early")
        assert torch.isnan(late).all() and early.tolist() == [0.0, 2.0, 4.0]
        graphs.run("late")
        assert early.tolist() == [0.0, 2.0, 4.0]


def test_compiled_and_unrecordable_steps_run_as_they_are():
    """A step a GPU would not capture (``unrecordable``: e.g. experts looped over on the host) is not emulated: its
    Python runs at every call, and its outputs are not a replay's."""
    scale = {"k": 1.0}
    x = torch.ones(2)
    graphs = StepGraphs(lambda key: (lambda: x * scale["k"]), CPU, unrecordable="per-expert loop")
    with emulate_replays():
        graphs.run("a")
        graphs.run("a")
        scale["k"] = 3.0
        assert float(graphs.run("a")[0]) == 3.0 and not graphs.replays
    assert graphs.stats.captures == 0


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    target = make_tiny_target(root / "target", seed=3, num_layers=2, with_tokenizer=False)
    return target, make_tiny_dflash(root / "drafter", target, seed=4, num_layers=1, block_size=4)


def _batches(pair_dirs, methods: list[str], accept: str, temperature: float) -> list:
    """Three generations (two rows, one, two again: buckets of the same steps recorded apart, then replayed in turn),
    with the captured steps run eagerly and replayed as a GPU replays them: ``[plain, replayed]``."""
    runs = []
    for emulate in (False, True):
        target = load_target(pair_dirs[0], torch.float64, "cpu")
        drafter = load_ar_drafter(pair_dirs[1], dtype=torch.float64)
        out = []
        with emulate_replays(emulate):
            for prompts in ([[3, 1, 4, 1], [5, 9, 2]], [[2, 7]], [[6, 5, 3], [5, 8, 9, 7, 9]]):
                configs = [ARSpecConfig(method=m, budget=6, max_new_tokens=10, accept=accept,
                                        sampling=SamplingConfig(temperature=temperature, seed=i))
                           for i, m in enumerate(methods[: len(prompts)])]
                drafters = [None if m == "ar" else as_drafter(drafter) for m in methods[: len(prompts)]]
                res = speculative_generate_batch(target, drafters, prompts, configs, compile=True)
                out.append([(r.tokens, r.acceptance_lengths) for r in res])
        runs.append(out)
    return runs


@pytest.mark.parametrize("methods,accept,temperature", [
    (["ddtree", "dflash"], "coupled", 0.0), (["dflash", "ddtree"], "rejection", 0.9),
    (["ar", "ddtree"], "coupled", 0.7)])
def test_captured_ar_rows_equal_eager_under_replays(pair_dirs, methods, accept, temperature):
    """The captured AR path, its buckets replayed as a GPU replays them (rows of two batch sizes in turn: buckets of
    the same steps recorded apart), gives the tokens and acceptance lengths of its own eager-step run."""
    plain, replayed = _batches(pair_dirs, methods, accept, temperature)
    assert replayed == plain


def test_the_layer_features_hooks_bug_is_caught(pair_dirs, monkeypatch):
    """The bug the emulation found: a DFlash drafter drafts from the target layers' outputs, which hooks record when
    the step's Python runs; a replay runs no hook, so they held the outputs of whichever bucket was recorded last.
    The verification step now returns them and the host points the hooks at the replayed ones. Without that, the
    emulated run drafts from another bucket's features (or fails on their shape)."""
    monkeypatch.setattr(StaticTarget, "_hold_features", lambda self, features: None)
    try:
        plain, replayed = _batches(pair_dirs, ["dflash", "dflash"], "coupled", 0.0)
    except (IndexError, RuntimeError):
        return
    assert replayed != plain


@pytest.mark.parametrize("family,cache", [("llada", "prefix"), ("dream", "dual"), ("sdar", "prefix")])
def test_captured_dllm_forwards_equal_eager_under_replays(request, family, cache):
    """The dLLM static forwards (a dual cache's window start as data, LLaDA's and Dream's refresh) replayed as a GPU
    replays them: FreeDave's tokens and forward counts are eager's, over two prompts of one length (their buckets
    shared)."""
    model = request.getfixturevalue(family)
    kw = dict(gen_length=16, block_length=8, steps=16, cache=cache) if family != "sdar" else dict(
        gen_length=16, block_length=8, steps=16)
    graph = freedave_graph(model, None, 3, **kw)
    for prompt in (torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 3, 8, 2, 40]])):
        eager = generate(model, prompt, graph=graph, compile=False, **kw)
        with emulate_replays():
            replayed = generate(model, prompt, graph=graph, compile=True, **kw)
        assert replayed.tokens == eager.tokens and replayed.nfe == eager.nfe
