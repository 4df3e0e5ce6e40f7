"""The README's commands, run as the README writes them (blocks extracted with mktestdocs).

Every ``bash`` and ``python`` block of README.md, docs/MODELS.md and docs/RESULTS.md (where the README's long sections
live) is accounted for here:

* the command-line block and the Python block run as written, in a temporary directory (``/tmp/`` paths are moved
  into it so parallel runs do not collide), with the expensive commands made smaller by appending the same flags a
  user would (``--max-prompts``, ``--max-new-tokens``): argparse keeps the last value of a flag;
* the set-up block's `spiffy demo` runs with one prompt; its install commands, like the test-command block, run
  verbatim in ``.ci/run`` (which checks a non-editable install too, ``scripts/check_install.sh``);
* the "Real checkpoints" blocks (Hub ids) run in ``tests/test_hub.py`` against an offline Hugging Face cache that
  holds tiny checkpoints under the real ids;
* the half-precision block runs as written on the embedded models, made small the same way;
* the overheads block (``spiffy bench overheads``) runs as written with a small vocabulary, two budgets and one
  repeat appended;
* the retraining block is 45-minute training jobs that write into the package: its scripts must exist, be
  executable and parse (``bash -n``, ``py_compile``).

A README block that fits none of these fails the test, so a new command cannot go unexercised.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mktestdocs import grab_code_blocks

from spiffy.cli.main import main

REPO = Path(__file__).resolve().parent.parent
#: the README and the documents its long sections moved to: every code block of each is exercised here
DOCUMENTS = ("README.md", "docs/MODELS.md", "docs/RESULTS.md")
README = "\n".join((REPO / name).read_text(encoding="utf-8") for name in DOCUMENTS)

#: (argv prefix, flags appended to make the command cheap; the same flags a user would pass)
REDUCTIONS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("spiffy", "calibrate"), ("--max-prompts", "2", "--no-progress")),
    (("spiffy", "bench", "dllm"), ("--max-prompts", "1", "--warmup", "0", "--no-progress")),
    (("spiffy", "bench", "ar"), ("--max-prompts", "1", "--max-new-tokens", "16", "--warmup", "0", "--no-progress")),
    (("spiffy", "demo"), ("--max-prompts", "1", "--no-progress")),
    (("spiffy", "bench", "overheads"), ("--vocab", "4096", "--budgets", "16,32", "--repeats", "1", "--no-memory",
                                        "--no-plots", "--no-steady-allocator")),
    (("spiffy", "train-drafter"), ("--steps", "2", "--max-files", "10", "--heldout-percent", "30", "--seq-len", "24",
                                   "--prompt-len", "8", "--batch-size", "2", "--num-anchors", "2", "--block-size", "4",
                                   "--eval-prompts", "1", "--eval-new-tokens", "4", "--save-dtype", "float32")),
)


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&`` chains split."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1 :]
    return out


def reduced(argv: list[str]) -> list[str]:
    for prefix, extra in REDUCTIONS:
        if tuple(argv[: len(prefix)]) == prefix:
            return argv + list(extra)
    return argv


def _blocks(lang: str) -> list[str]:
    return grab_code_blocks(README, lang=lang)


def _block_with(lang: str, needle: str) -> str:
    found = [b for b in _blocks(lang) if needle in b]
    assert len(found) == 1, f"expected one README {lang} block containing {needle!r}"
    return found[0]


SETUP = _block_with("bash", "spiffy demo")
TESTS = _block_with("bash", "pytest")
CLI = _block_with("bash", "spiffy tiny llada")
RETRAIN = _block_with("bash", "scripts/train_tiny_qwen3.sh")
DIFFUSION_DRAFTERS = _block_with("bash", "spiffy tiny dllm-drafter")
OVERHEADS = _block_with("bash", "spiffy bench overheads")
#: the "Real checkpoints" blocks name Hub ids: tests/test_hub.py runs them against an offline Hugging Face cache
HUB_CLI = _block_with("bash", "GSAI-ML/LLaDA-8B-Instruct")
HUB_PYTHON = _block_with("python", "JetLM/SDAR-8B-Chat")
FIDELITY = _block_with("bash", "--dtype bfloat16")
PYTHON = _block_with("python", "spiffy.load_model(\"/tmp/llada\"")


def test_every_readme_block_is_exercised() -> None:
    assert sorted(_blocks("bash")) == sorted([SETUP, TESTS, CLI, RETRAIN, HUB_CLI, FIDELITY, DIFFUSION_DRAFTERS, OVERHEADS])
    assert sorted(_blocks("python")) == sorted([PYTHON, HUB_PYTHON])
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for block in (SETUP, TESTS):  # both run verbatim in CI, in a fresh virtual environment
        assert block.strip() in ci.splitlines(), block


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert argv[0] == "spiffy", f"the README's command block should hold spiffy commands only: {argv}"
    code = main(reduced(argv)[1:])
    out, err = capsys.readouterr()
    assert code == 0, f"`{shlex.join(argv)}` exited {code}:\n{err[-3000:]}"
    return out


@pytest.mark.slow
def test_command_line_and_python_blocks_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    here = str(tmp_path) + "/"
    outputs = [_run_cli([w.replace("/tmp/", here) for w in argv], capsys) for argv in commands(CLI)]
    assert (tmp_path / "graph.json").is_file() and (tmp_path / "runs" / "dllm" / "results.json").is_file()
    assert (tmp_path / "runs" / "ar" / "results.md").is_file() and (tmp_path / "runs" / "emb" / "results.json").is_file()
    assert any("fewer forwards" in out for out in outputs)  # calibrate's / graph show's summary
    python_block = PYTHON.replace("/tmp/", here)
    namespace: dict = {"__name__": "readme"}
    exec(compile(python_block, "README.md (python block)", "exec"), namespace)  # noqa: S102 - the README's own code
    # the block asserts Spiffy's losslessness itself; check that it really decoded both ways
    assert namespace["fast"].nfe <= namespace["base"].nfe and len(namespace["out"].tokens) > 0


@pytest.mark.slow
def test_half_precision_block_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bfloat16 fidelity commands on the embedded models (one prompt each): they must exit 0, which they do only
    when every output is identical or every divergence is a proven near tie."""
    monkeypatch.chdir(tmp_path)
    for argv in commands(FIDELITY):
        _run_cli(argv, capsys)
    for name in ("ar-bf16", "dllm-bf16"):
        assert (tmp_path / "results" / name / "results.json").is_file(), name


@pytest.mark.slow
def test_setup_block_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    demos = [argv for argv in commands(SETUP) if argv[0] == "spiffy"]
    assert demos == [["spiffy", "demo"]]
    out = _run_cli(demos[0], capsys)
    assert "identical to their baselines" in out and "What the tables mean" in out


def test_retrain_block_scripts_exist_and_parse() -> None:
    for argv in commands(RETRAIN):
        script = REPO / argv[0]
        assert script.is_file() and script.stat().st_mode & 0o111, script
        check = [sys.executable, "-m", "py_compile"] if script.suffix == ".py" else ["bash", "-n"]
        subprocess.run([*check, str(script)], check=True)


@pytest.mark.slow
def test_diffusion_drafter_block_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    here = str(tmp_path) + "/"
    for argv in commands(DIFFUSION_DRAFTERS):
        argv = [w.replace("/tmp/", here) for w in argv]
        if argv[:2] == ["spiffy", "train-drafter"]:
            argv += ["--corpus", here + "corpus"]
        _run_cli(argv, capsys)
    assert (tmp_path / "runs" / "ar-all" / "results.json").is_file()
    assert (tmp_path / "runs" / "d2a1" / "model" / "MODEL_CARD.md").is_file()


@pytest.mark.slow
def test_overheads_block_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    argvs = commands(OVERHEADS)
    assert [a[:3] for a in argvs] == [["spiffy", "bench", "overheads"]]
    out = _run_cli(argvs[0], capsys)
    assert "## DDTree" in out and "nothing accepted" in out
    written = list(tmp_path.rglob("results.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["ddtree"]["vocab"] == 4096


def test_readme_stays_short() -> None:
    """A newcomer reads what spiffy does, how to set it up and call it, and what it guarantees, on one page: the
    long measurement sections live in docs/RESULTS.md and docs/MODELS.md."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    for heading in ("## Set up a fresh machine", "## Command line", "## Python", "## Headline figures",
                    "## Guarantee per dtype"):
        assert heading in readme, heading
    for linked in ("docs/RESULTS.md", "docs/MODELS.md", "docs/GPU.md", "docs/ARCHITECTURE.md", "docs/EXTENDING.md"):
        assert f"]({linked})" in readme and (REPO / linked).is_file(), linked
