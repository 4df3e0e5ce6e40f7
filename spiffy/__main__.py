"""``python -m spiffy``: the ``spiffy`` command (what ``torchrun -m spiffy ...`` runs on every rank)."""

from __future__ import annotations

import sys

from spiffy.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
