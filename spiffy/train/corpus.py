"""A reproducible text corpus made of the Python standard library's own ``.py`` sources.

Documents are files (optionally split into chunks of at most ``chunk_chars`` characters at line boundaries). Files
are listed in sorted order; the held-out split is fixed by a hash of each file's path relative to the stdlib root,
so every machine with the same Python version builds the same corpus.

Layout of a corpus directory: ``train.jsonl`` and ``heldout.jsonl`` (one ``{"path", "text"}`` object per line) and
``manifest.json`` (python version, file counts, character counts, settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from spiffy.errors import ConfigError
from spiffy.io import atomic_write_json, atomic_write_text

# top-level stdlib directories that are not representative source code (tests, bundled tools, generated tables)
EXCLUDED_TOP = {
    "site-packages", "dist-packages", "idlelib", "lib2to3", "test", "tests", "turtledemo", "ensurepip",
    "pydoc_data", "encodings", "__pycache__", "tkinter", "venv",
}
# any path component with one of these names excludes the file
EXCLUDED_PARTS = {"test", "tests", "__pycache__", "site-packages", "dist-packages", "idle_test"}


def default_cache_dir() -> Path:
    """``$SPIFFY_CACHE/corpus`` or ``~/.cache/spiffy/corpus``."""
    base = os.environ.get("SPIFFY_CACHE")
    return Path(base) / "corpus" if base else Path.home() / ".cache" / "spiffy" / "corpus"


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory (``sys.prefix/lib/python3.X``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Sorted stdlib ``.py`` files under ``root``, relative paths, excluding tests, site-packages, idlelib, ..."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise ConfigError(f"stdlib directory {str(root)!r} not found; fix: pass --root pointing at lib/python3.X")
    out: list[Path] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts
        if parts[0] in EXCLUDED_TOP or parts[0].startswith("config-") or parts[0].startswith("_sysconfigdata"):
            continue
        if any(p in EXCLUDED_PARTS for p in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        out.append(rel)
    return sorted(out, key=lambda p: p.as_posix())


def is_heldout(rel_path: str, heldout_percent: int = 5) -> bool:
    """Fixed split: a file is held out when ``sha256(rel_path) mod 100 < heldout_percent``."""
    h = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest(), 16)
    return h % 100 < heldout_percent


def chunk_text(text: str, chunk_chars: int | None) -> list[str]:
    """Split ``text`` at line boundaries into pieces of at most ``chunk_chars`` characters (``None``: no split)."""
    if not chunk_chars or len(text) <= chunk_chars:
        return [text]
    chunks: list[str] = []
    cur: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > chunk_chars and cur:
            chunks.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        chunks.append("".join(cur))
    return chunks


@dataclass
class CorpusInfo:
    """Summary of a built corpus (also stored as ``manifest.json``)."""

    out_dir: str
    python_version: str
    root: str
    n_files_train: int
    n_files_heldout: int
    n_docs_train: int
    n_docs_heldout: int
    chars_train: int
    chars_heldout: int
    heldout_percent: int
    chunk_chars: int | None
    max_files: int | None


def build_corpus(out: str | os.PathLike[str] | None = None, root: str | os.PathLike[str] | None = None,
                 heldout_percent: int = 5, chunk_chars: int | None = None, max_files: int | None = None,
                 overwrite: bool = False) -> CorpusInfo:
    """Build (or reuse) the corpus in ``out``; returns its :class:`CorpusInfo`.

    ``max_files`` keeps only the first N files in sorted order (for tests). An existing corpus with the same
    settings is reused unless ``overwrite``.
    """
    out_dir = Path(out) if out is not None else default_cache_dir()
    root_path = Path(root) if root is not None else stdlib_dir()
    manifest = out_dir / "manifest.json"
    settings = {"heldout_percent": heldout_percent, "chunk_chars": chunk_chars, "max_files": max_files,
                "root": str(root_path)}
    if manifest.is_file() and not overwrite:
        info = json.loads(manifest.read_text())
        if all(info.get(k) == v for k, v in settings.items()):
            return CorpusInfo(**info)
    files = list_source_files(root_path)
    if max_files is not None:
        files = files[:max_files]
    train_lines: list[str] = []
    held_lines: list[str] = []
    counts = {"ft": 0, "fh": 0, "ct": 0, "ch": 0}
    for rel in files:
        try:
            text = (root_path / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        key = rel.as_posix()
        held = is_heldout(key, heldout_percent)
        target = held_lines if held else train_lines
        counts["fh" if held else "ft"] += 1
        counts["ch" if held else "ct"] += len(text)
        for piece in chunk_text(text, chunk_chars):
            target.append(json.dumps({"path": key, "text": piece}))
    info = CorpusInfo(
        out_dir=str(out_dir), python_version=sys.version.split()[0], root=str(root_path),
        n_files_train=counts["ft"], n_files_heldout=counts["fh"], n_docs_train=len(train_lines),
        n_docs_heldout=len(held_lines), chars_train=counts["ct"], chars_heldout=counts["ch"],
        heldout_percent=heldout_percent, chunk_chars=chunk_chars, max_files=max_files,
    )
    atomic_write_text(out_dir / "train.jsonl", "\n".join(train_lines) + ("\n" if train_lines else ""))
    atomic_write_text(out_dir / "heldout.jsonl", "\n".join(held_lines) + ("\n" if held_lines else ""))
    atomic_write_json(manifest, asdict(info))
    return info


def load_split(corpus_dir: str | os.PathLike[str], split: str) -> list[str]:
    """Documents of ``split`` (``"train"`` or ``"heldout"``) as a list of strings."""
    if split not in ("train", "heldout"):
        raise ConfigError(f"unknown split {split!r}; fix: use 'train' or 'heldout'")
    path = Path(corpus_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(f"corpus file {str(path)!r} missing; fix: run `python -m spiffy.train.corpus --out DIR`")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the stdlib-source corpus used to train spiffy's tiny models.")
    p.add_argument("--out", default=None, help="output dir (default ~/.cache/spiffy/corpus)")
    p.add_argument("--root", default=None, help="stdlib dir to read (default: this interpreter's)")
    p.add_argument("--heldout-percent", type=int, default=5, help="percent of files held out (by path hash)")
    p.add_argument("--chunk-chars", type=int, default=None, help="split files into chunks of at most N characters")
    p.add_argument("--max-files", type=int, default=None, help="keep only the first N files (tests)")
    p.add_argument("--overwrite", action="store_true", help="rebuild even if a matching corpus exists")
    a = p.parse_args(argv)
    info = build_corpus(a.out, a.root, a.heldout_percent, a.chunk_chars, a.max_files, a.overwrite)
    print(json.dumps(asdict(info), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
