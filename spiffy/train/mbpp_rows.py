"""MBPP tasks recast as HumanEval-shaped function completions for the SDAR trainer (``--functions-mbpp``).

HumanEval's prompts are imports, a ``def`` line and a docstring that states the task and shows doctest examples
(``>>> call`` then the expected value); the model writes the body. The stdlib corpus has few such docstrings, so a
tiny model trained only on its functions meets numeric doctest examples at inference and copies them into lists it
never closes. MBPP (sanitized, CC-BY-4.0, shipped with the benchmark prompts) has the same ingredients in another
shape: a one-sentence task, a reference solution and ``assert call == value`` tests. :func:`mbpp_examples` rebuilds
each task as ``(prompt, answer)``: the solution's imports, ``def`` line, a docstring made of the task sentence and
its asserts as doctest examples, then the solution's body (re-indented by ``ast.unparse``) as the answer.

Training on these rows makes MBPP a contaminated benchmark for the resulting model (the model card says so);
HumanEval stays held out.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any

from spiffy.bench.datasets import dataset_file, read_jsonl


def _parse_quietly(source: str) -> ast.Module:
    """``ast.parse`` without its SyntaxWarnings (some solutions hold regexes with invalid escapes: parsed, not run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source)


def _doctest_lines(tests: list[str], name: str) -> list[str]:
    """``>>> call`` / ``value`` line pairs for the tests of the form ``assert name(...) == value``."""
    lines: list[str] = []
    for test in tests:
        try:
            node = _parse_quietly(test).body[0]
        except (SyntaxError, ValueError, IndexError):
            continue
        if not isinstance(node, ast.Assert) or not isinstance(node.test, ast.Compare):
            continue
        cmp = node.test
        if len(cmp.ops) != 1 or not isinstance(cmp.ops[0], ast.Eq):
            continue
        call = cmp.left
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name):
            continue
        lines += [f">>> {ast.unparse(call)}", ast.unparse(cmp.comparators[0])]
    return lines


def mbpp_example(row: dict[str, Any]) -> tuple[str, str] | None:
    """The HumanEval-shaped ``(prompt, answer)`` of one MBPP row, or None when its solution is not a single
    top-level function (helpers, classes or top-level statements other than imports) or does not parse."""
    try:
        module = _parse_quietly(str(row["code"]))
    except (SyntaxError, ValueError, KeyError):
        return None
    imports = [n for n in module.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    funcs = [n for n in module.body if isinstance(n, ast.FunctionDef)]
    if len(funcs) != 1 or len(imports) + 1 != len(module.body):
        return None
    fn = funcs[0]
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if not body:
        return None
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    doc = [str(row.get("prompt", "")).strip()] + _doctest_lines([str(t) for t in row.get("test_list", [])], fn.name)
    head = "".join(ast.unparse(i) + "\n" for i in imports) + ("\n\n" if imports else "")
    prompt = head + f"def {fn.name}({ast.unparse(fn.args)}){returns}:\n" + '    """ ' + "\n    ".join(doc) + '\n    """\n'
    answer = "".join("    " + line + "\n" for stmt in body for line in ast.unparse(stmt).split("\n"))
    return prompt, answer


def mbpp_examples(path: str | Path | None = None) -> list[tuple[str, str]]:
    """Every usable MBPP task (the shipped ``mbpp_sanitized.jsonl.gz`` unless ``path``) as ``(prompt, answer)``."""
    rows = read_jsonl(Path(path) if path is not None else dataset_file("mbpp"))
    return [ex for ex in (mbpp_example(r) for r in rows) if ex is not None]
