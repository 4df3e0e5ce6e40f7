"""Shared helpers for the tiny-model trainers: seeding, LR schedule, atomic checkpoints, token streams, batching."""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from spiffy.errors import CheckpointError, ConfigError
from spiffy.io import atomic_torch_save, atomic_write_json, atomic_write_text, atomic_write_with
from spiffy.train.arguments import (  # noqa: F401 - the trainers' parsers call them as common.add_*
    add_corpus_arguments,
    add_eval_arguments,
    add_optim_arguments,
    add_output_arguments,
    add_run_arguments,
)

TRAIN_STATE = "train_state.pt"


def set_threads(n: int = 1) -> None:
    """Limit torch to ``n`` CPU threads (the shared build machine has only two cores)."""
    torch.set_num_threads(max(1, int(n)))


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
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


def load_keyed(path: str | os.PathLike[str], key: dict[str, Any]) -> dict[str, Any] | None:
    """The tensors cached at ``path`` by :func:`save_keyed` when they were made with the same settings ``key``,
    else ``None`` (no file, or other settings)."""
    path = Path(path)
    if not path.is_file():
        return None
    cached = torch.load(path, map_location="cpu", weights_only=True)
    return cached if cached.get("key") == key else None


def save_keyed(path: str | os.PathLike[str], key: dict[str, Any], **payload: Any) -> None:
    """Cache ``payload`` (tensors and plain values) at ``path`` (atomically), tagged with its settings ``key``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"key": key, **payload}, path)


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
        def write(tmp: str) -> None:
            with open(tmp, "wb") as fh:  # a file object: np.save would append ".npy" to a bare temp name
                np.save(fh, flat)

        atomic_write_with(cache, write)
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


# ---------------------------------------------------------------------------------------------------------------
# Shared trainer plumbing (ar / dllm / drafter): common CLI options, optimizer, resume, the step loop's bookkeeping
# (LR schedule, wall-clock budget, progress bar, JSONL log, periodic checkpoints) and the model card.
# ---------------------------------------------------------------------------------------------------------------

SAMPLE_PROMPTS = ["def ", "import os\n\n\ndef get_", "class Foo:\n    def __init__(self", "    for i in range("]


def adamw_decay_groups(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95) with weight decay on matrices (ndim >= 2) only."""
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def maybe_resume(args: Any, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 extra: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``(0, extra)``, or the saved ``(step, extra)`` when ``--resume`` and ``out`` holds a training state."""
    step = 0
    if args.resume and has_train_state(out):
        step, extra = load_train_state(out, model, opt)
        print(f"resumed from step {step}", flush=True)
    return step, extra


class TrainLoop:
    """Bookkeeping of one trainer invocation around the caller's forward/backward.

    Usage: ``while loop.running(): lr = loop.set_lr(); ...; loop.end_step(loss, lr, tokens); ...``, then
    ``loop.finish()``. Keeps ``extra["wall_s"]`` (and ``extra["tokens"]`` when given), the invocation history, the
    loss EMA, the tqdm bar and ``OUT/train_log.jsonl``; checkpoints every ``--ckpt-every`` steps.
    """

    def __init__(self, args: Any, out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                 extra: dict[str, Any], desc: str, refresh_postfix: bool = True):
        self.args, self.out, self.model, self.opt = args, out, model, opt
        self.step, self.extra = step, extra
        self.refresh_postfix = refresh_postfix
        self.timer = Timer(args.max_minutes)
        self.bar = tqdm(total=None if args.schedule == "time" else args.steps, initial=step, desc=desc,
                        dynamic_ncols=True, mininterval=5.0)
        self.log_file = open(out / "train_log.jsonl", "a")
        self.ema: float | None = None
        self.t_last = time.time()
        self.budget_s = args.max_minutes * 60.0
        # every invocation's settings are kept in the state, so a resumed run's history is on record
        extra.setdefault("invocations", []).append(
            {"start_step": step, "argv": {k: v for k, v in vars(args).items() if k != "handler"}})
        self.stop_at = step + args.stop_after if args.stop_after else None

    @property
    def wall_s(self) -> float:
        return float(self.extra.get("wall_s", 0.0))

    def running(self) -> bool:
        """True while steps, this invocation's time/step limits and (``--schedule time``) the total budget remain."""
        a = self.args
        if not (self.step < a.steps and not self.timer.expired() and (self.stop_at is None or self.step < self.stop_at)):
            return False
        return not (a.schedule == "time" and self.wall_s >= self.budget_s)

    def set_lr(self) -> float:
        """The scheduled LR for the current step, applied to every optimizer group."""
        a = self.args
        if a.schedule == "time":
            # time-boxed: the cosine follows the fraction of the total budget used (across resumes)
            lr = cosine_lr_progress(self.step, self.wall_s / self.budget_s, a.lr, a.warmup)
        else:
            lr = cosine_lr(self.step, a.steps, a.lr, a.warmup)
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    def end_step(self, loss: torch.Tensor, lr: float, tokens: int | None = None) -> float:
        """Count the finished optimizer step (wall time, tokens, EMA, bar); returns the step's loss as a float."""
        self.step += 1
        now = time.time()
        self.extra["wall_s"] = self.wall_s + (now - self.t_last)
        self.t_last = now
        if tokens is not None:
            self.extra["tokens"] = int(self.extra.get("tokens", 0)) + tokens
        lv = float(loss.detach())
        self.ema = lv if self.ema is None else 0.95 * self.ema + 0.05 * lv
        self.bar.update(1)
        if self.refresh_postfix:
            self.bar.set_postfix(loss=f"{self.ema:.3f}", lr=f"{lr:.2e}")
        else:
            self.bar.set_postfix(loss=f"{self.ema:.3f}", lr=f"{lr:.2e}", refresh=False)
        return lv

    def should_log(self) -> bool:
        return self.step % self.args.log_every == 0 or self.args.schedule == "time"

    def log(self, record: dict[str, Any]) -> None:
        """Append one JSON line to ``OUT/train_log.jsonl``."""
        self.log_file.write(json.dumps(record) + "\n")
        self.log_file.flush()

    def maybe_checkpoint(self) -> None:
        if self.step % self.args.ckpt_every == 0 or self.step == self.args.steps:
            save_train_state(self.out, self.model, self.opt, self.step, self.extra)
        keep = getattr(self.args, "keep_every", 0)
        if keep and self.step % keep == 0:
            atomic_torch_save({"model": self.model.state_dict(), "step": self.step},
                              self.out / "snapshots" / f"step-{self.step}.pt")

    def finish(self) -> None:
        """Close the bar and the log, save the final training state."""
        self.bar.close()
        self.log_file.close()
        save_train_state(self.out, self.model, self.opt, self.step, self.extra)

    @property
    def finished(self) -> bool:
        """All planned steps done (or, with ``--schedule time``, the whole budget used)."""
        return self.step >= self.args.steps or (self.args.schedule == "time" and self.wall_s >= self.budget_s)


def write_card(out: Path, title: str, metrics: dict[str, Any], body: str) -> None:
    """Write ``MODEL_CARD.md`` + ``metrics.json`` into ``out`` (atomically)."""
    atomic_write_json(out / "metrics.json", metrics)
    lines = [f"# {title}", "", body, "", "## Metrics", "", "```json", json.dumps(metrics, indent=2, sort_keys=True),
             "```", "", "Intended use: demos and tests of spiffy's decoding algorithms on CPU. Not a quality model.", ""]
    atomic_write_text(out / "MODEL_CARD.md", "\n".join(lines))


def write_cards(final: Path, out: Path, title: str, metrics: dict[str, Any], body: str) -> None:
    """The card + metrics into both the exported model dir ``final`` and the run dir ``out``."""
    write_card(final, title, metrics, body)
    write_card(out, title, metrics, body)
