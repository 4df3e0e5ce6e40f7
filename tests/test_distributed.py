"""Data parallelism on torch.distributed: launcher detection, sharding, ordered merge, and ``torchrun -m spiffy``.

The end-to-end tests launch ``torchrun --nproc-per-node 2`` (gloo on CPU) on tiny checkpoints with 3 prompts (rank 0
gets prompts 0 and 2, rank 1 prompt 1, so the merge order matters) and compare the files with a single-process run:
the calibrated graph must be the same file (date aside), a benchmark report the same content (timings aside).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spiffy.cli.main import main
from spiffy.distributed import (
    DataParallel,
    LaunchEnvironment,
    data_parallel,
    detect_launch,
    device_for_rank,
    merge_in_order,
    shard_indices,
)
from spiffy.errors import ConfigError

GEN = ["--gen-length", "8", "--block-length", "4"]
# what legitimately differs between two runs of the same benchmark: wall times and the machine record
TIMING_KEYS = {"seconds", "tokens_per_s", "speedup", "stage_times", "stage_share", "environment", "tpot", "tpot_s",
               "decode_seconds", "prefill_seconds", "speedup_vs_ar", "speedup_vs_dflash"}


def test_detect_launch() -> None:
    assert detect_launch({}) is None
    assert detect_launch({"WORLD_SIZE": "1", "RANK": "0"}) is None
    env = detect_launch({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert env == LaunchEnvironment(rank=3, world_size=4, local_rank=1, master_addr="h", master_port="29500")
    assert detect_launch({"WORLD_SIZE": "2", "RANK": "1"}).local_rank == 1  # type: ignore[union-attr]
    for bad in ({"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "two", "RANK": "0"},
                {"WORLD_SIZE": "0", "RANK": "0"}):
        with pytest.raises(ConfigError):
            detect_launch(bad)


def test_shard_and_merge() -> None:
    for total in (0, 1, 5, 7):
        for world in (1, 2, 3):
            shards = [shard_indices(total, r, world) for r in range(world)]
            assert sorted(k for s in shards for k in s) == list(range(total))  # a partition
            parts = [[(k, f"p{k}") for k in reversed(s)] for s in shards]  # any order inside a rank
            assert merge_in_order(parts, total) == [f"p{k}" for k in range(total)]
    assert shard_indices(5, 1, 2) == [1, 3]
    with pytest.raises(ConfigError):
        merge_in_order([[(0, "a")], [(0, "b")]], 2)  # the same prompt from two ranks is a bug, never merged
    with pytest.raises(ConfigError):
        merge_in_order([[(2, "a")]], 2)
    with pytest.raises(ConfigError):
        shard_indices(3, 2, 2)


def test_single_process_needs_no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with data_parallel("cpu") as dp:
        assert (dp.rank, dp.world_size, dp.is_main, dp.active) == (0, 1, True, False)
        assert dp.shard(3) == [0, 1, 2]
        assert dp.gather_in_order([(2, "c"), (0, "a"), (1, "b")], 3) == ["a", "b", "c"]
        dp.barrier()
    assert not torch.distributed.is_initialized()
    assert device_for_rank("cpu", LaunchEnvironment(1, 2, 1)) == torch.device("cpu")
    assert device_for_rank("cuda", LaunchEnvironment(1, 2, 1)) == torch.device("cuda", 1)
    assert device_for_rank("cuda:0", LaunchEnvironment(1, 2, 1)) == torch.device("cuda", 0)
    with pytest.raises(ConfigError):  # a launcher without a rendezvous address
        with data_parallel("cpu", {"WORLD_SIZE": "2", "RANK": "0"}):
            pass
    assert DataParallel(None, torch.device("cpu")).shard(2) == [0, 1]


# ------------------------------------------------------------------------------------------- torchrun end to end
@pytest.fixture(scope="module")
def prompts3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dist_prompts") / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "prompt": "for i in range(3):"},
            {"id": "c", "prompt": "x = 1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _torchrun(args: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "spiffy",
           *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _strip_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_timings(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_strip_timings(v) for v in value]
    return value


@pytest.mark.slow
def test_torchrun_calibrate_writes_the_single_process_graph(tiny_llada: Path, prompts3: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # temperature > 0: prompt k decodes with seed + k, so a rank must use the global prompt index
    args = ["calibrate", "--model", str(tiny_llada), "--prompts", str(prompts3), "--out", "graph.json", "--nodes", "4",
            *GEN, "--temperature", "0.8", "--seed", "5", "--no-chat", "--no-progress", "--dtype", "float64"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    monkeypatch.chdir(one)  # same relative --out: the embedded command line is the same too
    assert main(args) == 0
    _torchrun(args, two)
    g1, g2 = (json.loads((d / "graph.json").read_text()) for d in (one, two))
    for g in (g1, g2):
        g["calibration"].pop("date")
    assert g1 == g2
    assert g2["calibration"]["num_prompts"] == 3 and g2["graph"]


@pytest.mark.slow
def test_torchrun_bench_dllm_reports_the_single_process_content(tiny_llada: Path, prompts3: Path,
                                                                tmp_path: Path) -> None:
    graph = tmp_path / "graph.json"
    assert main(["calibrate", "--model", str(tiny_llada), "--prompts", str(prompts3), "--out", str(graph), "--nodes",
                 "4", *GEN, "--temperature", "0.8", "--no-chat", "--no-progress", "--dtype", "float64"]) == 0
    args = ["bench", "dllm", "--model", str(tiny_llada), "--graph", str(graph), "--budgets", "1,3", "--dataset",
            str(prompts3), "--max-prompts", "3", *GEN, "--temperature", "0.8", "--seed", "5", "--dtype", "float64",
            "--no-chat", "--no-progress", "--no-plots", "--warmup", "0", "--freedave", "none", "--ssd", "none"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    _torchrun([*args, "--out", str(tmp_path / "two")], tmp_path)
    r1, r2 = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert r2["environment"]["processes"] == 2 and r1["environment"]["processes"] == 1
    assert r2["prompt_ids"] == ["a", "b", "c"]
    assert _strip_timings(r1) == _strip_timings(r2)


@pytest.mark.slow
def test_torchrun_bench_ar_reports_the_single_process_content(tiny_qwen3: Path, prompts3: Path, tmp_path: Path) -> None:
    from spiffy.models.tiny import make_tiny

    drafter = make_tiny("dflash", tmp_path / "drafter", seed=0, target=str(tiny_qwen3), block_size=4)
    args = ["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--budgets", "2,6", "--dataset",
            str(prompts3), "--max-prompts", "3", "--max-new-tokens", "8", "--dtype", "float64", "--no-chat",
            "--no-progress", "--no-plots", "--warmup", "0"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    _torchrun([*args, "--out", str(tmp_path / "two")], tmp_path)
    r1, r2 = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert r2["environment"]["processes"] == 2 and r2["prompt_ids"] == ["a", "b", "c"]
    assert _strip_timings(r1) == _strip_timings(r2)
