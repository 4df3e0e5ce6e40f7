"""Tiny checkpoints (determinism, layout), tokenizers (special tokens, templates) and the `spiffy tiny` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spiffy.errors import ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.models.loading import load_state_dict
from spiffy.models.tiny import make_tiny
from spiffy.models.tokenizer import build_tokenizer

SPECIALS = {
    "llada": ["<|mdm_mask|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
    "dream": ["<|mask|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "sdar": ["<|MASK|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|MASK|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}


def _shard_bytes(path: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[k] = v.numpy().tobytes()
    return out


@pytest.mark.parametrize("family", ["sdar", "qwen3"])
def test_same_seed_gives_identical_tensors(family: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    reference = request.getfixturevalue(f"tiny_{family}")  # seed 0
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    again = make_tiny(family, tmp_path / "again", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert _shard_bytes(again) == _shard_bytes(reference)
    assert (again / "tokenizer.json").read_bytes() == (reference / "tokenizer.json").read_bytes()
    other = make_tiny(family, tmp_path / "other", seed=1)
    a, b = load_state_dict(reference), load_state_dict(other)
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_overrides_and_replacing_existing_dir(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    path = make_tiny("llada", out, seed=0, n_layers=3, vocab_size=400)
    assert not (path / "stale.txt").exists()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["n_layers"] == 3 and cfg["vocab_size"] == 400 == len(load_tokenizer(path))
    model = load_model(path)
    assert len(model.model.transformer["blocks"]) == 3
    assert not list(tmp_path.glob(".*tmp*")), "temporary directories must not be left behind"


def test_unknown_family_and_dflash_without_target(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="llada"):
        make_tiny("gpt2", tmp_path / "x")
    with pytest.raises(ConfigError, match="target"):
        make_tiny("dflash", tmp_path / "y")


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "qwen3"])
def test_tokenizer_special_tokens_consistent_with_config(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"tiny_{family}")
    tok = load_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    vocab = tok.get_vocab()
    for t in SPECIALS[family]:
        assert t in vocab, t
        assert tok.decode([vocab[t]]) == t
        assert tok(t)["input_ids"] == [vocab[t]], f"{t} must encode as one token"
    assert len(tok) >= 256 and cfg["vocab_size"] == len(tok)
    assert cfg["eos_token_id"] == vocab["<|endoftext|>"] == tok.eos_token_id
    if family != "qwen3":
        assert cfg["mask_token_id"] == tok.mask_token_id
    text = "def f(x):\n    return x + 1  # héllo"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_templates_follow_family_style(tiny_llada: Path, tiny_dream: Path, tiny_sdar: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    llada = load_tokenizer(tiny_llada).apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert llada.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" in llada
    dream = load_tokenizer(tiny_dream).apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert dream.startswith("<|im_start|>system\n") and dream.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sdar = load_tokenizer(tiny_sdar).apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert sdar == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_build_tokenizer_deterministic_and_custom_corpus() -> None:
    a = build_tokenizer("dream", vocab_size=300)
    b = build_tokenizer("dream", vocab_size=300)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 300
    corpus = ["spam and eggs " * 50, "eggs and ham " * 50]
    c = build_tokenizer("llada", vocab_size=280, corpus=corpus)
    assert "<|mdm_mask|>" in c.get_vocab() and len(c) <= 280
    with pytest.raises(ConfigError, match="vocab_size"):
        build_tokenizer("sdar", vocab_size=100)


def test_prompt_ending_in_newline_tokenizes_as_a_prefix_of_the_full_text() -> None:
    """A HumanEval-style prompt (ends with ``\"\"\"\\n``) must tokenize exactly as it does inside the completed code,
    otherwise the model sees an indentation-less newline it never met in training and writes top-level code."""
    code = 'def f(x):\n    """Add one.\n    >>> f(1)\n    2\n    """\n    return x + 1\n\n\ndef g():\n    pass\n'
    tok = build_tokenizer("qwen3", vocab_size=400, corpus=[code * 30, "class A:\n    def m(self):\n        pass\n" * 30])
    cut = code.index("    return")
    prompt_ids = tok(code[:cut])["input_ids"]
    full_ids = tok(code)["input_ids"]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    assert tok.decode(full_ids) == code
    assert "\n" not in tok.decode(full_ids[len(prompt_ids)])  # the continuation starts with the indentation

def test_cli_tiny_writes_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spiffy.cli.main import main

    rc = main(["tiny", "dream", str(tmp_path / "d"), "--seed", "2", "--set", "num_hidden_layers=1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "wrote tiny dream checkpoint" in out and "model.safetensors.index.json" in out
    model = load_model(tmp_path / "d")
    assert len(model.model.layers) == 1
    assert main(["tiny", "dflash", str(tmp_path / "x")]) == 2
    assert "--target" in capsys.readouterr().err


def test_cli_tiny_dflash(tmp_path: Path, tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spiffy.cli.main import main
    from spiffy.models import family_of, mask_token_id

    assert main(["tiny", "dflash", str(tmp_path / "dr"), "--target", str(tiny_qwen3)]) == 0
    assert family_of(tmp_path / "dr") == "dflash"
    assert mask_token_id(tmp_path / "dr") == load_tokenizer(tiny_qwen3).convert_tokens_to_ids("<|MASK|>")
    drafter = load_model(tmp_path / "dr", dtype="float64")
    assert type(drafter).__name__ == "DFlashDraftModel"
