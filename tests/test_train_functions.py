"""Tests of the SDAR trainer's function-completion rows (spiffy.train.functions): examples cut from real source,
rows laid out as prompt ; body ; end-of-text, the prompt kept clean by the noise, and a training run that uses them."""

from __future__ import annotations

import pytest
import torch

from spiffy.errors import ConfigError
from spiffy.models.loading import load_tokenizer
from spiffy.train import functions, sdar
from spiffy.train.common import step_generator

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

SOURCE = '''import os


def plain(a, b):
    """Add two numbers."""
    total = a + b
    return total


def no_doc(x):
    return x


def only_doc():
    """Nothing after me."""


class Box:
    @property
    def size(self,
             scale=1):
        """The size.

        Scaled.
        """
        return 3 * scale

    async def fetch(self):
        """Fetch it."""
        return await os.wait()
'''


def test_examples_are_docstring_prompts_and_bodies():
    examples = functions.function_examples(SOURCE)
    assert examples == [
        ('def plain(a, b):\n    """Add two numbers."""\n', "    total = a + b\n    return total\n"),
        ('    def size(self,\n             scale=1):\n        """The size.\n\n        Scaled.\n        """\n',
         "        return 3 * scale\n"),
        ('    async def fetch(self):\n        """Fetch it."""\n', "        return await os.wait()\n"),
    ]
    assert functions.function_examples("def broken(:\n") == []


def test_rows_are_prompt_body_then_end_of_text(tiny_qwen3):
    tok = load_tokenizer(tiny_qwen3)
    eos = int(tok.eos_token_id)
    examples = functions.function_examples(SOURCE)
    prompt_lens = sorted(len(tok(p, add_special_tokens=False)["input_ids"]) for p, _ in examples)
    answer_lens = [len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in examples]
    width = prompt_lens[-1] + max(answer_lens) + 1
    rows, lens = functions.build_rows(tok, [SOURCE], width, prompt_lens[-1], eos, seed=0)
    assert rows.shape == (3, width) and rows.dtype == torch.int64 and lens.shape == (3,)
    texts = set()
    for row, p in zip(rows, lens):
        answer_end = int((row[p:] == eos).nonzero()[0]) + int(p)
        assert bool((row[answer_end:] == eos).all())
        texts.add((tok.decode(row[:p]), tok.decode(row[p:answer_end])))
    assert texts == set(examples)
    info = functions.rows_summary(rows, lens, eos)
    assert info["rows"] == 3 and info["ended_in_window"] == 1.0
    # too long prompts and (with max_answer) too long bodies are dropped; a window too short cuts the body
    short_prompt, _ = functions.build_rows(tok, [SOURCE], width, prompt_lens[0], eos)
    assert 0 < short_prompt.shape[0] < 3
    fewer = functions.build_rows(tok, [SOURCE], width, prompt_lens[-1], eos, max_answer=max(answer_lens) - 1)[0]
    assert fewer.shape[0] < 3
    cut, cut_lens = functions.build_rows(tok, [SOURCE], prompt_lens[-1] + 2, prompt_lens[-1], eos)
    assert functions.rows_summary(cut, cut_lens, eos)["ended_in_window"] < 1.0
    with pytest.raises(ConfigError, match="functions-max-prompt"):
        functions.build_rows(tok, [SOURCE], width, prompt_lens[0] - 1, eos)
    with pytest.raises(ConfigError, match="must lie in"):
        functions.build_rows(tok, [SOURCE], width, width, eos)


def test_mixed_rows_keep_their_prompt_clean():
    corpus_rows = torch.arange(1, 1 + 8 * 32).view(8, 32)
    fn_rows = torch.full((5, 32), 7)
    lens = torch.tensor([3, 5, 9, 12, 20])
    x0, clean = functions.mix_rows(corpus_rows, fn_rows, lens, 0.5, step_generator(0, 0))
    assert torch.equal(x0[:4], corpus_rows[:4]) and bool((x0[4:] == 7).all())
    assert bool((clean[:4] == 0).all()) and all(int(c) in lens.tolist() for c in clean[4:])
    same, none = functions.mix_rows(corpus_rows, fn_rows, lens, 0.0, step_generator(0, 0))
    assert torch.equal(same, corpus_rows) and not bool(none.any())
    # the noise never masks a clean prefix, and still masks after it
    for step in range(20):
        _, masked = sdar.noise_blocks(x0, 8, 0, step_generator(0, step), prompt_frac=0.5, clean_prefix=clean)
        for r in range(8):
            assert not bool(masked[r, : int(clean[r])].any())
    _, masked = sdar.noise_blocks(x0, 8, 0, step_generator(0, 99), clean_prefix=clean)
    assert bool(masked[4:].any())


def test_training_with_function_rows(tmp_path, tiny_qwen3):
    from spiffy.train.corpus import build_corpus

    corpus = build_corpus(tmp_path / "c", max_files=12, heldout_percent=30).out_dir
    args = sdar.build_parser().parse_args([
        "--out", str(tmp_path / "run"), "--init", str(tiny_qwen3), "--corpus", str(corpus), "--max-files", "12",
        "--heldout-percent", "30", "--context", "64", "--blocks", "16,32", "--batch-size", "4", "--warmup", "1",
        "--eval-windows", "2", "--sample-tokens", "16", "--save-dtype", "float32", "--steps", "2",
        "--functions-frac", "0.5", "--functions-max-prompt", "40", "--functions-max-answer", "20"])
    metrics = sdar.train(args)
    info = metrics["train"]["functions"]
    assert info["rows"] > 0 and info["frac"] == 0.5 and info["max_answer"] == 20
    assert info["ended_in_window"] == 1.0 and info["answer_tokens_median"] <= 20
    assert (tmp_path / "run" / "data" / functions.FUNCTIONS_FILE).is_file()
    assert "function completions" in (tmp_path / "run" / "MODEL_CARD.md").read_text()


def test_teacher_and_function_shares_cannot_exceed_the_batch(tmp_path):
    args = sdar.build_parser().parse_args(["--out", str(tmp_path / "r"), "--teacher", str(tmp_path / "ar"),
                                           "--teacher-frac", "0.5", "--functions-frac", "0.6"])
    with pytest.raises(ConfigError, match="exceed 1"):
        sdar.train(args)


def test_rows_are_cached_by_their_settings(tmp_path, tiny_qwen3):
    tok = load_tokenizer(tiny_qwen3)
    eos = int(tok.eos_token_id)
    rows, lens, info = functions.load_or_build(tmp_path, tok, [SOURCE], 256, 200, eos, seed=0)
    cached = tmp_path / "data" / functions.FUNCTIONS_FILE
    stamp = cached.stat().st_mtime_ns
    again, again_lens, again_info = functions.load_or_build(tmp_path, tok, [SOURCE], 256, 200, eos, seed=0)
    assert torch.equal(rows, again) and torch.equal(lens, again_lens) and info == again_info
    assert cached.stat().st_mtime_ns == stamp  # reused, not rebuilt
    shorter = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in functions.function_examples(SOURCE)) - 1
    fewer, _, _ = functions.load_or_build(tmp_path, tok, [SOURCE], 256, 200, eos, seed=0, max_answer=shorter)
    assert fewer.shape[0] < rows.shape[0]  # other settings: rebuilt
