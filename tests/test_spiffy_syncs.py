"""Host synchronisations per Spiffy step on the real families' tiny models, on the static path (SPEC section 14: at
most two per step; issue 37).

The static path (``use_static()``, ``compile=True``) is what runs on a GPU. Each case decodes a prompt with Spiffy on
a random draft graph (its drafts are rarely accepted: nearly every step is a drafting step followed by one forward,
the most reads per step) at ``D* = 1, 5, 12`` and counts what :class:`~spiffy.bench.syncs.SyncCounter` sees, over
the whole generation, per denoising step. Left out: ``to_cpu``, the models' own ``.to(device)`` moves, which the
counter counts on a CPU run because every device *is* the CPU there; on a GPU the tensors are already on the device
the model runs on and the moves are no-ops (tests/test_captured_dllm.py::test_static_forward_makes_no_host_sync does
the same for the forward alone).

What is left per step: one read of the step's ranking (its tables, the masked count, and the rule's counts of the
state), one read per walk step (its match flags and the new state's counts), and what a rule reads once per block
or generation (LLaDA's static schedule; the first block's masked counts). The rules take their masked counts from
those reads (:meth:`~spiffy.decoding.session.DecodeSession.masked_counts`), so their transitions and block-end checks
read nothing themselves. Fast-dLLM v2's rule (its sub-block choice, threshold step and stop test) runs on the device
as one program over rows; the stop hits travel with the counts.
"""

from __future__ import annotations

import pytest
import torch

from batch_cases import dream, fast_dllm_v2, llada, sdar  # noqa: F401 - fixtures
from spiffy.bench.syncs import SyncCounter
from spiffy.decoding import make_session
from spiffy.decoding.batch import run_baseline
from spiffy.selfspec.freedave import freedave_graph
from spiffy.selfspec.oracle import random_graph
from spiffy.selfspec.runtime import speculative_generate
from spiffy.selfspec.ssd import ssd_graph

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

GEN, BLOCK = 16, 8
BUDGETS = (1, 5, 12)
#: (rule, cache) per family, every cache mode with a static path: LLaDA and Dream under their static schedule and
#: Fast-dLLM's threshold rule (Dream also under its ``origin`` algorithm); SDAR's committed cache under its static and dynamic strategies, and with a stop id
#: (its stop rule reads the state at every block end); Fast-dLLM v2's threshold rule in sub-blocks on its prefix
#: cache, without and with a stop id (one the baseline generates in its second block: generation stops there)
CASES = {
    "llada": [(r, c) for r in ("static", "threshold") for c in ("none", "prefix", "dual")],
    "dream": [(r, c) for r in ("static", "threshold", "origin") for c in ("none", "prefix", "dual")],
    "sdar": [("static", "prefix"), ("dynamic", "prefix"), ("stop", "prefix")],
    "fast_dllm_v2": [("threshold", "prefix"), ("stop", "prefix")],
}


def _kw(family: str, rule: str, cache: str, model, prompt: torch.Tensor) -> dict:
    """The case's ``generate`` kwargs (Fast-dLLM v2's stop id: a token ``model`` generates for ``prompt``)."""
    if family == "fast_dllm_v2":
        # sub-blocks of 4; at 0.0125 the tiny model's step unmasks 1 to 3 positions (its top probability ~0.01-0.015)
        kw = dict(gen_length=GEN, block_length=BLOCK, small_block_size=4, threshold=0.0125, cache=cache,
                  temperature=0.0, seed=0, stop_token_ids=())
        if rule == "stop":
            free = make_session(model, prompt[None], **kw)
            run_baseline(free)
            start = free.block_bounds(1)[0]
            kw["stop_token_ids"] = (int(free.x[0, start + 2]),)  # a token of the second block: a stop is reached
        return kw
    kw = dict(gen_length=GEN, block_length=BLOCK, cache=cache, temperature=0.0, seed=0)
    if rule == "threshold":
        kw["threshold"] = 0.05
    else:
        kw["steps"] = GEN // 2
    if rule == "dynamic":
        kw.update(strategy="low_confidence_dynamic", threshold=0.05)
    if rule == "origin":  # Dream's random reveal (greedy tokens: its sampled proposals read the revealed count)
        kw["alg"] = "origin"
    if rule == "stop":
        kw["stop_token_ids"] = (7,)
    return kw


def syncs_per_step(model, prompt: torch.Tensor, kw: dict, graph, budget: int) -> tuple[float, dict, torch.Tensor]:
    """``(syncs per step, {call: count} without to_cpu, final state [1, T])`` of one static-path Spiffy run."""
    session = make_session(model, prompt[None], **kw)
    session.use_static()
    with SyncCounter() as counter:
        stats = speculative_generate(session, graph, budget)
    counts = {k: v for k, v in counter.counts.items() if k != "to_cpu"}
    return sum(counts.values()) / stats.steps, counts, session.x


@pytest.mark.parametrize("family", sorted(CASES))
def test_spiffy_step_syncs_on_tiny_models(request, family: str) -> None:
    """At most 2 host reads per Spiffy step, at D* = 1, 5 and 12, in every case of the family, each read a
    ``tolist`` (no ``.item()``, boolean index or ``bool(tensor)`` left in the step); the tokens are the eager
    baseline's. Before this test: LLaDA's threshold rule about 5.5 per step, Dream 4.5 to 8.7, SDAR 3.8 to 4.6
    (static schedules of LLaDA: 1.0 to 1.9 already); Fast-dLLM v2 (eager: it had no static path) 7.5 without a stop
    id and 10.0 with one."""
    model = request.getfixturevalue(family)
    prompt = torch.randint(5, 250, (5,), generator=torch.Generator().manual_seed(0))
    graph = random_graph(4, 16, seed=1, i_max=6, j_max=3)
    for rule, cache in CASES[family]:
        kw = _kw(family, rule, cache, model, prompt)
        baseline = make_session(model, prompt[None], **kw)
        run_baseline(baseline)
        for budget in BUDGETS:
            per_step, counts, x = syncs_per_step(model, prompt, kw, graph, budget)
            assert per_step <= 2 and set(counts) == {"tolist"}, (rule, cache, budget, per_step, counts)
            assert torch.equal(x, baseline.x), (rule, cache, budget)


@pytest.mark.parametrize("family", sorted(CASES))
def test_rivals_step_syncs_on_tiny_models(request, family: str) -> None:
    """FreeDave and SSD run on Spiffy's runtime as fixed graphs (a chain, SSD's path below the real state), so they are
    measured at their best too: at most 2 host reads per step at 3 and 6 states per forward, on the family's first
    and last case, with the baseline's tokens."""
    model = request.getfixturevalue(family)
    prompt = torch.randint(5, 250, (5,), generator=torch.Generator().manual_seed(2))
    for rule, cache in (CASES[family][0], CASES[family][-1]):
        kw = _kw(family, rule, cache, model, prompt)
        baseline = make_session(model, prompt[None], **kw)
        run_baseline(baseline)
        for make in (freedave_graph, ssd_graph):
            for states in (3, 6):
                graph = make(model, baseline.config, states)
                per_step, counts, x = syncs_per_step(model, prompt, kw, graph, len(graph))
                where = (make.__name__, states, rule, cache)
                assert per_step <= 2 and set(counts) == {"tolist"}, (*where, per_step, counts)
                assert torch.equal(x, baseline.x), where


@pytest.mark.parametrize("family", sorted(CASES))
def test_spiffy_under_inference_mode_equals_no_grad(request, family: str) -> None:
    """Inference tensors carry no version counter, so the host copy of the counts is not reused there (a read more
    per step): the run still works and decodes the same tokens as under ``no_grad``."""
    model = request.getfixturevalue(family)
    prompt = torch.randint(5, 250, (5,), generator=torch.Generator().manual_seed(0))
    graph = random_graph(4, 16, seed=1, i_max=6, j_max=3)
    rule, cache = CASES[family][-1]
    states, inference = [], []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            session = make_session(model, prompt[None], **_kw(family, rule, cache, model, prompt))
            session.use_static()
            speculative_generate(session, graph, 5)
        states.append(session.x)
        inference.append(session.x.is_inference())
    assert torch.equal(states[0], states[1])
    assert inference == [False, True]  # the second run really ran on inference tensors
