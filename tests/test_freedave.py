"""FreeDave as a Spiffy graph: the top-k chain's shape, its compatibility with the decoding config, losslessness
(float64, tiny LLaDA) and real acceptance on the shipped trained tiny LLaDA."""

from __future__ import annotations

import pytest
import torch

from spiffy.decoding import DecodeConfig
from spiffy.api import generate
from spiffy.embedded import embedded_model_path
from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.selfspec.freedave import chain_formulas, chain_graph_for, freedave_graph, parse_freedave_steps

PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n")


def test_chain_formulas_one_and_two_tokens_per_step() -> None:
    assert chain_formulas(3) == [(1, ((1, 1),)), (2, ((1, 1), (2, 1))), (3, ((1, 1), (2, 1), (3, 1)))]
    assert chain_formulas(2, 2) == [(1, ((1, 1), (2, 1))), (2, ((1, 1), (2, 1), (3, 1), (4, 1)))]
    with pytest.raises(ConfigError):
        chain_formulas(0)
    assert parse_freedave_steps("freedave:4") == 4
    with pytest.raises(ConfigError):
        parse_freedave_steps("freedave:1")


def test_chain_graph_is_a_chain_compatible_with_its_config(tiny_llada) -> None:
    model = load_model(tiny_llada, dtype="float64")
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8)  # 2 tokens per step
    g = freedave_graph(model, cfg, 4)  # K = 4 draft steps -> depth 3
    assert [n.level for n in g.nodes] == [1, 2, 3]
    assert [n.parents for n in g.nodes] == [(), (0,), (1,)]
    assert g.nodes[-1].pairs == tuple((i, 1) for i in range(1, 7))
    assert g.calibrated_for["tokens_per_step"] == 2
    ids = torch.tensor([[5, 6, 7]])
    assert generate(model, ids, cfg, graph=g, budget=3).tokens == generate(model, ids, cfg).tokens


@pytest.mark.parametrize("config", [DecodeConfig(gen_length=16, block_length=8, steps=16),
                                    DecodeConfig(gen_length=16, block_length=8, threshold=0.2)])
def test_chain_output_equals_baseline_float64(tiny_llada, config: DecodeConfig) -> None:
    model = load_model(tiny_llada, dtype="float64")
    for depth in (1, 3, 5):
        g = chain_graph_for(model, config, depth)
        for seq in ([3, 9, 11, 4], [17, 2]):
            ids = torch.tensor([seq])
            assert generate(model, ids, config, graph=g, budget=depth).tokens == generate(model, ids, config).tokens


def test_freedave_accepts_drafts_on_shipped_tiny_llada() -> None:
    path = embedded_model_path("dllm")
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    cfg = DecodeConfig(gen_length=32, block_length=32, steps=32)
    g = freedave_graph(model, cfg, 4)
    accepted = 0
    for text in PROMPTS:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        base = generate(model, ids, cfg)
        spec = generate(model, ids, cfg, graph=g, budget=len(g))
        assert spec.tokens == base.tokens, text
        accepted += int(spec.stats["accepted_total"])
        assert spec.nfe <= base.nfe
    # measured 10 and 15 of 32 steps saved; a chain of second-ranked tokens saves 2 and 1
    assert accepted >= 4 * len(PROMPTS)


def test_bench_dllm_freedave_rows(tiny_llada, tmp_path) -> None:
    """``spiffy bench dllm --freedave 2,3``: FreeDave rows next to Spiffy's, same prompts, identical to the baseline."""
    import json

    from spiffy.cli.main import main
    from spiffy.selfspec.calibrate import calibrate

    model = load_model(tiny_llada, dtype="float64")
    cfg = DecodeConfig(gen_length=8, block_length=4)
    graph = calibrate(model, load_tokenizer(tiny_llada), ["def f(x):", "import os"], cfg, nodes=3, chat=False,
                      progress=False)
    graph.save(tmp_path / "g.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"id": "b", "prompt": "for i in range(3):"}\n')
    out = tmp_path / "bench"
    rc = main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(tmp_path / "g.json"), "--budgets", "1",
               "--freedave", "2,3", "--ssd", "none", "--dataset", str(prompts), "--gen-length", "8", "--block-length", "4",
               "--dtype", "float64", "--no-chat", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["budget"], r["states_per_forward"]) for r in res["runs"]] == [
        ("spiffy", 1, 2), ("freedave", 1, 2), ("freedave", 2, 3)]
    base = res["baseline"]["nfe_total"]
    for r in res["runs"]:
        assert r["identical_fraction"] == 1.0
        assert r["nfe_total"] + r["accepted_total"] + r["reused_steps"] == base
    assert all(set(p["spiffy"]) == {"1", "freedave:2", "freedave:3"} for p in res["per_prompt"])
    md = (out / "results.md").read_text()
    assert "| freedave 2 | 1 |" in md and "| freedave 3 | 2 |" in md and "| spiffy | 1 |" in md
    rc = main(["bench", "dllm", "--model", str(tiny_llada), "--graph", str(tmp_path / "g.json"), "--freedave", "1",
               "--dataset", str(prompts), "--gen-length", "8", "--block-length", "4", "--no-chat", "--out", str(out)])
    assert rc == 2  # a clear ConfigError: FreeDave needs >= 2 draft steps


def test_graph_chain_cli_and_generate_freedave(tiny_llada, tmp_path, capsys) -> None:
    """`spiffy graph chain` writes a valid chain file; `spiffy generate` with it or with freedave:K prints the
    baseline's tokens."""
    import json

    from spiffy.cli.main import main
    from spiffy.selfspec.graph import load_graph

    flags = ["--gen-length", "8", "--block-length", "4", "--steps", "8"]
    out = tmp_path / "chain.json"
    assert main(["graph", "chain", "--depth", "2", "--model", str(tiny_llada), *flags, "--out", str(out)]) == 0
    g = load_graph(out)
    assert [n.pairs for n in g.nodes] == [((1, 1),), ((1, 1), (2, 1))]
    assert g.calibrated_for["tokens_per_step"] == 1 and g.meta["calibration"]["method"] == "chain"
    assert main(["graph", "chain", "--model", str(tiny_llada), "--out", str(out)]) == 2  # no --depth
    capsys.readouterr()
    texts = []
    for extra in ([], ["--graph", str(out), "--budget", "2"], ["--graph", "freedave:3"]):
        rc = main(["generate", "--model", str(tiny_llada), "--prompt", "def f(x):", *flags, "--dtype", "float64",
                   "--json", "--no-progress", *extra])
        assert rc == 0
        texts.append(json.loads(capsys.readouterr().out)["tokens"])
    assert texts[0] == texts[1] == texts[2]
