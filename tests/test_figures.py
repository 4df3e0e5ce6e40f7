"""The README's and docs/RESULTS.md's figures cannot drift from the commands that make them.

Every marked block (``<!-- figure: ID[:TABLE] -->``) is rendered again from the committed record of its command
(``docs/figures/ID.json``, written by ``scripts/figures.py``) with the current report code, and must equal the
document: a renamed or added column, a changed command or a figure edited by hand fails here until the script runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("spiffy_figures_script", ROOT / "scripts" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = figures  # dataclasses resolve annotations through the module's entry
_spec.loader.exec_module(figures)


def _blocks() -> list[tuple[Path, str, int | None, str]]:
    found = []
    for doc in figures.DOCUMENTS:
        for m in figures.BLOCK.finditer(doc.read_text()):
            found.append((doc, m["id"], int(m["table"]) if m["table"] else None, m["body"]))
    return found


def test_documents_have_figure_blocks() -> None:
    ids = {block_id for _, block_id, _, _ in _blocks()}
    assert "headline" in ids, "the README's headline table must be a rendered figure block"
    used = set(ids - set(figures.SPECIAL_BLOCKS)).union(*(needs for needs, _ in figures.SPECIAL_BLOCKS.values()))
    assert used <= set(figures.FIGURES), used - set(figures.FIGURES)


@pytest.mark.parametrize("doc,block_id,table,body", _blocks(), ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_block_equals_its_command_output(doc: Path, block_id: str, table: int | None, body: str) -> None:
    assert body == figures.render_block(block_id, table), (
        f"{doc.name}: figure block {block_id!r} differs from its committed command output; "
        f"fix: run `python scripts/figures.py --render-only` (or re-measure with `--only {block_id}`)")


@pytest.mark.parametrize("fig_id", sorted(figures.FIGURES))
def test_record_was_made_by_the_command_shown(fig_id: str) -> None:
    record = figures.load_figure(fig_id)
    assert record["command"] == figures.FIGURES[fig_id].command
    assert record["load_average_before"] and record["load_average_after"], "the load must be named"
    assert isinstance(record["results"], dict) and record["results"]


def test_blocks_fail_when_a_figure_changes(tmp_path: Path) -> None:
    """The comparison can fail: a record whose figure changed renders a different block."""
    fig_id = next(i for _, i, _, _ in _blocks() if i not in figures.SPECIAL_BLOCKS)
    record = figures.load_figure(fig_id)
    for name in figures.FIGURES:
        (tmp_path / f"{name}.json").write_text(json.dumps(figures.load_figure(name)))
    table = next(t for _, i, t, _ in _blocks() if i == fig_id)
    before = figures.render_block(fig_id, table, tmp_path)
    record["date"] = "1999-01-01"
    (tmp_path / f"{fig_id}.json").write_text(json.dumps(record))
    assert figures.render_block(fig_id, table, tmp_path) != before


def test_markdown_tables_splits_tables() -> None:
    text = "# t\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\ntext\n| c |\n|---|\n"
    assert figures.markdown_tables(text) == ["| a | b |\n|---|---|\n| 1 | 2 |", "| c |\n|---|"]
