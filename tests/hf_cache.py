"""Write checkpoints into a Hugging Face cache the way huggingface_hub lays it out (for offline tests).

huggingface_hub has no public function that fills its cache without downloading, so this writes the documented
layout (https://huggingface.co/docs/huggingface_hub/guides/manage-cache) and the tests check it with
huggingface_hub's own reader (``scan_cache_dir``)::

    <cache>/models--ORG--NAME/
        blobs/<etag>                         file contents; etag = git blob sha1, or sha256 for LFS files
        snapshots/<commit>/<file>            relative symlink -> ../../blobs/<etag>
        refs/<branch or tag>                 the commit hash (no newline)

Large binary files (``*.safetensors``) are LFS files on the Hub, so their etag is the sha256 of the content.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: the five real ids the tests serve from a cache, and the tiny family written under each
REAL_IDS: dict[str, str] = {
    "llada": "GSAI-ML/LLaDA-8B-Instruct",
    "dream": "Dream-org/Dream-v0-Instruct-7B",
    "sdar": "JetLM/SDAR-8B-Chat",
    "qwen3": "Qwen/Qwen3-8B",
    "dflash": "z-lab/Qwen3-8B-DFlash-b16",
}


def etag(name: str, data: bytes) -> str:
    """The Hub's etag of a file: sha256 for LFS files (safetensors), else the git blob sha1."""
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def repo_folder(cache: Path, repo_id: str) -> Path:
    """``<cache>/models--ORG--NAME`` (huggingface_hub's ``repo_folder_name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(
    cache: Path, repo_id: str, source: Path, refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()
) -> str:
    """Put every file of directory ``source`` (except the names in ``skip``) into the cache as one commit of
    ``repo_id``, point each of ``refs`` at it, and return the commit hash (derived from the content)."""
    files = {p.relative_to(source).as_posix(): p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}
    files = {name: data for name, data in files.items() if name not in skip}
    tags = {name: etag(name, data) for name, data in files.items()}
    commit = hashlib.sha1((repo_id + "".join(f"{n}:{t};" for n, t in sorted(tags.items()))).encode()).hexdigest()
    root = repo_folder(cache, repo_id)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = root / "blobs" / tags[name]
        if not blob.exists():
            blob.write_bytes(data)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            os.symlink(os.path.relpath(blob, link.parent), link)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return commit
