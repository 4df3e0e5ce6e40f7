"""Function-completion rows for the SDAR trainer (``--functions-frac``): a ``def`` line and its docstring as the
prompt, the function's body as the answer, then end-of-text up to the end of the window.

Real instruction-tuned dLLMs (LLaDA-Instruct, Dream-Instruct, SDAR-Chat) are fine-tuned on prompt/answer pairs whose
answer is followed by end-of-text tokens filling the rest of the generation window, so at inference an answer that
ends early leaves a run of confident end-of-text positions behind it. Pretraining on code windows teaches none of
that: a model asked to complete a function keeps writing code until the window is full. These rows are the same
supervised format at tiny scale, built from the training split of the standard-library corpus: every function
(any nesting level, ``def`` or ``async def``) whose first statement is a docstring gives one example, prompt = the
source lines from the ``def`` line through the end of the docstring (original indentation, ending in a newline, the
shape of HumanEval's prompts and of the ``code`` calibration set), answer = the remaining lines of the function.

Row layout (int64 ``[N, L]``): ``prompt ids ; answer ids ; EOS ...`` (the answer is cut at the window's end when it
is longer: such rows teach that long bodies go on); ``prompt_lens [N]`` tells the trainer which positions must stay
clean. The prompt and the answer are tokenized separately, as a prompt is at inference.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any, Iterable

import torch

from spiffy.errors import ConfigError
from spiffy.train import common, mbpp_rows

FUNCTIONS_FILE = "function_rows.pt"


def function_examples(source: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` for every function of ``source`` whose first statement is a docstring.

    ``prompt`` = lines from the ``def`` line (decorators excluded) through the docstring's last line, plus ``"\\n"``;
    ``answer`` = the function's remaining lines, plus ``"\\n"``. Functions with nothing after the docstring, or whose
    signature shares a line with other code, are skipped; a file that does not parse gives no example.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    out: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        start, doc_end, end = node.lineno - 1, doc.end_lineno, node.end_lineno
        if doc_end is None or end is None or node.body[1].lineno <= doc_end:
            continue
        prompt = "\n".join(lines[start:doc_end]) + "\n"
        answer = "\n".join(lines[doc_end:end]) + "\n"
        if answer.strip():
            out.append((prompt, answer))
    return out


def build_rows(tokenizer: Any, documents: Iterable[str], length: int, max_prompt: int, eos_id: int,
               seed: int = 0, max_rows: int | None = None, max_answer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize the function examples of ``documents`` into rows: (int64 ``[N, length]``, int64 ``[N]`` prompt lengths).

    Examples whose prompt has more than ``max_prompt`` tokens are dropped (the answer needs room), and with
    ``max_answer > 0`` those whose answer has more than ``max_answer`` tokens (short completions only). Rows come in a
    fixed shuffled order (``seed``); ``max_rows`` keeps the first ones. Raises :class:`ConfigError` when no example
    fits or ``max_prompt`` leaves no room for an answer.
    """
    pairs = [pair for doc in documents for pair in function_examples(doc)]
    random.Random(seed).shuffle(pairs)
    return pairs_to_rows(tokenizer, pairs, length, max_prompt, eos_id, max_rows, max_answer)


def pairs_to_rows(tokenizer: Any, pairs: list[tuple[str, str]], length: int, max_prompt: int, eos_id: int,
                  max_rows: int | None = None, max_answer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize ``(prompt, answer)`` pairs, in order, into rows (int64 ``[N, length]``, int64 ``[N]`` prompt lengths);
    the filters of :func:`build_rows`."""
    if not 1 <= max_prompt < length:
        raise ConfigError(f"--functions-max-prompt {max_prompt} must lie in [1, {length - 1}] (the window is {length})")
    rows, lens = [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not p or len(p) > max_prompt:
            continue
        a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if max_answer > 0 and len(a) > max_answer:
            continue
        ids = (p + a + [eos_id] * length)[:length]
        rows.append(ids)
        lens.append(len(p))
        if max_rows is not None and len(rows) >= max_rows:
            break
    if not rows:
        raise ConfigError(f"no function example has a prompt of at most {max_prompt} tokens; fix: raise "
                          "--functions-max-prompt or use a corpus with documented functions")
    return torch.tensor(rows, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


def load_or_build(out: Path, tokenizer: Any, documents: list[str], length: int, max_prompt: int, eos_id: int,
                  seed: int, max_answer: int = 0, mbpp_copies: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The function rows of run ``out`` (``OUT/data/function_rows.pt``), cached by their settings.

    ``mbpp_copies > 0`` appends that many copies of the HumanEval-shaped MBPP rows
    (:func:`spiffy.train.mbpp_rows.mbpp_examples`, same filters) to the pool, which weights them in sampling.
    Returns ``(rows [N, length], prompt_lens [N], info)``; ``info`` counts the rows (all, and those from the
    corpus) and their answer lengths.
    """
    key = {"length": int(length), "max_prompt": int(max_prompt), "eos": int(eos_id), "seed": int(seed),
           "documents": len(documents), "max_answer": int(max_answer)}
    if mbpp_copies > 0:
        key["mbpp_copies"] = int(mbpp_copies)
    path = out / "data" / FUNCTIONS_FILE
    cached = common.load_keyed(path, key)
    n_mbpp = 0
    if cached is not None:
        rows, lens, n_mbpp = cached["rows"], cached["prompt_lens"], int(cached.get("mbpp_rows", 0))
    else:
        rows, lens = build_rows(tokenizer, documents, length, max_prompt, eos_id, seed, max_answer=max_answer)
        if mbpp_copies > 0:
            m_rows, m_lens = pairs_to_rows(tokenizer, mbpp_rows.mbpp_examples(), length, max_prompt, eos_id,
                                           max_answer=max_answer)
            n_mbpp = int(m_rows.shape[0])
            rows = torch.cat([rows] + [m_rows] * mbpp_copies)
            lens = torch.cat([lens] + [m_lens] * mbpp_copies)
        common.save_keyed(path, key, rows=rows, prompt_lens=lens, mbpp_rows=torch.tensor(n_mbpp))
    return rows, lens, {**rows_summary(rows, lens, eos_id), "corpus_rows": int(rows.shape[0]) - n_mbpp * int(mbpp_copies),
                        "mbpp_rows": n_mbpp, "mbpp_copies": int(mbpp_copies)}


def rows_summary(rows: torch.Tensor, prompt_lens: torch.Tensor, eos_id: int) -> dict[str, Any]:
    """Row count and answer lengths (tokens before the first end-of-text after the prompt) of function rows."""
    positions = torch.arange(rows.shape[1])[None, :]
    is_end = (positions >= prompt_lens[:, None]) & (rows == eos_id)
    first_eos = torch.where(is_end, positions, rows.shape[1]).min(1).values
    answer_len = (first_eos - prompt_lens).float()
    return {"rows": int(rows.shape[0]), "answer_tokens_median": float(answer_len.median()),
            "ended_in_window": round(float((first_eos < rows.shape[1]).float().mean()), 3),
            "prompt_tokens_median": float(prompt_lens.float().median())}


def mix_rows(corpus_rows: torch.Tensor, rows: torch.Tensor, prompt_lens: torch.Tensor, frac: float,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the last ``round(frac * B)`` rows of ``corpus_rows [B, L]`` by random function rows (the last, so a
    teacher mix, which replaces the first rows, keeps its share): returns (int64 ``[B, L]``, int64 ``[B]`` clean
    prefix per row: the prompt length, 0 for other rows)."""
    b = corpus_rows.shape[0]
    k = int(round(min(1.0, max(0.0, frac)) * b))
    clean = torch.zeros(b, dtype=torch.long)
    if k == 0:
        return corpus_rows, clean
    idx = torch.randint(0, rows.shape[0], (k,), generator=gen)
    clean[b - k:] = prompt_lens[idx]
    return torch.cat([corpus_rows[: b - k], rows[idx]]), clean
