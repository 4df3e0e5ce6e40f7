"""`spiffy bench dllm` / `spiffy generate` with no flags run in the configuration of the model card (the graphs shipped
with the model, dtype and prompt format included), with or without --graph, and say so; a flag picks the shipped
graph calibrated for it (`--chat` the chat graph, `--threshold 0.9` the threshold graph); a setting that still differs
from the graph's is named in one line; the default benchmark prompts skip those the embedded models' development
used; FreeDave and SSD run at equal widths."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from spiffy.bench.datasets import HELD_OUT_FROM, held_out_from, load_benchmark_prompts
from spiffy.cli.bench_run import _rival_widths
from spiffy.cli.graph_defaults import (card_note, difference_note, differences, pick_defaults_graph, requested_decoding,
                                       settle_settings)
from spiffy.cli.main import build_parser
from spiffy.decoding import DecodeConfig
from spiffy.embedded import embedded_model_path, shipped_graphs
from spiffy.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "dllm", "--out", "/tmp/x", *argv])


def _settle(args: argparse.Namespace):
    return settle_settings(args, embedded_model_path("dllm"), chat=None if args.no_chat is None else not args.no_chat,
                           has_template=True, device="cpu")


def test_unset_dtype_and_prompt_format_come_from_the_model_card() -> None:
    args = _args()
    assert args.dtype is None and args.no_chat is None and args.out == "/tmp/x"  # unset: the model card decides
    settings = _settle(args)
    assert settings.dtype == "bfloat16" and settings.chat is False and settings.card == shipped_graphs(
        embedded_model_path("dllm"))[0]
    assert settings.config.gen_length == 64 and settings.config.block_length == 32
    note = card_note("spiffy bench dllm", embedded_model_path("dllm"), settings)
    assert "dtype bfloat16 (default float32)" in note and "raw prompts" in note and "\n" not in note
    assert _settle(_args("--graph", "tiny-sdar-t09")) == settings  # --graph plays no part


def test_a_chosen_setting_stands_and_a_difference_is_named_in_one_line() -> None:
    args = _args("--dtype", "float32", "--chat")
    settings = _settle(args)
    assert settings.dtype == "float32" and settings.chat is True  # the user's choice stands
    assert not any("dtype" in t or "chat" in t for t in settings.taken)
    recorded = {"dtype": "bfloat16", "chat": False, "decode_config": {"gen_length": 64, "steps": 64, "threshold": None}}
    diffs = differences(recorded, "float32", True, DecodeConfig(gen_length=128, steps=64))
    assert diffs == ["dtype float32 (graph: bfloat16)", "chat template (graph: raw prompts)",
                     "gen length 128 (graph: 64)"]
    assert differences(recorded, "bfloat16", False, DecodeConfig(gen_length=64, steps=64)) == []
    note = difference_note("spiffy bench dllm", "/g/tiny-sdar-s1.json", diffs)
    assert "\n" not in note and "dtype float32 (graph: bfloat16)" in note and "fewer forwards saved" in note


def _shipped_with_a_chat_copy(tmp_path: Path) -> list[Path]:
    """The embedded model's shipped graphs plus a copy of its first one recorded as calibrated on the chat template."""
    shipped = shipped_graphs(embedded_model_path("dllm"))
    first = json.loads(shipped[0].read_text())
    first["calibration"]["chat"] = not first["calibration"]["chat"]
    chat = tmp_path / f"{shipped[0].stem}_other.json"
    chat.write_text(json.dumps(first))
    for p in shipped:
        shutil.copy(p, tmp_path / p.name)
    return sorted(tmp_path.glob("*.json"))


def test_the_flags_given_pick_the_shipped_graph_calibrated_for_them(tmp_path: Path) -> None:
    graphs = _shipped_with_a_chat_copy(tmp_path)
    recorded = [json.loads(p.read_text())["calibration"] for p in graphs]
    assert pick_defaults_graph(graphs, None, None, {}) == graphs[0]  # nothing given: the first
    assert pick_defaults_graph([], None, None, {}) is None
    for i, rec in enumerate(recorded):  # each graph is chosen by the settings it alone was calibrated with
        decoding = {k: rec["decode_config"][k] for k in ("threshold", "steps")}
        same = [j for j, r in enumerate(recorded) if bool(r["chat"]) == bool(rec["chat"])
                and {k: r["decode_config"][k] for k in decoding} == decoding]
        assert pick_defaults_graph(graphs, rec["dtype"], bool(rec["chat"]), decoding) == graphs[same[0]]
    args = _args("--threshold", "0.9", "--gen-length", "128")
    assert requested_decoding(args)["threshold"] == 0.9 and requested_decoding(args)["gen_length"] == 128
    pick = pick_defaults_graph(graphs, None, None, requested_decoding(args))  # gen length fits none: threshold decides
    assert json.loads(pick.read_text())["calibration"]["decode_config"]["threshold"] == 0.9


def test_rivals_default_to_the_spiffy_rows_widths() -> None:
    assert _rival_widths(None, [1, 3, 5]) == "2,4,6"
    assert _rival_widths("none", [1, 3, 5]) is None and _rival_widths("2,3", [1]) == "2,3"


def test_default_prompts_skip_those_the_development_used(tmp_path: Path) -> None:
    assert held_out_from("humaneval") == held_out_from("HumanEval") == HELD_OUT_FROM["humaneval"] == 90
    assert held_out_from("mbpp") == 0 and _args().skip is None
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": str(k), "prompt": f"p{k}"}) + "\n" for k in range(5)))
    assert [p.id for p in load_benchmark_prompts(str(f), skip=2, max_prompts=2)] == ["2", "3"]
    assert [p.id for p in load_benchmark_prompts(str(f), skip=4)] == ["4"]
    for bad in (5, -1):
        with pytest.raises(ConfigError, match="skip"):
            load_benchmark_prompts(str(f), skip=bad)


def test_ar_keeps_the_chat_template_by_default() -> None:
    args = build_parser().parse_args(["bench", "ar", "--out", "/tmp/x"])
    assert not args.no_chat  # None: the chat template, as before


def test_the_default_run_adds_the_threshold_regime_with_its_shipped_graph() -> None:
    """With no decoding flags, `bench dllm` also runs threshold 0.9 with the graph shipped for it; a run already at
    a threshold, a graph named, or --also-threshold none adds nothing; a threshold no shipped graph fits is refused
    with a fix."""
    from spiffy.cli.bench_run import _companion_graph

    model_dir = embedded_model_path("dllm")

    def companion(*argv: str):
        args = _args(*argv)
        settings = _settle(args)
        args.dtype, args.no_chat = settings.dtype, not settings.chat
        return _companion_graph(args, settings.config, model_dir)

    tau, graph = companion()
    assert tau == 0.9 and json.loads(graph.read_text())["calibration"]["decode_config"]["threshold"] == 0.9
    assert json.loads(graph.read_text())["calibration"]["chat"] is False  # the main run's prompt format
    assert companion("--also-threshold", "none") is None
    assert companion("--threshold", "0.9") is None and companion("--graph", "tiny-sdar-s1") is None
    assert companion("--threshold", "0.9", "--also-threshold", "0.9")[0] == 0.9  # asked for: run
    with pytest.raises(ConfigError, match="no graph shipped .* threshold 0.5"):
        companion("--also-threshold", "0.5")
    with pytest.raises(SystemExit):
        _args("--also-threshold", "1.5")


@pytest.mark.slow
def test_the_threshold_regime_is_reported_beside_the_main_one(tmp_path: Path) -> None:
    from spiffy.cli.main import main

    out = tmp_path / "b"
    rc = main(["bench", "dllm", "--dataset", "humaneval", "--max-prompts", "1", "--budgets", "3", "--freedave", "none",
               "--ssd", "none", "--gen-length", "32", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    comp = res["companion"]
    assert comp["decoding"]["threshold"] == 0.9 and res["decoding"]["threshold"] is None
    assert comp["prompt_ids"] == res["prompt_ids"] and [r["budget"] for r in comp["runs"]] == [3]
    assert comp["all_identical"] is True and res["all_identical"] is True
    assert comp["graph"]["path"].endswith("tiny-sdar-t09.json")
    assert "## Spiffy on top of threshold 0.9 decoding" in (out / "results.md").read_text()
