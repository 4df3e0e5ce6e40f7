"""The one dLLM loop (spiffy.decoding.batch.decode_blocks) and the family registry it builds sessions from.

* A single prompt is the batch of one: the session makes every model call on its own state, with the shapes the
  session alone makes (no padding, no row gather), for the baseline and for Spiffy.
* The loop is bounded: a rule that never finishes a block ends in a typed error, not a hang.
* Bad layouts are refused; an observer is refused for several rows.
* A family added by one registry entry (the LLaDA rule under another model type) decodes like LLaDA.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from batch_cases import BLOCK, GEN, dream, llada, sdar  # noqa: F401 - module fixtures
from batch_cases import ragged_prompts
from spiffy.api import generate
from spiffy.decoding import make_session, run_baseline, run_baseline_batch
from spiffy.decoding.factory import SESSIONS, make_row_sessions, session_class
from spiffy.errors import ConfigError, DecodingError, UnknownModelTypeError
from spiffy.models.llada import LLaDAConfig, LLaDAModelLM
from spiffy.models.registry import FAMILIES, decoded_families, family_of_model_type
from spiffy.selfspec.oracle import oracle_graph
from spiffy.selfspec.runtime import speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def _record_forwards(session, calls: list) -> None:
    """Wrap ``session.forward_states`` to record ``(states is session.x, states shape, rows)`` of every call."""
    inner = session.forward_states

    def recorded(states, rows=None):
        calls.append((states is session.x, tuple(states.shape), rows))
        return inner(states, rows)

    session.forward_states = recorded


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_a_single_prompt_makes_the_calls_of_the_session_alone(family, request) -> None:
    """Baseline: every step forwards the session's own state (the same tensor), batch 1, no row index. Spiffy: the
    real state plus drafts, no row index. NFE counts the calls."""
    model = request.getfixturevalue(family)
    prompt = ragged_prompts([6])[0][None]
    kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN, cache="prefix")
    s = make_session(model, prompt, **kw)
    calls: list = []
    _record_forwards(s, calls)
    stats = run_baseline(s)
    assert calls and all(same and shape == (1, s.x.shape[1]) and rows is None for same, shape, rows in calls)
    assert stats.nfe == s.nfe and stats.steps == sum(stats.steps_per_block)
    graph = oracle_graph(make_session(model, prompt, **kw))
    s = make_session(model, prompt, **kw)
    calls = []
    _record_forwards(s, calls)
    spec = speculative_generate(s, graph, len(graph.nodes))
    assert spec.accepted_total > 0 and any(shape[0] > 1 for _, shape, _ in calls)
    assert all(rows is None and shape[1] == s.x.shape[1] for _, shape, rows in calls)
    assert spec.nfe == s.nfe and spec.baseline_equivalent_nfe == stats.nfe


def test_a_batch_makes_one_call_per_iteration_for_every_row(llada) -> None:
    """Rows of a batch share each forward: the forward session is called with the row index of every state."""
    prompts = ragged_prompts([4, 7])
    ids = torch.zeros((2, 7), dtype=torch.long)
    am = torch.zeros((2, 7), dtype=torch.long)
    for r, x in enumerate(prompts):
        ids[r, 7 - len(x) :], am[r, 7 - len(x) :] = x, 1
    kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN)
    fwd = make_session(llada, ids, attention_mask=am, **kw)
    rows = make_row_sessions(llada, ids, am, fwd.config, [None, None])
    calls: list = []
    _record_forwards(fwd, calls)
    stats, nfe = run_baseline_batch(fwd, rows)
    assert nfe == len(calls) == GEN and all(r is not None and r.tolist() == [0, 1] for _, _, r in calls)
    for x, row, st in zip(prompts, rows, stats):
        alone = make_session(llada, x[None], **kw)
        assert run_baseline(alone).nfe == st.nfe and torch.equal(alone.x, row.x)


def test_a_block_the_rule_never_finishes_is_an_error_not_a_hang(llada) -> None:
    s = make_session(llada, ragged_prompts([5])[0][None], gen_length=GEN, block_length=BLOCK, threshold=0.9)
    s.block_finished = lambda block, step, x: False  # a rule that never ends its block
    with pytest.raises(DecodingError, match="still unfinished after 32 steps"):
        run_baseline(s)
    assert s.max_block_steps() == 4 * BLOCK


def test_layouts_and_observers_are_checked(llada) -> None:
    prompts = ragged_prompts([5, 5])
    ids = torch.stack(prompts)
    fwd = make_session(llada, ids, gen_length=GEN, block_length=BLOCK)
    rows = make_row_sessions(llada, ids, None, fwd.config, [None, None])
    with pytest.raises(ConfigError, match="observer"):
        run_baseline_batch(fwd, rows, observer=lambda record: None)
    with pytest.raises(ConfigError, match="one row session per prompt"):
        run_baseline_batch(fwd, rows[:1])
    with pytest.raises(ConfigError, match="batch-1 session of its own"):
        run_baseline_batch(fwd, [fwd, rows[1]])
    other = make_row_sessions(llada, ids.flip(0), None, fwd.config, [None, None])
    with pytest.raises(ConfigError, match="prompt differs"):
        run_baseline_batch(fwd, other)
    with pytest.raises(ConfigError, match="batch-1"):
        speculative_generate(fwd, None)


def test_the_decoding_rules_are_the_registry_entries() -> None:
    """Every decoded family names a rule of SESSIONS, every rule decodes a family; AR families are refused."""
    assert {spec.decoder for spec in decoded_families().values()} == set(SESSIONS)
    for name, spec in decoded_families().items():
        cls = session_class(name)
        assert cls.rule == spec.decoder and cls.config_class.__name__.endswith("DecodeConfig")
    with pytest.raises(UnknownModelTypeError, match="diffusion LM"):
        session_class("qwen3")
    assert family_of_model_type("dream") == family_of_model_type("Dream") == "dream"
    assert family_of_model_type("qwen3") == "qwen3" and family_of_model_type("gpt2") is None


class _CloneLM(LLaDAModelLM):
    """A model class no registry entry names (so the family comes from its config's model type)."""


class _CloneConfig(LLaDAConfig):
    model_type = "llada_clone"


def test_a_family_is_one_registry_entry(llada, monkeypatch) -> None:
    """A new entry (LLaDA's rule and tokens under another model type) is all it takes to decode a model."""
    monkeypatch.setitem(FAMILIES, "llada_clone", dataclasses.replace(FAMILIES["llada"], name="llada_clone",
                                                                     model_type="llada_clone", auto_map={}))
    clone = copy.deepcopy(llada)
    clone.__class__ = _CloneLM
    clone.config.__class__ = _CloneConfig
    prompt = ragged_prompts([6])[0][None]
    kw = dict(gen_length=GEN, block_length=BLOCK, steps=GEN, temperature=0.7, seed=3)
    got = generate(clone, prompt, **kw)
    assert got.family == "llada_clone"
    assert got.tokens == generate(llada, prompt, **kw).tokens
    assert got.stats["nfe"] == GEN
