"""``spiffy bench overheads`` and what it relies on: the sync counter, bounded sync counts, the reuse of the
transition's softmax by Spiffy's ranking, the reference DDTree builder, and the command itself at tiny sizes.

Counts are exact integers (machine-independent); no wall-clock time is asserted.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from spiffy.arspec.tree import build_ddtree
from spiffy.bench.ddtree_reference import reference_build, reference_visibility
from spiffy.bench.overheads import ddtree_sync_counts, spiffy_models, spiffy_sync_counts
from spiffy.bench.synthetic import synthetic_session
from spiffy.bench.syncs import SyncCounter
from spiffy.cli.main import main
from spiffy.selfspec.runtime import speculative_generate


def test_sync_counter_counts_each_blocking_call_once():
    t = torch.tensor([1, 0, 3])
    with SyncCounter() as c:
        t.sum().item()
        t.tolist()
        bool(t.any())
        int(t[0])
        float(t[2])
        t.nonzero()
        t[t > 0]  # boolean mask index: a hidden nonzero
        torch.equal(t, t)
        t.to("cpu")
        t.cpu()
        _ = t + 1  # not a sync
        t[1:]  # not a sync
    assert dict(c.counts) == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "__float__": 1, "nonzero": 1,
                              "bool_index": 1, "equal": 1, "to_cpu": 1, "cpu": 1}
    assert c.total == 10


def test_spiffy_syncs_per_step_do_not_grow_with_budget_or_vocabulary():
    """On a model whose drafts are never accepted every step is one forward with the full drafting work; the
    generation's count is the same for D* = 1 and 5 and for two vocabulary sizes."""
    counts = {(v, b): spiffy_sync_counts(v, 16, 10, b)["spiffy"] for v in (2048, 4096) for b in (1, 5)}
    for c in counts.values():
        assert c["accepted"] == 0 and c["steps"] == c["forwards"] == 16
    totals = {key: c["total"] for key, c in counts.items()}
    assert len(set(totals.values())) == 1, totals
    assert len({json.dumps(c["by_call"]) for c in counts.values()}) == 1
    assert 0 < counts[(2048, 5)]["per_step"] < 20


def test_ddtree_syncs_per_round_do_not_grow_with_budget_or_vocabulary():
    rounds = [ddtree_sync_counts(v, 16, b) for v in (2048, 4096) for b in (16, 64, 256)]
    for r in rounds:
        assert r["nodes"] == r["budget"]
    # the builder takes one of two paths (a direct top-k: 2; the chunk bound: 5, or 3 before it gives up for the
    # direct top-k's 2), never more whatever the budget and the vocabulary; compile always the same
    assert {r["tree_build"] for r in rounds} <= {2, 4, 5}, rounds
    assert len({r["compile"] for r in rounds}) == 1, rounds
    # commit: one upload of the kept-row indices, skipped when the accepted rows already sit in place (data, not size)
    assert {r["commit"] for r in rounds} <= {0, 1}
    assert max(r["per_round"] for r in rounds) <= 5 + rounds[0]["compile"] + 1 < 20


class _SoftmaxCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("softmax", "_softmax", "log_softmax"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_spiffy_ranking_reuses_the_transition_softmax():
    """One softmax over the vocabulary per denoising step (the transition's), none for ranking, and the same tokens
    as when ranking computes its own softmax."""
    graph, models = spiffy_models(1024, 16, 10)
    model = models["drafts accepted"]
    runs = {}
    for reuse in (True, False):
        session = synthetic_session(model, 8, 16, 16)
        if not reuse:
            session.publish_probs = lambda *published: None
        with _SoftmaxCounter() as counter:
            stats = speculative_generate(session, graph, 5)
        runs[reuse] = (counter.calls, stats, session.x.clone())
    (calls, stats, x), (calls_own, stats_own, x_own) = runs[True], runs[False]
    assert stats.accepted_total > 0 and stats.forwards > 1
    assert calls == stats.steps
    ranked = calls_own - stats_own.steps  # forwards that ranked drafts (all but the first)
    assert ranked == stats_own.forwards - 1
    assert torch.equal(x, x_own) and stats.forwards == stats_own.forwards


def test_reference_builder_builds_the_same_tree():
    """The re-expressed reference and spiffy's builder choose the same node set on identical logits (distinct
    scores), and the reference's visibility matrix is the ancestor relation."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 3
    for budget in (1, 7, 40, 200):
        ref = reference_build(logits, budget)
        ours = build_ddtree(torch.log_softmax(logits, dim=-1), budget)
        paths: list[tuple[int, ...]] = []
        for tok, par in zip(ours.tokens.tolist(), ours.parents.tolist()):
            paths.append((paths[par] if par >= 0 else ()) + (tok,))
        assert ref.sequences() == set(paths)
        vis = reference_visibility(ref)
        assert vis.shape == (budget + 1, budget + 1) and vis.diagonal().all() and vis[:, 0].all()
        assert int(vis.sum()) == 1 + sum(int(d) + 1 for d in ref.depths.tolist())


def test_bench_overheads_command_tiny(tmp_path):
    out = tmp_path / "ovh"
    rc = main(["bench", "overheads", "--vocab", "4096", "--budgets", "16,32", "--repeats", "1", "--out", str(out),
               "--no-memory", "--no-plots", "--no-steady-allocator", "--ar-tokens", "5"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert res["threads"] == 1 and res["spiffy"]["vocab"] == 4096 and res["ddtree"]["vocab"] == 4096
    for row in res["spiffy"]["scenarios"]:
        assert row["spiffy"]["identical_to_baseline"] and row["spiffy"]["steps"] == 32
        assert math.isfinite(row["ratio_per_step"]) and row["spiffy"]["stage_ms_per_forward"]["rank"] > 0
    never = res["spiffy"]["scenarios"][0]
    assert never["scenario"] == "nothing accepted" and never["spiffy"]["forwards"] == 32
    assert [r["budget"] for r in res["ddtree"]["rows"]] == [16, 32]
    assert all(r["nodes"] == r["budget"] and r["tree_build_ms"] > 0 for r in res["ddtree"]["rows"])
    assert [r["per_round"] for r in res["syncs"]["ddtree"]] == [res["syncs"]["ddtree"][0]["per_round"]] * 2
    assert "## DDTree" in md and "| 32 |" in md and "nothing accepted" in md
    builders = res["builders"]["rows"]
    assert [(r["vocab"], r["logits"], r["budget"]) for r in builders] == [
        (4096, kind, b) for kind in ("peaked", "flat") for b in (16, 32)]
    assert all(r["same_tree"] and r["nodes"] == r["budget"] and r["total_speedup"] > 0 for r in builders)
    ar = res["ar"]
    assert ar["identical"] and ar["tokens"] == 5
    assert [r["variant"] for r in ar["rows"]] == ["bare loop", "spiffy ar", "spiffy ar, tree stages forced"]
    assert "builder and compile vs the reference" in md and "| spiffy ar | " in md


@pytest.mark.slow
def test_bench_overheads_memory_on_the_embedded_models():
    from spiffy.bench.memory import measure_memory

    mem = measure_memory(5, [16, 64])
    rows = {r["case"]: r for r in mem["rows"]}
    assert not mem["missing"] and len(rows) == 5
    none = rows["Spiffy, cache none, 1 + 5 states"]
    assert none["speculative_bytes"] > none["baseline_bytes"] > 0  # six full sequences vs one
    assert rows["DDTree, budget 64 (AR: 1 row)"]["speculative_bytes"] >= rows["DDTree, budget 16 (AR: 1 row)"]["speculative_bytes"]


def test_reference_compiler_lays_out_what_compile_round_does():
    """The re-expressed reference compile (buffers reused across rounds, the last tree block reset) gives the same
    ids, positions and visible mask entries as spiffy's compile_round on the same tree, round after round."""
    from spiffy.arspec.stages import RoundBuffers, compile_round
    from spiffy.arspec.tree import build_ddtree
    from spiffy.bench.ddtree_reference import ReferenceCompiler

    g = torch.Generator().manual_seed(5)
    compiler = ReferenceCompiler(24, 64)
    context = 10
    for budget in (24, 5, 17):
        logits = torch.randn(5, 200, generator=g) * 2
        ref = reference_build(logits, budget)
        ids, pos, mask = compiler.compile(7, context, ref, reference_visibility(ref))
        ours = build_ddtree(torch.log_softmax(logits, dim=-1), budget)
        compiled, _rows = compile_round([ours], [(7, context)], torch.ones(1, context, dtype=torch.bool),
                                        torch.float32, RoundBuffers.allocate(1, 1 + budget))
        # the two builders number equal trees alike here (distinct scores: the same pop order)
        assert torch.equal(ids, compiled.input_ids) and torch.equal(pos, compiled.position_ids)
        assert torch.equal(mask == 0, compiled.attention_mask == 0)
        context += 3
