"""Calibration prompt sets: named sets shipped with spiffy, or any JSONL file with a ``prompt`` field.

Named sets (files in ``spiffy/data/calibration/``, provenance in ``calibration/README.md``):

* ``default``: the paper's set, 25 MATH-500 + 25 MBPP prompts (interleaved math/code).
* ``default-math`` / ``default-code``: its MATH-500 / MBPP halves.
* ``code``: 50 Python code-completion prompts (a ``def`` line and its docstring) from the held-out split of the
  standard-library corpus the embedded tiny models were trained on (``calibration/make_code.py``).
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from spiffy.errors import ConfigError
from spiffy.models.prompting import prompt_token_ids  # re-exported: its home is the tokenizer side

# name -> (file in spiffy/data/calibration, source filter or None)
NAMED_SETS: dict[str, tuple[str, str | None]] = {
    "default": ("default.jsonl", None),
    "default-math": ("default.jsonl", "math500"),
    "default-code": ("default.jsonl", "mbpp"),
    "code": ("code.jsonl", None),
}


def _data_file(name: str) -> Any:
    return resources.files("spiffy").joinpath("data", "calibration", name)


def load_prompt_records(name_or_path: str | Path) -> list[dict[str, Any]]:
    """The prompt set as dicts (``prompt`` plus whatever else each line holds, e.g. ``source``/``id``).

    Args:
        name_or_path: a JSONL file (one JSON object with a string ``prompt`` per line; blank lines skipped) or a
            name among :data:`NAMED_SETS`.
    Raises:
        ConfigError: unknown name, missing file, bad JSON, missing/empty ``prompt``, or no prompts at all.
    """
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if path.is_file():
        text = _read(path)
        rows = _parse(text, str(path))
    elif spec in NAMED_SETS:
        fname, source = NAMED_SETS[spec]
        res = _data_file(fname)
        if not res.is_file():
            raise ConfigError(
                f"the named prompt set {spec!r} is missing from this installation ({fname}); fix: reinstall spiffy, "
                "or pass a JSONL file with a 'prompt' field per line"
            )
        rows = _parse(res.read_text(encoding="utf-8"), f"spiffy/data/calibration/{fname}")
        if source is not None:
            rows = [r for r in rows if r.get("source") == source]
    else:
        if path.exists():
            raise ConfigError(f"prompt set {spec!r} is not a file; fix: pass a JSONL file or one of {', '.join(NAMED_SETS)}")
        looks_like_path = any(ch in spec for ch in "/\\") or spec.endswith((".jsonl", ".json", ".txt"))
        what = f"prompt file {spec!r} does not exist" if looks_like_path else f"unknown prompt set {spec!r}"
        raise ConfigError(
            f"{what}; fix: pass a JSONL file with a 'prompt' field per line, or a named set: {', '.join(NAMED_SETS)}"
        )
    if not rows:
        raise ConfigError(f"prompt set {spec!r} holds no prompts; fix: add lines like {{\"prompt\": \"...\"}}")
    return rows


def load_prompts(name_or_path: str | Path) -> list[str]:
    """The prompt texts of a named set or a JSONL file (see :func:`load_prompt_records`)."""
    return [r["prompt"] for r in load_prompt_records(name_or_path)]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt file {str(path)!r} is not UTF-8 text ({exc}); fix: save it as UTF-8 JSONL") from None
    except OSError as exc:
        raise ConfigError(f"prompt file {str(path)!r} cannot be read ({exc}); fix: check the path and its permissions") from None


def _parse(text: str, where: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where}, line {lineno}: not valid JSON ({exc.msg}); fix: one JSON object per line, e.g. "
                '{"prompt": "..."}'
            ) from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}, line {lineno}: expected a JSON object with a 'prompt' field, got {type(obj).__name__}")
        if "prompt" not in obj:
            raise ConfigError(f"{where}, line {lineno}: missing field 'prompt'; fix: give every line a \"prompt\" string")
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ConfigError(f"{where}, line {lineno}: field 'prompt' must be a non-empty string")
        rows.append(obj)
    return rows


def select_prompts(prompts: Sequence[str], max_prompts: int | None) -> list[str]:
    """The first ``max_prompts`` prompts (all when ``None``); the named sets are ordered so prefixes mix tasks."""
    if max_prompts is None:
        return list(prompts)
    if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < 1:
        raise ConfigError(f"max_prompts={max_prompts!r} must be None or an integer >= 1")
    return list(prompts)[:max_prompts]


def write_or_check_copies(text: str, outputs: Sequence[Path], *, check: bool) -> int:
    """Write a prompt set's JSONL ``text`` to every path of ``outputs`` (the repository copy and the installed copy
    under ``spiffy/data/calibration/``), each atomically through a temp file; with ``check``, only compare.

    Used by the generator scripts in ``calibration/``. Returns an exit status: 0, or 1 when ``check`` finds a copy
    missing or different (named on stderr).
    """
    if check:
        stale = [str(p) for p in outputs if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print("out of date: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("up to date: " + ", ".join(str(p) for p in outputs))
        return 0
    for out in outputs:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
        print(f"wrote {out} ({text.count(chr(10))} prompts)")
    return 0


__all__ = [
    "NAMED_SETS",
    "load_prompts",
    "load_prompt_records",
    "prompt_token_ids",
    "select_prompts",
    "write_or_check_copies",
]
