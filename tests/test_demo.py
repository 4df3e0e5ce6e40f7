"""``spiffy demo`` with explicit tiny checkpoints, and the clean error when the embedded models are missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spiffy.cli.main import main
from spiffy.embedded import (
    EMBEDDED_NAMES,
    TRAINING_SCRIPTS,
    embedded_graph_path,
    embedded_model_path,
    shipped_graphs,
)
from spiffy.errors import ConfigError

#: small runs: the flags of the diffusion part, of the AR part, and of both (a part's flags with the other part's
#: --only are refused)
DLLM_SMALL = ["--gen-length", "8", "--block-length", "4"]
AR_SMALL = ["--max-new-tokens", "8", "--tree-budget", "6"]
BOTH = ["--max-prompts", "1", "--dtype", "float64", "--no-progress"]
SMALL = DLLM_SMALL + AR_SMALL + BOTH


@pytest.fixture(scope="module")
def tiny_drafter(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spiffy.models.tiny import make_tiny

    return make_tiny("dflash", tmp_path_factory.mktemp("demo_dflash") / "drafter", seed=1, target=str(tiny_qwen3),
                     block_size=4)


def test_demo_explicit_paths_calibrates_on_the_fly(tiny_llada: Path, tiny_qwen3: Path, tiny_drafter: Path, capsys) -> None:
    rc = main(["demo", "--model", str(tiny_llada), "--target", str(tiny_qwen3), "--drafter", str(tiny_drafter), *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = captured.out
    assert "calibrated on the fly" in out
    assert "def fibonacci(n):" in out
    # dLLM table: baseline and Spiffy rows, identical check 1/1
    row = re.search(r"\| Spiffy +\| (\d+) \| ([\d.]+)x \|.*\| 1/1 \|", out)
    base = re.search(r"\| baseline \| (\d+) \|", out)
    assert row and base, out
    assert int(row.group(1)) <= int(base.group(1))
    # AR table: the three methods, all identical to AR; no diffusion drafter given with an explicit target
    for method, drafter in (("AR", "-"), ("DFlash", "DFlash"), ("DDTree", "DFlash")):
        assert re.search(rf"\| {method} \| {drafter} \| [^|]+ \| [\d.]+ \|.*\| 1/1 \|", out), method
    assert "| DEER" not in out
    assert "identical to their baselines" in out and "MISMATCH" not in out


def test_demo_with_a_diffusion_drafter_adds_deer_specdiff_and_ddtree_rows(
    tiny_qwen3: Path, tiny_drafter: Path, tmp_path: Path, capsys
) -> None:
    dllm = tmp_path / "dllm-drafter"
    assert main(["tiny", "dllm-drafter", str(dllm), "--target", str(tiny_qwen3), "--set", "block_size=4"]) == 0
    capsys.readouterr()
    rc = main(["demo", "--only", "ar", "--target", str(tiny_qwen3), "--drafter", str(tiny_drafter),
               "--dllm-drafter", str(dllm), "--drafts", "3", *AR_SMALL, *BOTH])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = captured.out
    for method, drafter, shape in (("DEER", "dLLM", "chain"), ("SpecDiff-2", "dLLM", "K=3"),
                                   ("DDTree", "dLLM", "budget 6"), ("DDTree", "DFlash", "budget 6")):
        assert re.search(rf"\| {method} \| {drafter} \| {shape} \| [\d.]+ \|.*\| 1/1 \|", out), (method, drafter)
    assert f"dLLM drafter {dllm}" in out and "MISMATCH" not in out


def test_demo_rejects_a_dflash_checkpoint_as_diffusion_drafter(tiny_qwen3: Path, tiny_drafter: Path, capsys) -> None:
    argv = ["demo", "--only", "ar", "--target", str(tiny_qwen3), "--drafter", str(tiny_drafter), *AR_SMALL, *BOTH]
    assert main([*argv, "--dllm-drafter", str(tiny_drafter)]) == 2
    assert "is a dflash drafter" in capsys.readouterr().err
    assert main([*argv, "--drafts", "0"]) == 2
    assert "--drafts must be >= 1" in capsys.readouterr().err


def test_demo_with_graph_only_dllm(tiny_llada: Path, tmp_path: Path, capsys) -> None:
    from spiffy.decoding import DecodeConfig
    from spiffy.models import load_model, load_tokenizer
    from spiffy.selfspec.calibrate import calibrate

    graph = calibrate(load_model(tiny_llada, dtype="float64"), load_tokenizer(tiny_llada), ["def g(y):", "import re"],
                      DecodeConfig(gen_length=8, block_length=4), nodes=3, chat=False, progress=False)
    gpath = tmp_path / "graph.json"
    graph.save(gpath)
    rc = main(["demo", "--only", "dllm", "--model", str(tiny_llada), "--graph", str(gpath), *DLLM_SMALL, *BOTH])
    out = capsys.readouterr().out
    assert rc == 0
    assert "calibrated on the fly" not in out and "| Spiffy" in out and "AR target" not in out


def test_plain_demo_without_embedded_models_is_a_clean_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SPIFFY_EMBEDDED_DIR", str(tmp_path / "empty"))
    rc = main(["demo"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    for kind in EMBEDDED_NAMES:
        assert TRAINING_SCRIPTS[kind] in err
    assert "--model DIR --graph FILE --target DIR --drafter DIR" in err
    with pytest.raises(ConfigError, match="train_tiny_sdar_mbpp.sh"):
        embedded_model_path("dllm")
    with pytest.raises(ConfigError, match="unknown embedded model kind"):
        embedded_model_path("nope")


def test_embedded_resolver_finds_shipped_checkpoints(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPIFFY_EMBEDDED_DIR", str(tmp_path))
    d = tmp_path / EMBEDDED_NAMES["dllm"]
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert embedded_model_path("dllm") == d
    assert embedded_graph_path(d) is None and shipped_graphs() == []
    (d / "graph.json").write_text("{}")
    assert embedded_graph_path(d) == d / "graph.json"
    (d / "graphs").mkdir()
    for name in ("b.json", "a.json", "notes.txt"):
        (d / "graphs" / name).write_text("{}")
    assert shipped_graphs() == shipped_graphs(d) == [d / "graphs" / "a.json", d / "graphs" / "b.json", d / "graph.json"]
    assert embedded_graph_path() == d / "graphs" / "a.json"


def test_random_tiny_demo_calibrates_its_own_graph(capsys) -> None:
    """--random-tiny must not pick up the embedded model's graph (another mask id): it calibrates on the fly, and
    prints the legend and the CPU/GPU note."""
    rc = main(["demo", "--random-tiny", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = captured.out
    assert "RANDOM checkpoints" in out and "calibrated on the fly" in out
    assert re.search(r"\| Spiffy +\| \d+ \| [\d.]+x \|.*\| 1/1 \|", out), out
    assert re.search(r"\| DEER \| dLLM \| chain \| [\d.]+ \|.*\| 1/1 \|", out), out  # a random diffusion drafter too
    assert "NFE        model forward calls" in out and "tau        tokens" in out and "identical  " in out
    assert "on a CPU" in out and "on a GPU" in out
    assert "identical to their baselines" in out


def test_shipped_graphs_are_the_repository_graphs() -> None:
    """graphs/ is where graphs are produced; the package carries the same bytes next to each embedded model
    (run scripts/ship_graphs.py after recalibrating)."""
    import importlib.util

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("ship_graphs", repo / "scripts" / "ship_graphs.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    plan = mod.planned_copies()
    assert plan.get(EMBEDDED_NAMES["dllm"]), plan  # the embedded dLLM ships at least one graph
    assert mod.up_to_date(plan), "run scripts/ship_graphs.py"
