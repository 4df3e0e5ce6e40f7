"""Tests of spiffy.train.corpus and spiffy.train.tokenizer_train (fast: a handful of stdlib files)."""

from __future__ import annotations

import json

import pytest

from spiffy.errors import ConfigError
from spiffy.train.corpus import build_corpus, chunk_text, is_heldout, list_source_files, load_split, stdlib_dir
from spiffy.train.tokenizer_train import FAMILY_SPECIALS, special_ids, train_tokenizer


def test_source_files_sorted_and_filtered():
    files = list_source_files()
    names = [f.as_posix() for f in files]
    assert names == sorted(names)
    assert len(names) > 100
    for bad in ("site-packages", "idlelib", "lib2to3", "test", "tests", "__pycache__"):
        assert not any(bad in f.parts for f in files), bad
    assert "argparse.py" in names and "json/decoder.py" in names


def test_heldout_split_is_a_fixed_function_of_the_path():
    names = [f.as_posix() for f in list_source_files()]
    held = [n for n in names if is_heldout(n)]
    assert held == [n for n in names if is_heldout(n)]  # deterministic
    assert 0 < len(held) < len(names) // 5
    assert all(is_heldout(n, 100) for n in names[:5]) and not any(is_heldout(n, 0) for n in names[:5])


def test_chunk_text_roundtrip():
    text = "".join(f"line {i} " + "x" * (i % 17) + "\n" for i in range(200))
    chunks = chunk_text(text, 300)
    assert "".join(chunks) == text
    assert all(len(c) <= 300 for c in chunks)
    assert chunk_text(text, None) == [text]


def test_build_corpus_reproducible(tmp_path):
    a = build_corpus(tmp_path / "a", max_files=12, heldout_percent=30)
    b = build_corpus(tmp_path / "b", max_files=12, heldout_percent=30)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    assert a.n_files_train + a.n_files_heldout <= 12 and a.n_docs_train == b.n_docs_train
    train = load_split(tmp_path / "a", "train")
    held = load_split(tmp_path / "a", "heldout")
    assert len(train) == a.n_docs_train and len(held) == a.n_docs_heldout
    assert sum(map(len, train)) == a.chars_train
    first = json.loads((tmp_path / "a" / "train.jsonl").read_text().splitlines()[0])
    assert (stdlib_dir() / first["path"]).read_text(encoding="utf-8") == first["text"]
    # chunked documents cover the same text
    c = build_corpus(tmp_path / "c", max_files=12, heldout_percent=30, chunk_chars=2000)
    assert c.n_docs_train > a.n_docs_train and c.chars_train == a.chars_train
    with pytest.raises(ConfigError):
        load_split(tmp_path / "a", "dev")


@pytest.mark.parametrize("family", sorted(FAMILY_SPECIALS))
def test_tokenizer_specials_and_roundtrip(tmp_path, family):
    from transformers import AutoTokenizer

    info = build_corpus(tmp_path / "corpus", max_files=8, heldout_percent=30)
    train_tokenizer(load_split(info.out_dir, "train"), family, tmp_path / "tok", vocab_size=400)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == 400
    ids = special_ids(tok, family)
    assert len(set(ids.values())) == len(FAMILY_SPECIALS[family])
    src = "def f(x):\n    return x + 1  # é\n"
    assert tok.decode(tok(src, add_special_tokens=False)["input_ids"]) == src
    assert tok.mask_token_id == ids["<|mdm_mask|>" if family == "llada" else "<|MASK|>"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert ("<|start_header_id|>" if family == "llada" else "<|im_start|>") in chat
