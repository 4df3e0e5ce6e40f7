"""`spiffy bench dllm` with no flags runs in the configuration the graph was calibrated for (dtype and prompt format
included), says so, and names a setting the user chose that differs from the graph's."""

from __future__ import annotations

import argparse

import pytest

from spiffy.cli.bench_run import _graph_settings
from spiffy.cli.main import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "dllm", "--out", "/tmp/x", *argv])


def test_unset_dtype_and_prompt_format_come_from_the_graph(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args()
    assert args.dtype is None and args.no_chat is None  # unset: the graph decides
    _graph_settings(args, {"dtype": "bfloat16", "chat": False}, "/g/tiny-sdar-s1.json")
    assert args.dtype == "bfloat16" and args.no_chat is True
    err = capsys.readouterr().err
    assert "calibrated with dtype bfloat16, raw prompts" in err and err.count("\n") == 1


def test_a_chosen_setting_that_differs_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--dtype", "float32", "--chat")
    _graph_settings(args, {"dtype": "bfloat16", "chat": False}, "/g/tiny-sdar-s1.json")
    assert args.dtype == "float32" and args.no_chat is False  # the user's choice stands
    err = capsys.readouterr().err
    assert "dtype float32 (graph: bfloat16)" in err and "chat template (graph: raw prompts)" in err


def test_ar_keeps_the_chat_template_by_default() -> None:
    args = build_parser().parse_args(["bench", "ar", "--out", "/tmp/x"])
    assert not args.no_chat  # None: the chat template, as before
