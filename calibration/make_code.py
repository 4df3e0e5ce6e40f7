#!/usr/bin/env python3
"""Build spiffy's ``code`` calibration set: 50 Python code-completion prompts from the *held-out* split of the
standard-library corpus the embedded tiny models were trained on (so calibration never sees the training files nor
any benchmark problem).

Usage (from the repository root)::

    python calibration/make_code.py                 # builds the corpus if needed, writes both copies
    python calibration/make_code.py --check         # verify the committed files are up to date

Selection rule (deterministic): the held-out files of ``spiffy.train.corpus`` (Python 3.11 stdlib, 5% of files by a
hash of their path), in sorted order; every ``def`` line at indentation 0 or 4 whose function has a docstring gives
one candidate prompt = the ``def`` line through the end of its docstring (at most 8 lines) plus a newline, like
HumanEval's prompts (the tokenizer splits a newline from the indentation after it, so a prompt ending in a newline
tokenizes as it does inside the file); ``random.Random(0).sample`` picks 50 candidates, kept in corpus order.

Output: ``calibration/code.jsonl`` and its installed copy ``spiffy/data/calibration/code.jsonl`` (identical bytes):
``{"prompt", "source": "stdlib-heldout", "id": "<file>:<line>"}`` per line. Licence: the Python standard library is
under the PSF License Agreement (https://docs.python.org/3/license.html).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

SEED = 0
COUNT = 50
MAX_LINES = 8
REPO = Path(__file__).resolve().parent.parent
OUTPUTS = (REPO / "calibration" / "code.jsonl", REPO / "spiffy" / "data" / "calibration" / "code.jsonl")
DEF = re.compile(r"^( {0}| {4})def \w+\(.*\).*:\s*$")


def candidates(path: str, text: str) -> list[tuple[str, str]]:
    """``(id, prompt)`` for every single-line ``def`` with a docstring in ``text``."""
    lines = text.split("\n")
    out = []
    for k, line in enumerate(lines):
        m = DEF.match(line)
        if not m or k + 1 >= len(lines):
            continue
        body_indent = m.group(1) + "    "
        doc = lines[k + 1]
        if not doc.startswith(body_indent + '"""'):
            continue
        end = k + 1
        if doc.count('"""') < 2:  # multi-line docstring: find its end
            end = next((j for j in range(k + 2, len(lines)) if '"""' in lines[j]), -1)
            if end < 0 or end - k + 1 > MAX_LINES:
                continue
        prompt = "\n".join(lines[k : end + 1]) + "\n"
        out.append((f"{path}:{k + 1}", prompt))
    return out


def build(corpus_dir: Path) -> str:
    heldout = corpus_dir / "heldout.jsonl"
    pool: list[tuple[str, str]] = []
    for row in (json.loads(x) for x in heldout.read_text(encoding="utf-8").splitlines() if x.strip()):
        pool.extend(candidates(row["path"], row["text"]))
    if len(pool) < COUNT:
        sys.exit(f"only {len(pool)} candidate prompts in {heldout}; expected at least {COUNT}")
    picked = sorted(random.Random(SEED).sample(range(len(pool)), COUNT))
    rows = [{"prompt": pool[i][1], "source": "stdlib-heldout", "id": pool[i][0]} for i in picked]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=None, help="corpus directory (default: build/reuse spiffy's cached corpus)")
    ap.add_argument("--check", action="store_true", help="only verify that the committed files match")
    args = ap.parse_args()
    from spiffy.train import corpus as corpus_mod

    corpus_dir = Path(args.corpus) if args.corpus else corpus_mod.default_cache_dir()
    if not (corpus_dir / "heldout.jsonl").is_file():
        corpus_mod.build_corpus(out=corpus_dir)
    from spiffy.selfspec.prompts import write_or_check_copies

    return write_or_check_copies(build(corpus_dir), OUTPUTS, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
