#!/usr/bin/env python3
"""Regenerate spiffy's default calibration prompt set (25 MATH-500 + 25 MBPP prompts, as in the Spiffy paper).

Usage (from the repository root)::

    python calibration/make_default.py                      # reads the shipped spiffy/data/datasets, writes both copies
    python calibration/make_default.py --datasets DIR       # another copy of the benchmark files
    python calibration/make_default.py --check              # verify the committed files are up to date

Selection rule (deterministic, no randomness beyond a fixed seed):

* MATH-500 (``math500.jsonl``, 500 rows): ``random.Random(SEED).sample(range(500), 25)``, then sorted by row index.
* MBPP sanitized (``mbpp_sanitized.jsonl``): only tasks *outside* the evaluation split (task ids < 11 or > 510:
  the few-shot pool and the training/prompting problems), sorted by task id; then
  ``random.Random(SEED).sample(range(len(pool)), 25)``, sorted by task id.
* Prompt text: MATH ``"{problem}\\nPlease reason step by step, and put your final answer within \\\\boxed{}."``;
  MBPP ``"You are an expert Python programmer, and here is your task: {prompt} Your code should pass these
  tests:\\n\\n{test_list joined by newlines}"``.
* Order: interleaved math, mbpp, math, mbpp, ... so that the first N prompts (``--max-prompts N``) mix both.

Output: ``calibration/default.jsonl`` and its installed copy ``spiffy/data/calibration/default.jsonl`` (identical
bytes): one JSON object per line with ``prompt``, ``source`` (``"math500"`` / ``"mbpp"``) and ``id`` (MATH-500
``unique_id`` / MBPP ``task_id``), UTF-8, ``ensure_ascii=False``, trailing newline.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

SEED = 0
PER_SOURCE = 25
REPO = Path(__file__).resolve().parent.parent
OUTPUTS = (REPO / "calibration" / "default.jsonl", REPO / "spiffy" / "data" / "calibration" / "default.jsonl")

MATH_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
MBPP_TEMPLATE = "You are an expert Python programmer, and here is your task: {prompt} Your code should pass these tests:\n\n{tests}"


def _read_jsonl(path: Path) -> list[dict]:
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def build(datasets: Path) -> str:
    """The default set as JSONL text (``datasets``: a directory with math500.jsonl[.gz] and mbpp_sanitized.jsonl[.gz])."""
    from spiffy.bench.datasets import dataset_file

    math_rows = _read_jsonl(dataset_file("math500", datasets))
    mbpp_rows = _read_jsonl(dataset_file("mbpp", datasets))
    if len(math_rows) != 500:
        raise SystemExit(f"expected 500 MATH-500 rows in {datasets}, found {len(math_rows)}")
    math_pick = sorted(random.Random(SEED).sample(range(len(math_rows)), PER_SOURCE))
    pool = sorted((r for r in mbpp_rows if r["task_id"] < 11 or r["task_id"] > 510), key=lambda r: r["task_id"])
    mbpp_pick = sorted(random.Random(SEED).sample(range(len(pool)), PER_SOURCE))
    maths = [
        {"prompt": MATH_TEMPLATE.format(problem=math_rows[k]["problem"]), "source": "math500", "id": math_rows[k]["unique_id"]}
        for k in math_pick
    ]
    codes = [
        {
            "prompt": MBPP_TEMPLATE.format(prompt=pool[k]["prompt"], tests="\n".join(pool[k]["test_list"])),
            "source": "mbpp",
            "id": pool[k]["task_id"],
        }
        for k in mbpp_pick
    ]
    rows = [r for pair in zip(maths, codes) for r in pair]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate spiffy's default calibration prompts (25 MATH-500 + 25 MBPP).")
    ap.add_argument("--datasets", type=Path, default=REPO / "spiffy" / "data" / "datasets",
                    help="directory holding math500.jsonl[.gz] and mbpp_sanitized.jsonl[.gz] (default: the copies "
                         "shipped in spiffy/data/datasets)")
    ap.add_argument("--check", action="store_true", help="only verify that the committed files match; exit 1 if not")
    args = ap.parse_args(argv)
    from spiffy.selfspec.prompts import write_or_check_copies

    return write_or_check_copies(build(args.datasets), OUTPUTS, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
