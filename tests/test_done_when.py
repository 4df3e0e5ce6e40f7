"""A new user's first commands, run as separate processes through the installed `spiffy` console script from an
empty temporary directory (no repository files reachable: models, graphs and datasets must be package data).

scripts/check_install.sh (run by .ci/run) does the same after a non-editable install into a fresh environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _spiffy() -> str:
    found = shutil.which("spiffy", path=str(Path(sys.executable).parent)) or shutil.which("spiffy")
    assert found, "the `spiffy` console script is not installed"
    return found


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPIFFY_EMBEDDED_DIR", "SPIFFY_DATASETS_DIR")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([_spiffy(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_first_commands_from_an_empty_directory(tmp_path: Path) -> None:
    demo = _run(["demo", "--random-tiny", "--no-progress", "--max-prompts", "1"], tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "calibrated on the fly" in demo.stdout and "identical to their baselines" in demo.stdout

    dllm = _run(["bench", "dllm", "--dataset", "mbpp", "--max-prompts", "1", "--budgets", "1", "--gen-length", "64",
                 "--block-length", "32", "--steps", "64", "--out", "D", "--no-progress"], tmp_path)
    assert dllm.returncode == 0, dllm.stderr[-3000:]
    # baseline, Spiffy, FreeDave and SSD; then threshold 0.9's baseline and Spiffy on top of it
    assert "1 prompt(s) x 6 configuration(s)" in dllm.stderr and "graphs/tiny-sdar-s1.json" in dllm.stderr
    res = json.loads((tmp_path / "D" / "results.json").read_text())
    assert res["all_identical"] and res["num_prompts"] == 1 and res["companion"]["all_identical"]

    ar = _run(["bench", "ar", "--dataset", "gsm8k", "--max-prompts", "1", "--budgets", "16", "--max-new-tokens", "16",
               "--out", "D2", "--no-progress"], tmp_path)
    assert ar.returncode == 0, ar.stderr[-3000:]
    assert json.loads((tmp_path / "D2" / "results.json").read_text())["all_identical"]

    empty = _run(["generate", "--prompt", ""], tmp_path)
    assert empty.returncode == 2 and empty.stdout == ""
    assert empty.stderr.count("\n") == 1 and "the prompt is empty" in empty.stderr
