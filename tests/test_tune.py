"""Tuning a graph for D* (spiffy.selfspec.tune): the replayed pruning equals the runtime, candidate choice, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_f64

from spiffy.bench.datasets import held_out_from, load_benchmark_prompts
from spiffy.cli.main import main
from spiffy.decoding import DecodeConfig, make_session, run_baseline
from spiffy.embedded import embedded_graph_path, embedded_model_path
from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.chains import Chain, Trajectory
from spiffy.selfspec.freedave import freedave_graph
from spiffy.selfspec.graph import DraftGraph, load_graph
from spiffy.selfspec.pruning import DEFAULT_BUDGET, resolve_budget
from spiffy.selfspec.prompts import prompt_token_ids
from spiffy.selfspec.runtime import speculative_generate
from spiffy.selfspec.select import project
from spiffy.selfspec.tune import (
    CLEARLY_MORE_LEVEL,
    clearly_more,
    paired_p_value,
    project_at_budget,
    tune_for_budget,
)

PROMPTS = ["def add(a, b):", "The sum of 2 and 3 is", "import os\nprint(", "for i in range("]
A, B, AB, BA2 = ((1, 1),), ((2, 1),), ((1, 1), (2, 1)), ((1, 2), (2, 1))


def _traj(chains: dict[int, tuple], probs: dict[int, list[list[float]]], steps: int = 6, prompt: int = 0) -> Trajectory:
    return Trajectory(
        prompt=prompt, nfe=steps, num_steps=steps, blocks=[0] * steps,
        chains={n: Chain(prompt, n, 0, n, fs) for n, fs in chains.items()},
        probs={n: torch.tensor(p, dtype=torch.float64) for n, p in probs.items()},
    )


def _prompts(chains: dict[int, tuple], probs: dict[int, list[list[float]]], steps: int,
             count: int = 6) -> tuple[list[Chain], list[Trajectory]]:
    """``count`` calibration prompts that each decode as ``chains`` (enough for the paired test to reach 0.05)."""
    trajs = [_traj(chains, probs, steps, prompt=k) for k in range(count)]
    return [t.chains[n] for t in trajs for n in sorted(t.chains)], trajs


def test_project_at_budget_by_hand() -> None:
    g = DraftGraph.from_formulas([(1, A), (1, B), (2, AB)], counts=[10, 1, 9])
    confident_second = [[0.5, 0.4], [0.9, 0.05]]  # position 2 more certain than position 1's top token
    traj = _traj({1: (A, AB), 4: (B,)}, {1: confident_second, 4: confident_second})
    # budget 1: the product keeps B (0.9 > 0.5) at both steps: step 1 accepts nothing, step 4 accepts B
    one = project_at_budget([traj], g, 1, "product")
    assert one["saved_forwards"] == 1 and one["accepted_per_level"] == [1] and one["walks"] == 2
    # count keeps A then AB: step 1 accepts A, AB (pays steps 1-3), step 4 accepts nothing
    two = project_at_budget([traj], g, 2, "count")
    assert two["saved_forwards"] == 2 and two["accepted_per_level"] == [1, 1]
    assert two["projected_nfe"] == 4 and two["reduction"] == pytest.approx(6 / 4)
    # with every node kept the replay is the calibration's ceiling
    assert project_at_budget([traj], g, 3, "gm")["saved_forwards"] == project([traj], g)["saved_forwards"] == 3
    assert project_at_budget([traj], g, 0, "gm")["saved_forwards"] == 0
    with pytest.raises(ConfigError, match="no ranking probabilities"):
        project_at_budget([_traj({1: (A,)}, {})], g, 1, "gm")
    with pytest.raises(ConfigError, match="unknown pruning score"):
        project_at_budget([traj], g, 1, "nope")


def test_clearly_more_is_a_one_sided_signed_rank_test() -> None:
    # exact one-sided p-values of Wilcoxon's signed-rank test: n prompts all in favour give 2**-n
    assert paired_p_value([10] * 6, [9] * 6) == pytest.approx(1 / 64) and clearly_more([10] * 6, [9] * 6)
    assert paired_p_value([12, 20, 31, 40, 9], [10, 19, 30, 38, 8]) == pytest.approx(1 / 32)
    assert clearly_more([12, 20, 31, 40, 9], [10, 19, 30, 38, 8])
    # fewer than 5 prompts can never reach the level 0.05: the chain is kept
    assert CLEARLY_MORE_LEVEL == 0.05
    assert paired_p_value([12, 20, 31, 40], [10, 19, 30, 38]) == pytest.approx(1 / 16)
    assert not clearly_more([12, 20, 31, 40], [10, 19, 30, 38]) and not clearly_more([3], [2])
    assert paired_p_value([10, 0, 10], [9, 1, 9]) == pytest.approx(0.5)  # +1, -1, +1
    # a windfall on a few prompts is not a consistent gain: +30 on 4 of 10 prompts, -1 on the other 6
    assert not clearly_more([31] * 4 + [0] * 6, [1] * 4 + [1] * 6)
    # prompts that save the same are left out; none differing: no evidence at all
    assert paired_p_value([5, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 12]) == pytest.approx(1 / 32)
    assert paired_p_value([5, 5], [5, 5]) == 1.0 and paired_p_value([], []) == 1.0
    assert not clearly_more([5, 5], [5, 5]) and not clearly_more([], [])
    assert not clearly_more([9] * 6, [10] * 6)  # one-sided: saving less is never clearly more
    with pytest.raises(ValueError, match="one value per prompt"):
        paired_p_value([1, 2], [1])


def test_tune_prefers_the_candidate_that_saves_most() -> None:
    # two steps go A then AB, one goes B: with 2 nodes the default shape is {A, AB}; at D* = 1 only its A can be kept,
    # while the shape capped at lookahead 1 holds A and B and the reach score drafts B where position 2 is certain
    # (six prompts that decode alike: the paired test then rejects "no more than the chain" at p = 1/64)
    chains = {0: (A, AB), 3: (A, AB), 6: (B,)}
    first, second = [[0.9, 0.05], [0.1, 0.05]], [[0.1, 0.05], [0.9, 0.05]]
    chain_list, trajs = _prompts(chains, {0: first, 3: first, 6: second}, steps=8)
    meta = {"calibrated_for": {"tokens_per_step": 1}}
    g = tune_for_budget(chain_list, trajs, 1, nodes=2, meta=meta, tokens_per_step=1)
    cal = g.meta["calibration"]
    assert g.tuned_budget == 1 and cal["budget"] == 1
    by = {(c["label"], c["score"]): c["reduction"] for c in g.projected["candidates"]}
    assert set(by) == {("default", "gm"), ("default", "reach"), ("capped", "reach"), ("capped", "gm"), ("chain", "gm")}
    assert by[("default", "gm")] == by[("default", "reach")] == pytest.approx(8 / 6)  # A accepted twice
    assert by[("chain", "gm")] == pytest.approx(8 / 6)  # FreeDave's single draft: A
    assert by[("capped", "reach")] == pytest.approx(8 / 5)  # A twice and B once
    assert (cal["shape"], cal["max_level"], cal["nodes"], g.pruning_score) == ("capped", 1, 4, "reach")
    assert g.projected["at_budget"]["reduction"] == max(by.values())
    assert {n.pairs for n in g.nodes} == {A, B}
    # the file records each candidate's p-value against the chain and the test
    p_values = {(c["label"], c["score"]): c["p_value"] for c in g.projected["candidates"]}
    assert p_values[("capped", "reach")] == pytest.approx(1 / 64) and p_values[("chain", "gm")] is None
    assert p_values[("default", "gm")] == 1.0  # saves what the chain saves on every prompt
    assert {c["label"]: c["clearly_more"] for c in g.projected["candidates"] if c["score"] == "reach"} == {
        "default": False, "capped": True}
    test = g.projected["candidate_test"]
    assert test["level"] == CLEARLY_MORE_LEVEL and test["prompts"] == 6 and "wilcoxon" in test["test"]
    # at D* = 2 the capped shape (A, B, AB) drafts A and AB, or B first where position 2 is certain: 5 of 8 saved
    g2 = tune_for_budget(chain_list, trajs, 2, nodes=2, meta=meta, tokens_per_step=1)
    assert g2.projected["at_budget"]["reduction"] == pytest.approx(8 / 3) and g2.pruning_score == "reach"
    # the same gain on one prompt only is no evidence: the chain is kept
    alone = tune_for_budget(chain_list[:3], trajs[:1], 1, nodes=2, meta=meta, tokens_per_step=1)
    assert alone.meta["calibration"]["shape"] == "chain"
    assert max(c["reduction"] for c in alone.projected["candidates"]) == pytest.approx(8 / 5)
    # equal savings: the chain is kept
    same = _traj({0: (A, AB), 3: (A, AB)}, {0: first, 3: first}, steps=6)
    g3 = tune_for_budget([same.chains[0], same.chains[3]], [same], 2, nodes=2, meta=meta, tokens_per_step=1)
    assert g3.meta["calibration"]["shape"] == "chain" and {n.pairs for n in g3.nodes} == {A, AB}
    assert g3.projected["at_budget"]["reduction"] == pytest.approx(6 / 2)
    # confidences that point away from what the baseline does: both scores draft B, the plain chain (A) wins
    misleading = _traj({0: (A, AB), 2: (A, AB), 4: (A,), 6: (B,)}, {n: second for n in (0, 2, 4, 6)}, steps=8)
    g4 = tune_for_budget([misleading.chains[n] for n in (0, 2, 4, 6)], [misleading], 1, nodes=3, meta=meta,
                         tokens_per_step=1)
    assert g4.meta["calibration"]["shape"] == "chain" and {n.pairs for n in g4.nodes} == {A}
    assert g4.projected["at_budget"]["reduction"] == pytest.approx(8 / 5)
    with pytest.raises(ConfigError, match="D\\* >= 1"):
        tune_for_budget(chain_list, trajs, 0, nodes=2)


def test_calibrate_with_budget_matches_the_runtime(tiny_llada: Path, tmp_path: Path, capsys) -> None:
    """The replayed savings at D* are exactly what the runtime saves with the tuned graph (float64, greedy)."""
    model = load_f64(tiny_llada, cached=True)
    tok = load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16)
    g = calibrate(model, tok, PROMPTS, cfg, nodes=4, budget=2, progress=False)
    assert g.tuned_budget == 2 and resolve_budget(None, g) == 2 and resolve_budget(None, None) == DEFAULT_BUDGET
    runtime_nfe = 0
    for k, text in enumerate(PROMPTS):
        ids = torch.tensor([prompt_token_ids(tok, text)], dtype=torch.long)
        base = make_session(model, ids, cfg, seed=k)
        run_baseline(base)
        spec = make_session(model, ids, cfg, seed=k)
        stats = speculative_generate(spec, g)  # budget and score: the graph's own
        assert stats.budget == 2 and stats.score == g.pruning_score
        assert torch.equal(spec.x, base.x)
        runtime_nfe += stats.nfe
    at = g.projected["at_budget"]
    assert at["projected_nfe"] == runtime_nfe < at["baseline_nfe"]
    with pytest.raises(ConfigError, match="either a budget or a score"):
        calibrate(model, tok, PROMPTS[:1], cfg, budget=2, score="reach", progress=False)
    with pytest.raises(ConfigError, match="budget=0"):
        calibrate(model, tok, PROMPTS[:1], cfg, budget=0, progress=False)
    # the CLI records the tuning and `graph show` reports it
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "tuned.json"
    assert main(["calibrate", "--model", str(tiny_llada), "--prompts", str(prompts), "--out", str(out), "--nodes", "4",
                 "--budget", "2", "--gen-length", "16", "--block-length", "8", "--steps", "16", "--dtype", "float64",
                 "--no-chat", "--no-progress"]) == 0
    capsys.readouterr()
    assert load_graph(out).tuned_budget == 2 and "--budget 2" in load_graph(out).meta["calibration"]["command"]
    assert main(["graph", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "at D* = 2:" in shown and "candidate capped:" in shown and "candidate default:" in shown
    assert "candidate chain: 2 nodes" in shown


def test_the_graph_file_keeps_the_test_and_old_files_still_load(tmp_path: Path) -> None:
    first, second = [[0.9, 0.05], [0.1, 0.05]], [[0.1, 0.05], [0.9, 0.05]]
    chain_list, trajs = _prompts({0: (A, AB), 3: (A, AB), 6: (B,)}, {0: first, 3: first, 6: second}, steps=8)
    g = tune_for_budget(chain_list, trajs, 1, nodes=2, meta={"calibrated_for": {"tokens_per_step": 1}},
                        tokens_per_step=1)
    path = tmp_path / "tuned.json"
    g.save(path)
    loaded = load_graph(path)
    assert loaded.projected["candidates"] == g.projected["candidates"]
    assert loaded.projected["candidate_test"] == g.projected["candidate_test"]
    shown = loaded.summary()
    assert "(clearly more than the chain, one-sided p = 0.0156 (level 0.05))" in shown
    assert "candidate test: wilcoxon signed-rank" in shown and "over 6 prompt(s), level 0.05" in shown
    # a file tuned before the paired test (no p-values, no candidate_test) loads and shows its verdicts
    data = json.loads(path.read_text())
    del data["projected"]["candidate_test"]
    for c in data["projected"]["candidates"]:
        del c["p_value"]
    path.write_text(json.dumps(data))
    old = load_graph(path)
    assert old.tuned_budget == 1 and "p_value" not in old.projected["candidates"][0]
    assert "(clearly more than the chain)" in old.summary() and "p =" not in old.summary()


@pytest.mark.slow
def test_rival_headroom_replays_spend_what_real_runs_spend() -> None:
    """scripts/dllm_rival_headroom.py on one held-out prompt of the shipped tiny-sdar (16 positions): its replays of
    FreeDave's chain and of the shipped graph spend exactly the forwards that real runs spend at the same budget,
    and the perfect-foresight bound never spends more than either."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("dllm_rival_headroom", root / "scripts" / "dllm_rival_headroom.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    model_dir = embedded_model_path("dllm")
    graph = load_graph(embedded_graph_path(model_dir))
    config = study.graph_config(graph, gen_length=16)
    model = load_model(model_dir, dtype=graph.meta["calibration"]["dtype"])
    prompt = load_benchmark_prompts("humaneval", skip=held_out_from("humaneval"), max_prompts=1)[0].prompt
    ids = prompt_token_ids(load_tokenizer(model_dir), prompt, chat=False)
    rows = study.compare(study.record(model, [ids], config, 4), graph, (1, 2))
    for row in rows:
        d, spent = row["budget"], row["forwards"]
        real_graph = speculative_generate(make_session(model, torch.tensor([ids]), config), graph, d).nfe
        real_chain = speculative_generate(make_session(model, torch.tensor([ids]), config),
                                          freedave_graph(model, config, d + 1), d).nfe
        assert (spent["graph"], spent["chain"]) == (real_graph, real_chain)
        assert spent["bound"] <= min(spent["graph"], spent["chain"]) < spent["baseline"]
    assert "| 2 | 3 |" in study.markdown({"rows": rows, "first_misses": {"steps": 1, "chain_share": 1.0, "instead": {}}})
