"""Tensor parallel AR target: ``load_target(..., tp_plan="auto")`` under ``torchrun --nproc-per-node 2`` (gloo, CPU).

transformers shards every projection of the tiny Qwen3 target over the two ranks (DTensor weights, each rank holding
half of ``q_proj``); each rank runs the same AR / DFlash / DDTree generation with a replicated drafter, and the tokens
equal the single-process run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spiffy.arspec import ddtree_generate
from spiffy.errors import ConfigError
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from spiffy.arspec import ddtree_generate
    from spiffy.models import load_drafter, load_target
    torch.set_num_threads(1)
    target = load_target(sys.argv[1], torch.float32, tp_plan="auto")
    drafter = load_drafter(sys.argv[2], dtype=torch.float32)
    weight = target.model.layers[0].self_attn.q_proj.weight
    out = {"local_rows": int(weight.to_local().shape[0]), "rows": int(weight.shape[0])}
    for method in ("ar", "dflash", "ddtree"):
        out[method] = ddtree_generate(target, drafter, [5, 6, 7, 8, 9, 10], method=method, budget=16,
                                      max_new_tokens=16).tokens
    with open(sys.argv[3] + f".{os.environ['RANK']}", "w") as f:
        json.dump(out, f)
    """
)


def test_tp_plan_needs_a_launcher(tiny_qwen3, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        load_target(tiny_qwen3, torch.float32, tp_plan="auto")
    with pytest.raises(ConfigError, match="one of them"):
        load_target(tiny_qwen3, torch.float32, tp_plan="auto", device_map="auto")


@pytest.mark.slow
def test_torchrun_tp_target_decodes_like_one_process(tmp_path):
    target = make_tiny_target(tmp_path / "target", seed=3, num_layers=3, with_tokenizer=False)
    drafter = make_tiny_dflash(tmp_path / "drafter", target, seed=4, num_layers=2, block_size=8)
    script = tmp_path / "tp_run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(target), str(drafter), str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single_target = load_target(target, torch.float32, "cpu")
    single_drafter = load_drafter(drafter, dtype=torch.float32)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        assert got["local_rows"] * 2 == got["rows"]  # really sharded: each rank holds half of q_proj
        for method in ("ar", "dflash", "ddtree"):
            ref = ddtree_generate(single_target, single_drafter, [5, 6, 7, 8, 9, 10], method=method, budget=16,
                                  max_new_tokens=16)
            assert got[method] == ref.tokens, (rank, method)
