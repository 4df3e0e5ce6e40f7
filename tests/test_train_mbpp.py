"""Tests of the HumanEval-shaped MBPP rows (spiffy.train.mbpp_rows) and of the trainer's ``--functions-mbpp`` and
``--keep-every`` options: tasks rebuilt from real MBPP rows, the shipped file's tasks valid Python, the pool weighted
by copies, and weight snapshots that a later run can start from."""

from __future__ import annotations

import ast

import pytest
import torch

from spiffy.errors import ConfigError
from spiffy.models.loading import load_model, load_tokenizer
from spiffy.train import functions, mbpp_rows, sdar

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROW = {
    "task_id": 3,
    "prompt": "Write a python function to identify non-prime numbers.",
    "code": "import math\ndef is_not_prime(n):\n  result = False\n  for i in range(2, int(math.sqrt(n)) + 1):\n"
            "    if n % i == 0:\n      result = True\n  return result",
    "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                  "assert set(is_not_prime(3)) == set(())", "assert other(1) == 2", "assert is_not_prime(4) != 3"],
}


def test_task_becomes_a_humaneval_shaped_prompt_and_body():
    prompt, answer = mbpp_rows.mbpp_example(ROW)
    assert prompt == ('import math\n\n\ndef is_not_prime(n):\n'
                      '    """ Write a python function to identify non-prime numbers.\n'
                      '    >>> is_not_prime(2)\n    False\n    >>> is_not_prime(10)\n    True\n    """\n')
    # the body is re-indented to four spaces; asserts not of the form `assert name(...) == value` are left out
    assert answer == ("    result = False\n    for i in range(2, int(math.sqrt(n)) + 1):\n        if n % i == 0:\n"
                      "            result = True\n    return result\n")
    assert mbpp_rows.mbpp_example({**ROW, "code": ROW["code"] + "\ndef helper():\n  return 1"}) is None
    assert mbpp_rows.mbpp_example({**ROW, "code": "x = 1\n" + ROW["code"]}) is None
    assert mbpp_rows.mbpp_example({**ROW, "code": "def broken(:"}) is None
    assert mbpp_rows.mbpp_example({**ROW, "code": 'def f():\n    """only a docstring"""'}) is None


def test_shipped_mbpp_tasks_are_valid_functions():
    examples = mbpp_rows.mbpp_examples()
    assert len(examples) > 300
    with_doctests = 0
    for prompt, answer in examples:
        tree = ast.parse(prompt + answer)
        fn = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert len(fn) == 1 and ast.get_docstring(fn[0]) is not None and answer.startswith("    ")
        with_doctests += ">>> " + fn[0].name + "(" in prompt
    assert with_doctests > 0.8 * len(examples)


def test_copies_weight_the_pool(tmp_path, tiny_qwen3):
    tok = load_tokenizer(tiny_qwen3)
    eos = int(tok.eos_token_id)
    m_rows, m_lens = functions.pairs_to_rows(tok, mbpp_rows.mbpp_examples(), 256, 200, eos, max_answer=64)
    src = '''def plain(a, b):\n    """Add two numbers."""\n    total = a + b\n    return total\n'''
    rows, lens, info = functions.load_or_build(tmp_path, tok, [src], 256, 200, eos, seed=0, max_answer=64,
                                               mbpp_copies=2)
    assert info["mbpp_rows"] == m_rows.shape[0] > 0 and info["mbpp_copies"] == 2
    assert rows.shape[0] == 1 + 2 * m_rows.shape[0]
    assert torch.equal(rows[1:1 + m_rows.shape[0]], m_rows) and torch.equal(rows[1 + m_rows.shape[0]:], m_rows)
    assert torch.equal(lens[1:1 + m_lens.shape[0]], m_lens)
    again = functions.load_or_build(tmp_path, tok, [src], 256, 200, eos, seed=0, max_answer=64, mbpp_copies=2)
    assert again[2] == info  # cached, with its MBPP count
    plain, _, plain_info = functions.load_or_build(tmp_path, tok, [src], 256, 200, eos, seed=0, max_answer=64)
    assert plain.shape[0] == 1 and plain_info["mbpp_rows"] == 0  # other settings: rebuilt


def test_training_keeps_snapshots_a_run_can_start_from(tmp_path, tiny_qwen3):
    from spiffy.train.corpus import build_corpus

    corpus = build_corpus(tmp_path / "c", max_files=12, heldout_percent=30).out_dir
    common_args = ["--init", str(tiny_qwen3), "--corpus", str(corpus), "--max-files", "12", "--heldout-percent",
                   "30", "--context", "256", "--blocks", "32", "--batch-size", "2", "--warmup", "1",
                   "--eval-windows", "2", "--sample-tokens", "32", "--save-dtype", "float32"]
    args = sdar.build_parser().parse_args(common_args + [
        "--out", str(tmp_path / "run"), "--steps", "2", "--keep-every", "1", "--functions-frac", "0.5",
        "--functions-max-answer", "64", "--functions-max-prompt", "190", "--functions-mbpp", "1"])
    metrics = sdar.train(args)
    assert metrics["train"]["functions"]["mbpp_copies"] == 1 and metrics["train"]["functions"]["mbpp_rows"] > 0
    assert "MBPP" in (tmp_path / "run" / "MODEL_CARD.md").read_text()
    snaps = sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir())
    assert snaps == ["step-1.pt", "step-2.pt"]
    model, _ = sdar.init_from_qwen3(str(tiny_qwen3), None)
    sdar.load_start_weights(model, tmp_path / "run" / "snapshots" / "step-2.pt")
    final = torch.load(tmp_path / "run" / "train_state.pt", map_location="cpu", weights_only=False)["model"]
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
    # a finished run re-exports a kept snapshot instead of its last step's weights
    again = sdar.build_parser().parse_args(common_args + [
        "--out", str(tmp_path / "run"), "--steps", "2", "--resume", "--export-step", "1", "--functions-frac", "0.5",
        "--functions-max-answer", "64", "--functions-max-prompt", "190", "--functions-mbpp", "1"])
    exported = sdar.train(again)
    assert exported["steps"] == 1 and exported["trained_steps"] == 2 and exported["exported_snapshot"] == 1
    assert "step-1 snapshot" in (tmp_path / "run" / "MODEL_CARD.md").read_text()
    snap1 = torch.load(tmp_path / "run" / "snapshots" / "step-1.pt", map_location="cpu", weights_only=False)["model"]
    saved = load_model(tmp_path / "run" / "model", dtype="float32").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in snap1.items())
    with pytest.raises(ConfigError, match="kept steps"):
        sdar.train(sdar.build_parser().parse_args(common_args + ["--out", str(tmp_path / "run"), "--steps", "2",
                                                                 "--resume", "--export-step", "7"]))
    with pytest.raises(ConfigError, match="functions-frac"):
        sdar.train(sdar.build_parser().parse_args(common_args + ["--out", str(tmp_path / "r2"),
                                                                 "--functions-mbpp", "1"]))
