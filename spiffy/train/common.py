"""Shared helpers for the tiny-model trainers: seeding, LR schedule, atomic checkpoints, token streams, batching."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spiffy.errors import CheckpointError, ConfigError

TRAIN_STATE = "train_state.pt"


def set_threads(n: int = 1) -> None:
    """Limit torch to ``n`` CPU threads (the shared build machine has only two cores)."""
    torch.set_num_threads(max(1, int(n)))


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    import random

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """A CPU generator keyed by ``(seed, step, salt)``: batches depend only on the step, so a resumed run
    reproduces the uninterrupted one."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(step) * 7919 + int(salt) * 104_729) % (2**63 - 1))
    return g


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if total <= 0:
        raise ConfigError(f"total steps must be > 0, got {total}; fix: pass --steps N with N >= 1")
    if step < warmup:
        return peak * (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_lr_progress(step: int, progress: float, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Like :func:`cosine_lr`, but the decay follows ``progress`` in [0, 1] (e.g. the fraction of a wall-clock
    budget used), so a time-boxed run always ends annealed. Warm-up is still ``warmup`` steps."""
    if step < warmup:
        return peak * (step + 1) / max(1, warmup)
    progress = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _umask_mode(mode: int = 0o644) -> int:
    """``mode`` filtered by the process umask (mkstemp files are 0600 otherwise)."""
    current = os.umask(0)
    os.umask(current)
    return mode & ~current


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_train_state(out_dir: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     step: int, extra: dict[str, Any] | None = None) -> Path:
    """Save a resumable training state (trainable weights, optimizer, step) to ``out_dir/train_state.pt``."""
    state = {
        "model": {k: v for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "step": int(step),
        "extra": dict(extra or {}),
    }
    path = Path(out_dir) / TRAIN_STATE
    atomic_torch_save(state, path)
    return path


def load_train_state(out_dir: str | os.PathLike[str], model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Restore a state written by :func:`save_train_state`; returns ``(step, extra)``."""
    path = Path(out_dir) / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(f"no training state at {str(path)!r}; fix: drop --resume or point --out at a run dir")
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), dict(state.get("extra", {}))


def has_train_state(out_dir: str | os.PathLike[str]) -> bool:
    """True when ``out_dir`` holds a resumable training state."""
    return (Path(out_dir) / TRAIN_STATE).is_file()


@dataclass
class TokenStream:
    """Concatenated token ids of a document split (documents joined by an end-of-text id).

    ``ids``: int64 tensor ``[N]``; ``doc_starts``: start offset of each document.
    """

    ids: torch.Tensor
    doc_starts: list[int]

    def __len__(self) -> int:
        return int(self.ids.numel())


def encode_documents(tokenizer: Any, docs: list[str], eos_id: int, cache: str | os.PathLike[str] | None = None) -> TokenStream:
    """Tokenize ``docs`` (each followed by ``eos_id``) into one stream; cached as ``.npy`` when ``cache`` is given."""
    if cache is not None and Path(cache).is_file():
        arr = np.load(cache)
        starts_path = Path(str(cache) + ".starts.json")
        starts = json.loads(starts_path.read_text()) if starts_path.is_file() else [0]
        return TokenStream(torch.from_numpy(arr.astype(np.int64)), starts)
    encs = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    pieces: list[np.ndarray] = []
    starts: list[int] = []
    pos = 0
    for ids in encs:
        starts.append(pos)
        arr = np.asarray(list(ids) + [eos_id], dtype=np.int32)
        pieces.append(arr)
        pos += arr.size
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        tmp = str(cache) + ".tmp.npy"
        np.save(tmp, flat)
        os.replace(tmp, cache)
        atomic_write_json(str(cache) + ".starts.json", starts)
    return TokenStream(torch.from_numpy(flat.astype(np.int64)), starts)


def sample_windows(stream: TokenStream, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of ``length`` tokens from the stream: int64 ``[batch, length]``."""
    n = len(stream)
    if n <= length:
        reps = (length + 1) // max(1, n) + 1
        ids = stream.ids.repeat(reps)
    else:
        ids = stream.ids
    starts = torch.randint(0, ids.numel() - length, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(length)[None, :]
    return ids[idx]


def eval_windows(stream: TokenStream, length: int, max_windows: int) -> torch.Tensor:
    """Fixed, non-overlapping held-out windows: int64 ``[min(max_windows, N // length), length]``."""
    n = len(stream) // length
    if n == 0:
        reps = length // max(1, len(stream)) + 1
        return stream.ids.repeat(reps)[:length][None, :]
    count = min(n, max_windows)
    # spread the windows over the whole split (deterministic)
    picks = torch.linspace(0, n - 1, count).round().long()
    return torch.stack([stream.ids[int(p) * length:(int(p) + 1) * length] for p in picks])


class Timer:
    """Wall-clock budget: ``expired()`` turns true after ``minutes`` (``None`` or <= 0: never)."""

    def __init__(self, minutes: float | None):
        self.start = time.time()
        self.limit = None if minutes is None or minutes <= 0 else minutes * 60.0

    def elapsed(self) -> float:
        return time.time() - self.start

    def expired(self) -> bool:
        return self.limit is not None and self.elapsed() >= self.limit


def file_size_mb(path: str | os.PathLike[str]) -> float:
    """Total size of the files under ``path`` in MB."""
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 1e6
