"""Atomic file writes: the one home for "nothing is written half".

Every file the library writes (graph files, checkpoints, benchmark reports, training state) goes through these
helpers: the data is written to a temporary file in the destination directory and moved into place with
``os.replace``, which is atomic on POSIX and Windows, so a reader never sees a half-written file and an interrupted
write leaves the previous version intact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "atomic_write_with",
    "replace_dir",
]


def _umask_mode(mode: int = 0o644) -> int:
    """``mode`` filtered by the process umask (``mkstemp`` creates files with mode 0600 otherwise)."""
    current = os.umask(0)
    os.umask(current)
    return mode & ~current


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then move it onto ``path`` atomically.

    The temporary file is removed if ``write`` raises (or the process is interrupted inside Python).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, flushed to disk before the rename."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    atomic_write_with(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, sort_keys: bool = True) -> None:
    """Write ``obj`` as indented JSON (trailing newline) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    atomic_write_with(path, lambda tmp: torch.save(obj, tmp))


def replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` onto ``dst``, replacing ``dst`` if it exists (the old copy is removed after the swap).

    Used to publish a fully written checkpoint directory in one step: readers see the old or the new directory,
    never a mixture. ``src`` gets the umask's directory mode first (``mkdtemp`` creates it 0700, which would leave a
    published checkpoint readable by its owner only).
    """
    if src.is_dir() and not src.is_symlink():
        os.chmod(src, _umask_mode(0o777))
    if dst.exists() or dst.is_symlink():
        backup = dst.parent / f".{dst.name}.old-{os.getpid()}-{id(src)}"
        os.replace(dst, backup)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(backup, dst)
            raise
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink(missing_ok=True)
    else:
        os.replace(src, dst)
