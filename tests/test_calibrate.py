"""Calibration on a tiny LLaDA checkpoint, prompt sets, and the `spiffy calibrate` CLI round trip."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import torch
from conftest import load_f64

from spiffy.cli.main import main
from spiffy.decoding import DecodeConfig, make_session, run_baseline
from spiffy.selfspec.graph import runtime_signature as decoding_runtime_signature
from spiffy.errors import ConfigError, GraphMismatchError
from spiffy.models import load_tokenizer
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.graph import DraftGraph, load_graph, model_config_fingerprint
from spiffy.selfspec.prompts import NAMED_SETS, load_prompt_records, load_prompts, prompt_token_ids
from spiffy.selfspec.runtime import speculative_generate

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def add(a, b):", "The sum of 2 and 3 is", "import os\nprint("]


def _strip_date(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    d["calibration"].pop("date")
    return d


# ---------------------------------------------------------------------------------------------------- prompt sets
def test_default_set_copies_identical_and_balanced() -> None:
    repo_copy = REPO / "calibration" / "default.jsonl"
    pkg_copy = REPO / "spiffy" / "data" / "calibration" / "default.jsonl"
    assert repo_copy.read_bytes() == pkg_copy.read_bytes()
    rows = load_prompt_records("default")
    assert len(rows) == 50
    assert [r["source"] for r in rows] == ["math500", "mbpp"] * 25  # interleaved: prefixes mix both tasks
    assert len({(r["source"], r["id"]) for r in rows}) == 50
    assert all(r["id"] < 11 or r["id"] > 510 for r in rows if r["source"] == "mbpp")  # never the MBPP eval split
    assert len(load_prompts("default-math")) == 25 and len(load_prompts("default-code")) == 25
    assert set(NAMED_SETS) >= {"default", "default-math", "default-code"}


def test_default_set_regenerates_from_datasets() -> None:
    from spiffy.bench.datasets import shipped_datasets_dir

    datasets = shipped_datasets_dir()  # shipped with the package: this test never skips
    spec = importlib.util.spec_from_file_location("make_default", REPO / "calibration" / "make_default.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    assert mod.build(datasets) == (REPO / "calibration" / "default.jsonl").read_text(encoding="utf-8")


def test_load_prompts_files_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 7}\n')
    assert load_prompts(good) == ["a", "b"]
    assert load_prompts(str(good)) == ["a", "b"]
    cases = {
        "bad.jsonl": ('{"prompt": "a"}\n{oops}\n', "line 2: not valid JSON"),
        "nofield.jsonl": ('{"text": "a"}\n', "line 1: missing field 'prompt'"),
        "empty_prompt.jsonl": ('{"prompt": "  "}\n', "non-empty string"),
        "list.jsonl": ("[1, 2]\n", "expected a JSON object"),
        "empty.jsonl": ("\n", "holds no prompts"),
    }
    for name, (text, match) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_prompts(p)
    with pytest.raises(ConfigError, match="prompt file .* does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="unknown prompt set 'nope'.*default"):
        load_prompts("nope")


def test_chat_template_applied(tiny_llada: Path) -> None:
    tok = load_tokenizer(tiny_llada)
    plain = prompt_token_ids(tok, "hello", chat=False)
    chat = prompt_token_ids(tok, "hello", chat=True)
    assert plain and chat
    if getattr(tok, "chat_template", None):
        assert len(chat) > len(plain)
    else:  # pragma: no cover - depends on the tiny tokenizer
        assert chat == plain


# ---------------------------------------------------------------------------------------------------- calibrate
def test_calibrate_tiny_llada_deterministic_and_consistent_with_runtime(tiny_llada: Path, tmp_path: Path) -> None:
    model = load_f64(tiny_llada, cached=True)
    tok = load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=16, block_length=4, temperature=0.7)  # sampled: the seed matters
    kw = dict(nodes=8, seed=3, progress=False, max_prompts=2)
    g1 = calibrate(model, tok, PROMPTS, cfg, **kw)
    g2 = calibrate(model, tok, PROMPTS, cfg, **kw)
    g1.validate()
    assert 0 < len(g1) <= 8
    # same seed -> identical file apart from the date
    g1.save(tmp_path / "a.json")
    g2.save(tmp_path / "b.json")
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert _strip_date(a) == _strip_date(b)
    assert load_graph(tmp_path / "a.json") == g1
    # what it was calibrated for, and how
    cf = g1.calibrated_for
    assert cf["family"] == "llada" and cf["block_length"] == 4 and cf["steps_per_block"] == 4
    assert cf["tokens_per_step"] == 1 and cf["cache"] == "none" and cf["temperature"] == 0.7
    assert cf["mask_id"] == model.config.mask_token_id
    assert cf["config_fingerprint"] == model_config_fingerprint(model)
    cal = g1.meta["calibration"]
    assert cal["num_prompts"] == 2 and cal["seed"] == 3 and cal["objective"] == "greedy" and cal["i_max"] == 4
    assert cal["j_max"] == 4 and cal["library_version"] and cal["date"] and cal["command"]
    # the projected ceiling is exactly what the runtime achieves with every node kept, on the same prompts/seeds
    runtime_nfe = 0
    for k, text in enumerate(PROMPTS[:2]):
        ids = torch.tensor([prompt_token_ids(tok, text)], dtype=torch.long)
        base = make_session(model, ids, cfg, seed=3 + k)
        run_baseline(base)
        spec = make_session(model, ids, cfg, seed=3 + k)
        stats = speculative_generate(spec, g1, budget=len(g1))
        assert torch.equal(spec.x, base.x)  # lossless
        runtime_nfe += stats.nfe
        # the graph is compatible with its own runtime configuration, and not with another block length
        g1.check_compatible(decoding_runtime_signature(model, spec))
        other = make_session(model, ids, cfg.replace(block_length=8), seed=0)
        with pytest.raises(GraphMismatchError, match="block_length"):
            g1.check_compatible(decoding_runtime_signature(model, other))
    p = g1.projected
    assert p["projected_nfe"] == runtime_nfe
    assert p["baseline_nfe"] == 2 * 16 and p["projected_nfe"] < p["baseline_nfe"]
    assert p["reduction"] == pytest.approx(p["baseline_nfe"] / p["projected_nfe"])


def test_calibrate_prefix_cache_and_objectives(tiny_llada: Path) -> None:
    model = load_f64(tiny_llada, cached=True)
    tok = load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="prefix")
    ids = [prompt_token_ids(tok, PROMPTS[2])]
    graphs = {obj: calibrate(model, tok, ids, cfg, nodes=4, objective=obj, progress=False) for obj in ("greedy", "exact", "cumfreq")}
    for obj, g in graphs.items():
        g.validate()
        assert g.meta["calibration"]["objective"] == obj and g.calibrated_for["cache"] == "prefix"
    # the exact optimum saves at least as much as greedy (the calibration objective)
    assert graphs["exact"].projected["objective"] >= graphs["greedy"].projected["objective"]
    base = make_session(model, torch.tensor(ids), cfg, seed=0)
    base_stats = run_baseline(base)
    for obj, g in graphs.items():  # every objective's graph decodes losslessly through the prefix cache
        spec = make_session(model, torch.tensor(ids), cfg, seed=0)
        stats = speculative_generate(spec, g, budget=len(g))
        assert torch.equal(spec.x, base.x), obj
        assert stats.nfe <= base_stats.nfe, obj
        if obj == "greedy":
            assert stats.nfe == g.projected["projected_nfe"] < base_stats.nfe  # saves what it projects
    # a recorded pruning score is what the runtime then prunes with by default
    reach = calibrate(model, tok, ids, cfg, nodes=4, max_level=2, score="reach", progress=False)
    assert reach.meta["calibration"]["score"] == reach.pruning_score == "reach"
    assert "score" not in graphs["greedy"].meta["calibration"] and graphs["greedy"].pruning_score is None
    spec = make_session(model, torch.tensor(ids), cfg, seed=0)
    assert speculative_generate(spec, reach, budget=2).score == "reach"
    assert torch.equal(spec.x, base.x)
    with pytest.raises(ConfigError, match="unknown pruning score"):
        calibrate(model, tok, ids, cfg, score="magic", progress=False)
    with pytest.raises(ConfigError, match="objective"):
        calibrate(model, tok, ids, cfg, objective="magic", progress=False)
    with pytest.raises(ConfigError, match="no calibration prompts"):
        calibrate(model, tok, [], cfg, progress=False)


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_calibrate_round_trip(tiny_llada: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "graph.json"
    argv = ["calibrate", "--model", str(tiny_llada), "--prompts", str(prompts), "--out", str(out), "--nodes", "5",
            "--gen-length", "16", "--block-length", "8", "--dtype", "float64", "--no-progress", "--seed", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "projected:" in captured.out and "fewer forwards" in captured.out
    assert f"wrote {out}" in captured.err
    g = load_graph(out)
    cal = g.meta["calibration"]
    assert cal["dataset"] == str(prompts) and cal["num_prompts"] == 2 and cal["seed"] == 1
    cmd = shlex.split(cal["command"])
    assert cmd[:2] == ["spiffy", "calibrate"] and "--model" in cmd and cmd[cmd.index("--nodes") + 1] == "5"
    assert cmd[cmd.index("--block-length") + 1] == "8" and cmd[cmd.index("--out") + 1] == str(out)
    assert g.calibrated_for["model"] == str(tiny_llada)
    # graph show prints the same summary
    assert main(["graph", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"{len(g)} node(s)" in shown and "calibrated for: family=llada" in shown and cal["command"] in shown
    # the embedded command reproduces the file (apart from the date)
    out2 = tmp_path / "graph2.json"
    cmd[cmd.index("--out") + 1] = str(out2)
    assert main(cmd[1:] + ["--no-progress"]) == 0
    capsys.readouterr()
    a, b = (json.loads(p.read_text()) for p in (out, out2))
    a["calibration"].pop("command")
    b["calibration"].pop("command")
    assert _strip_date(a) == _strip_date(b)


def test_cli_calibrate_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIFFY_EMBEDDED_DIR", str(tmp_path / "no-embedded-models"))
    assert main(["calibrate", "--out", str(tmp_path / "g.json")]) == 2
    assert "no model given" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(tmp_path), "--prompts", "nope", "--out", str(tmp_path / "g.json")]) == 2
    assert "unknown prompt set" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_graph_file_from_api_is_a_draft_graph(tmp_path: Path) -> None:
    # DraftGraph round trip through the file API used by the CLI (no model needed)
    g = DraftGraph.from_formulas([(1, [(1, 1)])], meta={"calibrated_for": {"family": "llada"}})
    g.save(tmp_path / "x.json")
    assert load_graph(tmp_path / "x.json") == g


def test_code_set_copies_identical_and_loadable() -> None:
    from spiffy.selfspec.prompts import load_prompt_records

    repo_copy = REPO / "calibration" / "code.jsonl"
    pkg_copy = REPO / "spiffy" / "data" / "calibration" / "code.jsonl"
    assert repo_copy.read_bytes() == pkg_copy.read_bytes()
    rows = load_prompt_records("code")
    assert len(rows) == 50 and len({r["id"] for r in rows}) == 50
    assert all(r["source"] == "stdlib-heldout" and "def " in r["prompt"] and '"""' in r["prompt"] for r in rows)
