#!/usr/bin/env python3
"""Copy the calibrated draft graphs of the embedded models from graphs/ into the package.

Usage: python scripts/ship_graphs.py [--check]

``graphs/`` in the repository is where graphs are produced (``spiffy calibrate ... --out graphs/NAME.json``). Each
graph names the model it was calibrated for (``calibrated_for.model``); a graph whose model is an embedded
checkpoint ``spiffy/data/models/<model>/`` is copied, unchanged, to ``spiffy/data/models/<model>/graphs/``, where
``spiffy generate / bench / demo`` find it from any installation (:func:`spiffy.embedded.shipped_graphs`). Each
model's ``graphs/`` directory is replaced as a whole, so a graph removed from ``graphs/`` disappears from the
package too. Run it again after recalibrating; after retraining a model, recalibrate its graphs first (a graph of
older weights stays lossless but accepts less). ``--check`` only reports whether the package is up to date (exit 1
if not).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from spiffy.embedded import GRAPHS_SUBDIR
from spiffy.io import replace_dir
from spiffy.selfspec.graph import model_name

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "graphs"
MODELS = REPO / "spiffy" / "data" / "models"


def planned_copies(source: Path = SOURCE, models: Path = MODELS) -> dict[str, list[Path]]:
    """Embedded model name -> the graph files of ``source`` calibrated for it (sorted); every embedded model with a
    ``graphs/`` directory appears, with an empty list when its graphs were all removed."""
    plan: dict[str, list[Path]] = {
        d.name: [] for d in sorted(models.iterdir()) if (d / "config.json").is_file() and (d / GRAPHS_SUBDIR).is_dir()
    }
    for path in sorted(source.glob("*.json")):
        model = model_name(json.loads(path.read_text(encoding="utf-8")).get("calibrated_for", {}).get("model"))
        if isinstance(model, str) and (models / model / "config.json").is_file():
            plan.setdefault(model, []).append(path)
    return plan


def up_to_date(plan: dict[str, list[Path]], models: Path = MODELS) -> bool:
    """Whether every model's shipped graphs are exactly the planned files, byte for byte."""
    for model, files in plan.items():
        shipped = sorted((models / model / GRAPHS_SUBDIR).glob("*.json"))
        if [p.name for p in shipped] != [p.name for p in files]:
            return False
        if any(a.read_bytes() != b.read_bytes() for a, b in zip(files, shipped)):
            return False
    return True


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only verify the package copies; exit 1 if out of date")
    args = ap.parse_args(argv)
    plan = planned_copies()
    if args.check:
        ok = up_to_date(plan)
        print("shipped graphs are up to date" if ok else "shipped graphs differ from graphs/: run scripts/ship_graphs.py")
        return 0 if ok else 1
    for model, files in plan.items():
        dest = MODELS / model / GRAPHS_SUBDIR
        staging = Path(tempfile.mkdtemp(prefix=f".{GRAPHS_SUBDIR}.", dir=dest.parent))
        for path in files:
            shutil.copyfile(path, staging / path.name)
        staging.chmod(0o755)
        if files:
            replace_dir(staging, dest)
        else:
            shutil.rmtree(staging)
            shutil.rmtree(dest, ignore_errors=True)
        print(f"{model}: {', '.join(p.name for p in files) or 'no graphs'} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
