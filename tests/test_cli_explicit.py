"""Issue 23, item 4: an explicit command line. The mode follows from what the user asked; a flag that does not
apply is refused with a one-line error (exit 2) before any model is read, never ignored; one flag, one meaning;
one entry point per mode.

Every combination below was silently ignored before (the closing note of issue 23 lists them).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from spiffy.cli.main import build_parser, main
from spiffy.embedded import is_embedded_available

#: paths that do not exist: a refusal must come before any checkpoint is read
NOWHERE = "/nonexistent/spiffy-model"


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (argv, code, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


#: (command line, flags the error must name) of combinations that used to be ignored
IGNORED_BEFORE: list[tuple[list[str], tuple[str, ...]]] = [
    # an AR method without --target used to run the dLLM baseline; --budget meant tree nodes in AR mode
    (["generate", "--method", "ddtree", "--budget", "16", "--prompt", "x"], ("--budget", "--tree-budget")),
    (["generate", "--target", NOWHERE, "--graph", "g.json", "--prompt", "x"], ("--graph",)),
    (["generate", "--target", NOWHERE, "--gen-length", "8", "--steps", "8", "--prompt", "x"],
     ("--gen-length", "--steps")),
    (["generate", "--method", "ar", "--model", NOWHERE, "--prompt", "x"], ("--model",)),
    (["generate", "--target", NOWHERE, "--score", "gm", "--prompt", "x"], ("--score",)),
    (["generate", "--model", NOWHERE, "--max-new-tokens", "8", "--prompt", "x"], ("--max-new-tokens",)),
    (["generate", "--model", NOWHERE, "--tree-budget", "8", "--drafts", "2", "--prompt", "x"],
     ("--tree-budget", "--drafts")),
    (["generate", "--model", NOWHERE, "--accept", "rejection", "--prompt", "x"], ("--accept",)),
    (["generate", "--model", NOWHERE, "--graph", "none", "--budget", "3", "--prompt", "x"], ("--budget",)),
    (["generate", "--model", NOWHERE, "--graph", "none", "--score", "reach", "--prompt", "x"], ("--score",)),
    (["generate", "--target", NOWHERE, "--method", "dflash", "--tree-budget", "8", "--prompt", "x"],
     ("--tree-budget",)),
    (["generate", "--target", NOWHERE, "--method", "ddtree", "--drafts", "3", "--prompt", "x"], ("--drafts",)),
    (["generate", "--target", NOWHERE, "--method", "deer", "--drafts", "3", "--prompt", "x"], ("--drafts",)),
    (["generate", "--target", NOWHERE, "--method", "ddtree", "--chain-length", "3", "--prompt", "x"],
     ("--chain-length",)),
    (["generate", "--target", NOWHERE, "--method", "ar", "--accept", "rejection", "--prompt", "x"], ("--accept",)),
    (["generate", "--target", NOWHERE, "--method", "ar", "--drafter", NOWHERE, "--prompt", "x"], ("--drafter",)),
    (["generate", "--drafter", NOWHERE, "--prompt", "x"], ("--drafter", "--target")),
    (["graph", "show", "g.json", "--depth", "3", "--gen-length", "8"], ("--depth", "--gen-length")),
    (["graph", "validate", "g.json", "--out", "x.png"], ("--out",)),
    (["demo", "--only", "ar", "--graph", "g.json", "--budget", "2"], ("--graph", "--budget")),
    (["demo", "--only", "dllm", "--target", NOWHERE, "--tree-budget", "8"], ("--target", "--tree-budget")),
]


@pytest.mark.parametrize("argv, flags", IGNORED_BEFORE, ids=[" ".join(a[:4]) for a, _ in IGNORED_BEFORE])
def test_flags_that_do_not_apply_are_refused(capsys, argv: list[str], flags: tuple[str, ...]) -> None:
    err = _refused(capsys, argv)
    assert "fix:" in err
    for flag in flags:
        assert flag in err, (flag, err)


@pytest.mark.skipif(not (is_embedded_available("ar-target") and is_embedded_available("ar-drafter")),
                    reason="embedded AR pair not shipped")
def test_an_ar_method_without_target_runs_on_the_embedded_pair(capsys) -> None:
    assert main(["generate", "--method", "ddtree", "--tree-budget", "16", "--prompt", "def f(x):", "--max-new-tokens",
                 "8", "--json", "--no-progress"]) == 0
    ddtree = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ddtree["method"] == "ddtree" and ddtree["budget"] == 16 and len(ddtree["tokens"]) == 8
    assert ddtree["target"].endswith("tiny-qwen3") and ddtree["drafter"].endswith("tiny-qwen3-dflash-b16")
    assert main(["generate", "--method", "ar", "--prompt", "def f(x):", "--max-new-tokens", "8", "--json",
                 "--no-progress"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["drafter"] is None and plain["tokens"] == ddtree["tokens"]  # lossless


def test_shared_flags_have_one_definition_and_one_meaning() -> None:
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]  # noqa: SLF001
    options = [o for a in generate._actions for o in a.option_strings]  # noqa: SLF001
    assert len(options) == len(set(options))
    args = generate.parse_args(["--prompt", "x"])
    assert args.top_p is None and args.top_k is None and args.temperature == 0.0  # "off" is None, in both modes
    budget = next(a for a in generate._actions if a.dest == "budget")  # noqa: SLF001
    tree = next(a for a in generate._actions if a.dest == "tree_budget")  # noqa: SLF001
    assert "drafts per step" in budget.help and "tree" not in budget.help
    assert "draft-tree nodes" in tree.help


def test_one_entry_point_per_mode() -> None:
    generate_ar = importlib.import_module("spiffy.cli.generate_ar")
    assert not hasattr(generate_ar, "main") and not hasattr(generate_ar, "add_ar_arguments")
    assert importlib.util.find_spec("spiffy.ar") is None  # the old package (and its spiffy.ar.cli) is gone


def test_threshold_and_top_p_are_checked_by_the_parser(capsys) -> None:
    for argv, needle in ((["--threshold", "0"], "outside (0, 1]"), (["--top-p", "1.5"], "outside (0, 1]"),
                         (["--tree-budget", "-1"], "--tree-budget must be >= 0"), (["--threads", "-2"], ">= 0")):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "--prompt", "x", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_bench_refuses_two_batch_size_flags(capsys, tmp_path: Path) -> None:
    err = _refused(capsys, ["bench", "dllm", "--batch-sizes", "1,2", "--batch-size", "4", "--out", str(tmp_path)])
    assert "--batch-sizes or --batch-size" in err
