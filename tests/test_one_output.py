"""One command, one output: a switch that changes speed (``--graph``, ``--budget``, ``--method``, ``--tree-budget``,
``--compile``, batching, ``--threads``, ``--device``) never changes the tokens a command prints, and the settings a graph or a model
card supplies are one default per model, named on stderr where they differ from spiffy's own.

Run through the command line exactly as a user types it (``spiffy.cli.main.main``), on the README's own sequence and
on seeded random combinations of the switches (float32). ``SPIFFY_ONE_OUTPUT_DRAWS=N`` draws N combinations per
family instead of the tiers' defaults (1 to 3 in the fast tier, 20 in the slow one).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from spiffy.cli.main import main
from spiffy.embedded import embedded_model_path, shipped_graphs

PROMPT = "def add(a, b):"
#: the README's decoding flags for a tiny dLLM
README_FLAGS = ["--gen-length", "64", "--block-length", "32", "--steps", "64"]
#: smaller runs for the random combinations (the same flags on both sides of every comparison)
DRAW_FLAGS = ["--gen-length", "32", "--block-length", "16", "--steps", "32"]
OTHER_PROMPTS = ["Write a function that reverses a list.", "x = 1"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """``--threads`` (and the one-thread default for small models) sets torch's process-wide thread count: restore it,
    so later tests run with the thread count they were written for."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[list[list[int]], str]:
    """Run one command; ``(tokens of every --json row, stderr)``; a non-zero exit fails with its stderr."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"`spiffy {' '.join(argv)}` exited {code}: {err[-2000:]}"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [row["tokens"] for row in rows], err


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``spiffy tiny FAMILY DIR`` for each dLLM family, as the README's command-line section starts."""
    base = tmp_path_factory.mktemp("one_output")
    dirs = {}
    for family in ("llada", "dream", "sdar"):
        assert main(["tiny", family, str(base / family)]) == 0
        dirs[family] = base / family
    return dirs


def _readme_sequence(capsys: pytest.CaptureFixture[str], model: list[str], graph: Path, flags: list[str],
                     max_prompts: str) -> tuple[list[int], list[int], str]:
    """generate; calibrate with its defaults; generate with --graph (the README's three commands)."""
    plain, _ = _run(capsys, ["generate", *model, "--prompt", PROMPT, *flags, "--json", "--no-progress"])
    code = main(["calibrate", *model, "--prompts", "default", "--max-prompts", max_prompts, "--out", str(graph),
                 *flags, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    fast, err = _run(capsys, ["generate", *model, "--prompt", PROMPT, *flags, "--graph", str(graph), "--budget", "3",
                              "--json", "--no-progress"])
    return plain[0], fast[0], err


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_the_readme_sequence_prints_the_same_tokens(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     tiny_dirs: dict[str, Path], family: str) -> None:
    plain, fast, err = _readme_sequence(capsys, ["--model", str(tiny_dirs[family])], tmp_path / "graph.json",
                                        README_FLAGS, "4")
    assert fast == plain and len(plain) == 64
    assert "differ from the calibration" not in err  # calibrate and generate agree on every default


@pytest.mark.slow
def test_the_readme_sequence_on_the_embedded_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain, fast, err = _readme_sequence(capsys, [], tmp_path / "graph.json", README_FLAGS, "1")
    assert fast == plain and len(plain) == 64
    assert "differ from the calibration" not in err  # calibrated with the model card's settings, as generate runs


def test_model_card_settings_are_named_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The embedded model's card (its shipped graph) sets bfloat16 and raw prompts, unlike spiffy's own defaults
    (float32 on a CPU, the chat template its tokenizer has): one stderr line names them, with --graph or without."""
    card = json.loads(shipped_graphs(embedded_model_path("dllm"))[0].read_text())["calibration"]
    assert card["dtype"] == "bfloat16" and card["chat"] is False
    lines = {}
    for graph in ("none", "auto"):
        _, err = _run(capsys, ["generate", "--prompt", PROMPT, "--gen-length", "32", "--graph", graph, "--json",
                               "--no-progress"])
        lines[graph] = [line for line in err.splitlines() if "model card" in line]
        assert len(lines[graph]) == 1, err
        assert "dtype bfloat16 (default float32)" in lines[graph][0]
        assert "raw prompts (default the chat template)" in lines[graph][0]
    assert lines["none"] == lines["auto"]
    _, err = _run(capsys, ["generate", "--prompt", PROMPT, "--dtype", "float32", "--no-chat", "--gen-length", "32",
                           "--block-length", "32", "--steps", "32", "--graph", "none", "--json", "--no-progress"])
    assert "model card" not in err  # every setting given: nothing taken from the card


def test_a_graph_never_fills_unset_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             tiny_dirs: dict[str, Path]) -> None:
    """A graph calibrated in another dtype / prompt format runs with the command's own values and one note; one
    calibrated for other decoding rules is refused, naming the flags to pass."""
    model = ["--model", str(tiny_dirs["llada"])]
    graph = tmp_path / "g.json"
    assert main(["calibrate", *model, "--prompts", "default", "--max-prompts", "2", "--out", str(graph),
                 "--no-chat", "--dtype", "float64", *README_FLAGS, "--no-progress"]) == 0
    capsys.readouterr()
    plain, _ = _run(capsys, ["generate", *model, "--prompt", PROMPT, *README_FLAGS, "--json", "--no-progress"])
    fast, err = _run(capsys, ["generate", *model, "--prompt", PROMPT, *README_FLAGS, "--graph", str(graph),
                              "--json", "--no-progress"])
    assert fast == plain
    notes = [line for line in err.splitlines() if "differ from the calibration" in line]
    assert len(notes) == 1 and "dtype float32 (graph: float64)" in notes[0]
    assert "chat template (graph: raw prompts)" in notes[0]
    code = main(["generate", *model, "--prompt", PROMPT, "--gen-length", "64", "--block-length", "16", "--steps", "64",
                 "--graph", str(graph), "--json", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "calibrated for other decoding rules" in err
    assert "--gen-length 64 --block-length 32 --steps 64" in err and "\n" not in err.strip()


# ----------------------------------------------------------------------------------------------------------------
# seeded random combinations of the switches: every one prints the plain command's tokens (float32)


def _draws(default: int) -> int:
    return int(os.environ.get("SPIFFY_ONE_OUTPUT_DRAWS", default))


def _dllm_switches(rng: random.Random, graph_file: Path | None) -> list[str]:
    graphs = ["none", f"freedave:{rng.randint(2, 5)}", f"ssd:{rng.randint(2, 5)}"]
    graphs += [str(graph_file)] if graph_file is not None else ["auto"]
    graph = rng.choice(graphs)
    argv = ["--graph", graph]
    if graph != "none" and not graph.startswith(("freedave", "ssd")) and rng.random() < 0.7:
        argv += ["--budget", str(rng.randint(1, 5))]
    if rng.random() < 0.5:
        argv += ["--threads", str(rng.randint(1, 2))]
    if rng.random() < 0.3:
        argv += ["--device", "cpu"]
    if rng.random() < 0.4:  # the static-shape forward path (captured on a GPU, the same code eagerly here)
        argv += ["--compile", rng.choice(["on", "off", "auto"])]
    return argv


def _ar_switches(rng: random.Random) -> list[str]:
    method = rng.choice(["ar", "dflash", "ddtree", "deer", "specdiff"])
    argv = ["--method", method]
    if method == "ddtree" and rng.random() < 0.8:
        argv += ["--tree-budget", str(rng.choice([2, 4, 8, 16, 32]))]
    if method in ("dflash", "deer", "specdiff") and rng.random() < 0.5:
        argv += ["--chain-length", str(rng.randint(1, 6))]
    if method == "specdiff" and rng.random() < 0.6:
        argv += ["--drafts", str(rng.randint(1, 4))]
    if rng.random() < 0.5:  # the captured static-shape path (eager on a CPU) against the eager reference
        argv += ["--compile", rng.choice(["on", "off", "auto"])]
    if rng.random() < 0.5:
        argv += ["--threads", str(rng.randint(1, 2))]
    if rng.random() < 0.3:
        argv += ["--device", "cpu"]
    return argv


def _sampling(rng: random.Random) -> list[str]:
    """T = 0, or T > 0 with a seed (the plain command gets the same flags)."""
    if rng.random() < 0.6:
        return []
    return ["--temperature", str(rng.choice([0.5, 0.8, 1.2])), "--seed", str(rng.randint(0, 10_000))]


def _batched(rng: random.Random) -> list[str]:
    """More prompts after the first (the first row is compared): a batch of 1 to 3 rows."""
    extra = rng.sample(OTHER_PROMPTS, rng.randint(0, len(OTHER_PROMPTS)))
    return [arg for p in extra for arg in ("--prompt", p)]


def _check_dllm_draws(capsys: pytest.CaptureFixture[str], tmp_path: Path, model: list[str], seed: int,
                      draws: int) -> None:
    rng = random.Random(seed)
    graph_file = None
    if model:  # a user's model ships no graph: calibrate one with the command's defaults
        graph_file = tmp_path / "g.json"
        assert main(["calibrate", *model, "--prompts", "default", "--max-prompts", "2", "--out", str(graph_file),
                     *DRAW_FLAGS, "--dtype", "float32", "--no-progress"]) == 0
        capsys.readouterr()
    # the embedded model's shipped graphs (--graph auto) fit the README's flags; a user's model takes smaller runs
    flags = DRAW_FLAGS if model else README_FLAGS
    base = ["generate", *model, "--prompt", PROMPT, *flags, "--dtype", "float32", "--json", "--no-progress"]
    for _ in range(draws):
        sampling = _sampling(rng)
        plain, _ = _run(capsys, [*base, *sampling, "--graph", "none"])
        switches = _dllm_switches(rng, graph_file) + _batched(rng)
        got, err = _run(capsys, [*base, *sampling, *switches])
        assert got[0] == plain[0], f"`{' '.join(switches + sampling)}` changed the tokens; stderr: {err[-1500:]}"


def _check_ar_draws(capsys: pytest.CaptureFixture[str], seed: int, draws: int) -> None:
    rng = random.Random(seed)
    base = ["generate", "--prompt", PROMPT, "--max-new-tokens", "16", "--dtype", "float32", "--json",
            "--no-progress"]
    for _ in range(draws):
        sampling = _sampling(rng)
        plain, _ = _run(capsys, [*base, *sampling, "--method", "ar"])
        switches = _ar_switches(rng) + _batched(rng)
        got, err = _run(capsys, [*base, *sampling, *switches])
        assert got[0] == plain[0], f"`{' '.join(switches + sampling)}` changed the tokens; stderr: {err[-1500:]}"


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_random_switches_keep_the_tokens(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         tiny_dirs: dict[str, Path], family: str) -> None:
    _check_dllm_draws(capsys, tmp_path, ["--model", str(tiny_dirs[family])], seed=len(family) * 7 + ord(family[0]),
                      draws=_draws(1))


def test_random_switches_keep_the_tokens_ar(capsys: pytest.CaptureFixture[str]) -> None:
    _check_ar_draws(capsys, seed=12, draws=_draws(2))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "embedded", "ar"])
def test_twenty_random_switch_combinations_per_family(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      tiny_dirs: dict[str, Path], family: str) -> None:
    draws = _draws(20)
    if family == "ar":
        _check_ar_draws(capsys, seed=1000, draws=draws)
    elif family == "embedded":
        _check_dllm_draws(capsys, tmp_path, [], seed=1001, draws=draws)
    else:
        _check_dllm_draws(capsys, tmp_path, ["--model", str(tiny_dirs[family])], seed=1002 + len(family),
                          draws=draws)
