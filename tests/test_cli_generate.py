"""``spiffy generate`` (dLLM mode) and the public generate() dispatch, on tiny checkpoints of every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_f64

from spiffy.cli.main import build_parser, main
from spiffy.decoding import DecodeConfig
from spiffy.api import generate
from spiffy.errors import GraphMismatchError
from spiffy.embedded import EMBEDDED_NAMES
from spiffy.models.loading import load_tokenizer

PROMPT = "def square(x):"


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict | None, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    payload = json.loads(out.strip().splitlines()[-1]) if code == 0 and "--json" in argv else None
    return code, payload, err


def _ids(tok, text: str = PROMPT) -> torch.Tensor:
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def test_generate_json_llada_matches_api(capsys, tiny_llada: Path):
    argv = ["generate", "--model", str(tiny_llada), "--prompt", PROMPT, "--gen-length", "8", "--block-length", "4",
            "--steps", "8", "--temperature", "0.7", "--seed", "5", "--remasking", "random", "--dtype", "float64",
            "--no-chat", "--json"]
    code, payload, err = _run(capsys, argv)
    assert code == 0
    assert {"tokens", "text", "nfe", "seconds", "steps", "config"} <= set(payload)
    model, tok = load_f64(tiny_llada, cached=True), load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=8, temperature=0.7, seed=5, remasking="random")
    res = generate(model, _ids(tok), cfg, tokenizer=tok)
    assert payload["tokens"] == res.tokens[0] and len(payload["tokens"]) == 8
    assert payload["nfe"] == res.nfe == 8 and payload["steps"] == 8
    assert payload["text"] == res.text[0]
    assert payload["config"]["seed"] == 5 and payload["config"]["remasking"] == "random"
    assert "denoising" in err  # progress bar on stderr


def test_generate_json_dream_with_cache(capsys, tiny_dream: Path):
    argv = ["generate", "--model", str(tiny_dream), "--prompt", PROMPT, "--gen-length", "8", "--block-length", "4",
            "--steps", "4", "--alg", "entropy", "--cache", "dual", "--top-p", "0.9", "--temperature", "0.5",
            "--dtype", "float64", "--no-chat", "--json", "--no-progress"]
    code, payload, err = _run(capsys, argv)
    assert code == 0 and err == ""
    model, tok = load_f64(tiny_dream, cached=True), load_tokenizer(tiny_dream)
    cfg = DecodeConfig(gen_length=8, block_length=4, steps=4, alg="entropy", cache="dual", top_p=0.9, temperature=0.5, seed=0)
    res = generate(model, _ids(tok), cfg)
    assert payload["tokens"] == res.tokens[0]
    assert payload["nfe"] == res.nfe and payload["family"] == "dream"


def test_generate_sdar_dispatch(capsys, tiny_sdar: Path):
    argv = ["generate", "--model", str(tiny_sdar), "--prompt", PROMPT, "--gen-length", "8", "--block-length", "4",
            "--steps", "8", "--dtype", "float64", "--no-chat", "--json", "--no-progress"]
    code, payload, _ = _run(capsys, argv)
    assert code == 0 and payload["family"] == "sdar"
    model, tok = load_f64(tiny_sdar, cached=True), load_tokenizer(tiny_sdar)
    res = generate(model, _ids(tok), DecodeConfig(gen_length=8, block_length=4, steps=8))
    assert payload["tokens"] == res.tokens[0]
    assert type(res.config).__name__ == "SDARDecodeConfig"


def test_chat_flag_uses_template(capsys, tiny_llada: Path):
    base = ["generate", "--model", str(tiny_llada), "--prompt", "hi", "--gen-length", "4", "--steps", "4",
            "--dtype", "float64", "--json", "--no-progress"]
    _, plain, _ = _run(capsys, base + ["--no-chat"])
    _, chat, _ = _run(capsys, base + ["--chat"])
    _, default, _ = _run(capsys, base)  # the default: the chat template, as the tokenizer has one
    assert default["prompt_tokens"] == chat["prompt_tokens"] and default["chat"] is True
    tok = load_tokenizer(tiny_llada)
    expected = len(tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"])
    assert chat["prompt_tokens"] == expected > plain["prompt_tokens"]


def test_plain_text_output(capsys, tiny_llada: Path):
    code = main(["generate", "--model", str(tiny_llada), "--prompt", PROMPT, "--gen-length", "4", "--steps", "4",
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0 and "4 NFE" in err and out.endswith("\n")


def test_errors_are_clear(capsys, tiny_llada: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SPIFFY_EMBEDDED_DIR", str(tmp_path / "no-embedded-models"))
    code = main(["generate", "--prompt", "x"])
    _, err = capsys.readouterr()
    assert code == 2 and "--model" in err
    code = main(["generate", "--model", str(tiny_llada), "--prompt", "x", "--gen-length", "10", "--block-length", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "block_length" in err
    code = main(["generate", "--model", str(tiny_llada), "--prompt", "x", "--gen-length", "1000"])
    _, err = capsys.readouterr()
    assert code == 2 and "context" in err


@pytest.mark.parametrize("mode", [["--model", "M"], ["--target", "T"], []])
def test_empty_prompt_is_refused_like_the_api(capsys, mode: list[str]):
    """The API raises ConfigError on an empty prompt; the CLI exits 2 with that one-line error, in both modes
    (checked before any checkpoint is read: M and T do not exist)."""
    for prompt in (["--prompt", ""], []):
        code = main(["generate", *mode, *prompt])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("spiffy generate: error: the prompt is empty; fix:")


def test_shared_and_ar_flags_coexist():
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "M", "--budget", "2", "--top-k", "5", "--seed", "3"])
    assert (args.budget, args.top_k, args.seed, args.temperature) == (2, 5, 3, 0.0)
    sub = parser._subparsers._group_actions[0].choices["generate"]  # noqa: SLF001 - introspect the subparser
    flags = set(sub._option_string_actions)  # noqa: SLF001
    assert {"--model", "--graph", "--budget", "--prompt", "--json", "--chat", "--dtype", "--top-p"} <= flags
    assert {"--target", "--drafter", "--method", "--max-new-tokens"} <= flags  # AR mode is part of the package


def test_graph_passthrough_is_lossless(capsys, tiny_llada: Path, tmp_path: Path):
    """generate(graph=...) and --graph reproduce the baseline tokens with fewer forwards; a mismatched graph is an
    error naming the field."""
    from spiffy.selfspec.calibrate import calibrate

    model, tok = load_f64(tiny_llada, cached=True), load_tokenizer(tiny_llada)
    cfg = DecodeConfig(gen_length=8, block_length=8, steps=8)
    graph = calibrate(model, tok, ["import os", "x = 1", "def f(y):"], cfg, nodes=4, progress=False, chat=False)
    path = tmp_path / "graph.json"
    graph.save(path)
    base = generate(model, _ids(tok), cfg)
    spec = generate(model, _ids(tok), cfg, graph=graph, budget=3)
    assert spec.tokens == base.tokens and spec.nfe <= base.nfe
    code, payload, _ = _run(capsys, ["generate", "--model", str(tiny_llada), "--prompt", PROMPT, "--gen-length", "8",
                                      "--block-length", "8", "--steps", "8", "--dtype", "float64", "--graph", str(path),
                                      "--budget", "3", "--no-chat", "--json", "--no-progress"])
    assert code == 0 and payload["tokens"] == base.tokens[0] and payload["nfe"] == spec.nfe
    with pytest.raises(GraphMismatchError, match="block_length"):
        generate(model, _ids(tok), DecodeConfig(gen_length=8, block_length=4, steps=4), graph=graph)


def test_model_defaults_to_the_embedded_dllm(capsys, tiny_llada: Path, tmp_path: Path, monkeypatch):
    embedded = tmp_path / "models"
    embedded.mkdir()
    (embedded / EMBEDDED_NAMES["dllm"]).symlink_to(tiny_llada, target_is_directory=True)
    monkeypatch.setenv("SPIFFY_EMBEDDED_DIR", str(embedded))
    argv = ["generate", "--prompt", PROMPT, "--gen-length", "4", "--steps", "4", "--json", "--no-progress"]
    assert main(argv) == 0
    implicit = json.loads(capsys.readouterr().out)
    assert main(argv[:1] + ["--model", str(tiny_llada)] + argv[1:]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert implicit["tokens"] == explicit["tokens"] and implicit["nfe"] == explicit["nfe"]


def test_graph_by_shipped_name_and_auto(capsys, tiny_llada: Path, tmp_path: Path):
    """A model directory carries its graphs in graphs/: --graph NAME picks one by name, --graph auto the one
    calibrated for the decoding flags; both decode the baseline's tokens; a wrong name lists what is shipped."""
    from spiffy.selfspec.calibrate import calibrate

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in tiny_llada.iterdir():
        (model_dir / f.name).symlink_to(f)
    model, tok = load_f64(tiny_llada, cached=True), load_tokenizer(tiny_llada)
    (model_dir / "graphs").mkdir()
    for name, cfg in (("b4", DecodeConfig(gen_length=8, block_length=4)), ("b8", DecodeConfig(gen_length=8, block_length=8))):
        calibrate(model, tok, ["import os", "x = 1"], cfg, nodes=4, progress=False, chat=False).save(
            model_dir / "graphs" / f"{name}.json")
    common = ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--gen-length", "8", "--dtype", "float64",
              "--json", "--no-progress"]
    base = generate(model, _ids(tok), DecodeConfig(gen_length=8, block_length=8))
    for graph in ("b8", "auto", str(model_dir / "graphs" / "b8.json")):
        code, payload, err = _run(capsys, [*common, "--block-length", "8", "--graph", graph])
        assert code == 0, err
        assert payload["graph"] == str(model_dir / "graphs" / "b8.json")
        assert payload["tokens"] == base.tokens[0] and payload["nfe"] <= base.nfe
    code, payload, _ = _run(capsys, [*common, "--block-length", "4", "--graph", "auto"])
    assert code == 0 and payload["graph"].endswith("b4.json")
    code, _, err = _run(capsys, [*common, "--block-length", "2", "--graph", "auto"])
    assert code == 2 and "b4: --gen-length 8 --block-length 4" in err and "b8: --gen-length 8 --block-length 8" in err
    code, _, err = _run(capsys, [*common, "--graph", "nope"])
    assert code == 2 and "shipped: b4, b8" in err
