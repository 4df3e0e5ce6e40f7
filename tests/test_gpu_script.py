"""scripts/gpu_run.py cannot rot: its self-check (toy sizes, CPU) runs every section the GPU run runs.

The default tier runs the real-size cost machinery at toy sizes (random-weight builders of the five published
architectures, session forwards over 1..2 states, eager and static-cache tree verification, the drafter block) and
the projections; the slow tier runs the whole self-check (lossless checks and the two benches too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spiffy.bench import exactness, gpu_costs

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, sections: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_run.py"), "--self-check", "--out", str(out),
                           "--sections", sections], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "GPU_RESULTS.md").read_text().startswith("# GPU run")
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_self_check_costs_and_projections(tmp_path: Path) -> None:
    data = _run(tmp_path, "costs,projections")
    costs = data["sections"]["costs"]["result"]
    assert set(costs) == {"LLaDA-8B", "SDAR-8B", "Qwen3-8B", "Qwen3-30B-A3B"}
    assert [r["states"] for r in costs["LLaDA-8B"]["rows"]] == [1, 2] * 3  # none, prefix, dual
    for name in ("Qwen3-8B", "Qwen3-30B-A3B"):
        assert [r["budget"] for r in costs[name]["eager"]] == [0, 16]
        assert all("ms" in r and r["ms"] > 0 for r in costs[name]["cuda_graph"]), costs[name]["cuda_graph"]
    assert costs["Qwen3-8B"]["drafter"]["block_size"] == 16


@pytest.mark.slow
def test_self_check_captured(tmp_path: Path) -> None:
    """The captured section times the public entry point eager and captured (toy sizes): same tokens both ways."""
    data = _run(tmp_path, "captured")
    res = data["sections"]["captured"]["result"]
    rows = res["Qwen3-8B"]["rows"]
    assert {(r["method"], r["compile"]) for r in rows} == {(m, c) for m in ("ar", "dflash", "ddtree") for c in (0, 1)}
    assert all("error" not in r and r["ms_per_round"] > 0 and r["same_tokens_as_first_call"] for r in rows), rows
    assert all(r["capture"]["buckets"] >= 1 for r in rows if r["compile"])
    # the drafter's block forward is a captured step of its own (a bucket per rows x block), timed in the draft stage
    assert all(r["drafter_capture"]["buckets"] >= 1 for r in rows if r["compile"] and r["method"] != "ar")
    assert all(r["ms_per_round_by_stage"]["draft"] > 0 for r in rows if r["method"] != "ar")
    # DDTree under the rejection rule at T = 1, eager and captured (its walk on the device when captured)
    assert [(r["method"], r["compile"]) for r in rows if r["accept"] == "rejection"] == [("ddtree", 0), ("ddtree", 1)]
    assert [r["method"] for r in res["Qwen3-30B-A3B"]["rows"]] == ["ar", "ar"]
    assert res["Qwen3-8B"]["transformers_static"]["ms_per_token"] > 0
    assert res["Qwen3-8B"]["bandwidth_limit_ms_per_token"] > 0


@pytest.mark.slow
def test_self_check_every_section(tmp_path: Path) -> None:
    data = _run(tmp_path, "lossless,bench,costs,projections")
    lossless = data["sections"]["lossless"]["result"]
    assert all(r.get("single_identical", r.get("identical")) for r in lossless["rows"]), lossless["rows"]
    assert all(r.get("batch_identical", True) for r in lossless["rows"])
    bench = data["sections"]["bench"]["result"]
    assert bench["dllm"]["results"]["all_identical"] and bench["ar"]["returncode"] == 0
    proj = data["sections"]["projections"]["result"]
    assert proj["label"].startswith("PROJECTION") and proj["LLaDA-8B"]


def test_real_size_parameter_counts_on_meta() -> None:
    """The published totals of the architectures the GPU run builds (meta device: no memory)."""
    exact = {"Qwen--Qwen3-8B": 8_190_735_360, "GSAI-ML--LLaDA-8B-Instruct": 8_015_581_184}  # bf16 index totals / 2
    for name, total in exact.items():
        model = gpu_costs.build_random(gpu_costs.real_config(name), "meta", torch.bfloat16)
        assert gpu_costs.count_parameters(model) == total, name
    # Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated (8 of 128 experts per token)
    config = gpu_costs.real_config("Qwen--Qwen3-30B-A3B")
    model = gpu_costs.build_random(config, "meta", torch.bfloat16)
    assert round(gpu_costs.count_parameters(model) / 1e9, 1) == 30.5
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = gpu_costs.count_parameters(model) - experts + experts * 8 // 128
    assert abs(active / 1e9 - 3.3) < 0.1  # 3.35B counting both embeddings


def test_tree_mask_is_ancestor_only() -> None:
    mask, positions = gpu_costs._ancestor_mask(6, 3, torch.float32, torch.device("cpu"))
    visible = mask[0, 0] == 0
    assert visible[:, :3].all()  # every node sees the context
    assert torch.equal(visible[:, 3:].diagonal(), torch.ones(7, dtype=torch.bool))
    assert visible[0, 3:].sum() == 1  # the root sees only itself
    for i in range(1, 7):  # a node's depth is the number of tree nodes it sees, minus itself
        assert int(positions[0, i]) == 3 + int(visible[i, 3:].sum()) - 1


def test_cpu_size_study_self_check() -> None:
    """scripts/cpu_dllm_sizes.py (which model size and cache mode turn Spiffy's saved forwards into CPU wall-clock)
    at toy size: every family and cache mode measured, each projection = the headline's NFE reduction / the
    measured cost ratio, the scaled architecture has the asked-for shape."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_dllm_sizes", ROOT / "scripts" / "cpu_dllm_sizes.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    cfg = study.scaled(gpu_costs.real_config("JetLM--SDAR-4B-Chat"), 256, 3, 1000)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["mask_token_id"]) == (256, 3, 1000, 999)
    res = study.run(study.SELF_CHECK_LADDER, range(1, 3), reps=1, prompt=8, gen=8)
    assert {(r["family"], r["cache"]) for r in res["rows"]} == {("SDAR", "prefix"), ("LLaDA", "none"),
                                                               ("LLaDA", "prefix"), ("LLaDA", "dual")}
    measured = {m["budget"]: m["nfe_reduction"] for m in res["measured"]}
    for r in res["rows"]:
        assert r["budget"] == 1 and r["projected_speedup"] == pytest.approx(measured[1] / r["cost_ratio"])
    table = study.markdown(res)
    assert table.startswith("PROJECTION") and table.count("| SDAR |") == 1 and table.count("| LLaDA |") == 3


@pytest.mark.slow  # about a minute: three architectures x three modes at toy size, with the proofs
def test_self_check_exactness(tmp_path: Path) -> None:
    """The real-size exactness section (issue 38) at toy size on the CPU: float32 and the batch-invariant mode
    bitwise for Spiffy, batched rows, DFlash and DDTree; every bfloat16 divergence proven; the mode's cost reported."""
    data = _run(tmp_path, "exactness")
    assert "int8 digit products (fused and eager) == float64 products" in (tmp_path / "GPU_RESULTS.md").read_text()
    res = data["sections"]["exactness"]["result"]
    assert set(res) == {"LLaDA-8B", "SDAR-8B", "Qwen3-8B + DFlash", exactness.BACKEND_KEY}
    backends = res.pop(exactness.BACKEND_KEY)
    checks = len(exactness.BACKEND_SHAPES) + 1  # and the other stages
    assert backends["identical"] == f"{checks}/{checks}" and backends["compiled"] and not backends["fell_back"]
    for model, modes in res.items():
        for label in ("float32", "bfloat16 batch-invariant"):
            assert all(r["identical"] for r in modes[label]["rows"]), (model, label, modes[label]["rows"])
        assert not modes["bfloat16"]["unproven"]
        assert all(v > 0 for v in modes["batch_invariant_cost"].values())
    qwen = res["Qwen3-8B + DFlash"]
    assert {"ar captured", "ddtree captured", "ar unfused", "ar captured unfused"} <= set(qwen["batch_invariant_cost"])
    assert qwen["bfloat16 batch-invariant"]["unfused_equals_fused"] is True
    for label in ("float32", "bfloat16 batch-invariant"):  # compile=True gives the eager tokens
        assert qwen[label]["captured_equals_eager"] == {"ar": True, "ddtree": True}, label
    # every model and mode reports its summary as it ends (the script saves each at once)
    calls: list[dict] = []
    torch.set_num_threads(1)
    exactness.real_size_exactness(torch.device("cpu"), True, progress=calls.append)
    assert len(calls) == 9 and set(calls[0]) == {"LLaDA-8B", exactness.BACKEND_KEY}
    assert set(calls[-1]) == set(res) | {exactness.BACKEND_KEY}
    assert calls[0]["LLaDA-8B"]["float32"]["identical"] == "3/3"
    # a run cut inside the section keeps the models it finished, and --render writes their tables
    data["sections"]["exactness"] = {"partial": {"LLaDA-8B": res["LLaDA-8B"]}}
    (tmp_path / "results.json").write_text(json.dumps(data))
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_run.py"), "--render", "--out", str(tmp_path)],
                   check=True, env=env, timeout=120)
    md = (tmp_path / "GPU_RESULTS.md").read_text()
    assert "**partial**" in md and "| LLaDA-8B | bfloat16 batch-invariant | 3/3 |" in md and "Qwen3" not in md


@pytest.mark.slow
def test_self_check_dllm_captured(tmp_path: Path) -> None:
    """The dLLM section times spiffy.generate eager and compile=True (toy sizes, CPU): the static path gives eager's
    tokens for every method and model (on a GPU, LLaDA2.0 reports its capture refusal, MoE, as row errors)."""
    data = _run(tmp_path, "dllm_captured")
    res = data["sections"]["dllm_captured"]["result"]
    for name in ("LLaDA-8B", "SDAR-8B", "LLaDA2.0-mini"):
        rows = res[name]["rows"]
        assert {(r["method"], r["compile"]) for r in rows} == {(m, c) for m in ("baseline", "spiffy", "freedave", "ssd")
                                                              for c in (0, 1)}
        assert all("error" not in r and r["ms_per_forward"] > 0 and r["same_tokens_as_eager"] for r in rows), rows
        assert all(r["capture"]["buckets"] >= 1 for r in rows if r["compile"])
        assert res[name]["bandwidth_limit_ms_per_forward"] > 0
    assert [r["states"] for r in res["LLaDA-8B"]["forward_alone"]] == [1, 4, 1, 4]
    assert "### LLaDA-8B (cache prefix)" in (tmp_path / "GPU_RESULTS.md").read_text()
