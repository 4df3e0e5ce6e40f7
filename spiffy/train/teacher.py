"""A teacher corpus for the SDAR trainer: corpus prefixes continued greedily by an AR model (``--teacher``).

A dLLM trained only on human-written code is uncertain: most masked positions have many plausible fillers, so its
confidences stay low and its unmasking order changes from step to step, which is what self-speculative drafts need
to be stable. The greedy continuations of a (small) AR model are low-entropy text: given the prefix, every next
token is determined. Training the dLLM on such windows (mixed with the original corpus, ``--teacher-frac``) makes
it confident where the text is predictable.

Each window is ``[prefix ; continuation]`` of ``length`` tokens: the prefix (``P`` tokens, one ``P`` per generation
batch, uniform in ``[min_prefix, max_prefix]``) is a random window of the training stream, the rest the teacher's
argmax continuation (KV cache, :func:`spiffy.train.drafter.target_continue`). The windows are cached in the run
directory, keyed by their settings, so a resumed run reuses them. ``--teacher-min-distinct`` drops windows whose
continuation loops (low distinct-token ratio), so the dLLM learns confidence without learning the loops.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from spiffy.errors import ConfigError
from spiffy.models.loading import load_model
from spiffy.train import common
from spiffy.train.drafter import target_continue

TEACHER_FILE = "teacher_windows.pt"


def tail_distinct_ratio(windows: torch.Tensor, tail: int) -> torch.Tensor:
    """Distinct-token ratio of the last ``tail`` tokens of every row of ``windows [N, L]``: float ``[N]``."""
    ends = windows[:, -tail:].sort(dim=1).values
    return (1 + (ends[:, 1:] != ends[:, :-1]).sum(1)).float() / tail


@torch.no_grad()
def generate_teacher_windows(teacher: torch.nn.Module, stream: common.TokenStream, count: int, length: int,
                             min_prefix: int, max_prefix: int, seed: int, batch: int = 128,
                             min_distinct: float = 0.0, max_batches: int | None = None) -> torch.Tensor:
    """``count`` windows int64 ``[count, length]``: training-stream prefixes continued greedily by ``teacher``.

    ``min_distinct > 0`` drops windows whose last ``min(64, length - max_prefix)`` tokens (all continuation) have a
    lower distinct-token ratio (a tiny teacher's greedy text often loops) and generates more batches, at most
    ``max_batches`` (default ``8 * count / batch + 8``). Deterministic given ``seed`` (prefixes and prefix lengths
    come from :func:`common.step_generator`).
    """
    if not 1 <= min_prefix <= max_prefix < length:
        raise ConfigError(f"teacher prefix range [{min_prefix}, {max_prefix}] must lie in [1, {length - 1}]; "
                          "fix: --teacher-prefix MIN,MAX with MIN >= 1 and MAX < --context")
    if count <= 0 or batch <= 0:
        raise ConfigError(f"--teacher-windows ({count}) and the generation batch ({batch}) must be positive")
    limit = max_batches if max_batches is not None else 8 * (count // batch) + 8
    tail = min(64, length - max_prefix)
    teacher.eval()
    rows: list[torch.Tensor] = []
    kept = 0
    for i in range(limit):
        if kept >= count:
            break
        n = min(batch, count - kept)
        gen = common.step_generator(seed, i, salt=17)
        prefix = int(torch.randint(min_prefix, max_prefix + 1, (1,), generator=gen))
        prompts = common.sample_windows(stream, n, prefix, gen)
        greedy = torch.ones(n, dtype=torch.bool)
        windows = target_continue(teacher, prompts, length, greedy, gen)
        if min_distinct > 0:
            windows = windows[tail_distinct_ratio(windows, tail) >= min_distinct]
        rows.append(windows)
        kept += windows.shape[0]
    if kept < count:
        raise ConfigError(f"only {kept} of {count} teacher windows reach a distinct-token ratio of {min_distinct} "
                          f"after {limit} batches; fix: lower --teacher-min-distinct or --teacher-windows")
    return torch.cat(rows)[:count]


def load_or_generate(out: Path, teacher_dir: str, stream: common.TokenStream, count: int, length: int,
                     prefix_range: tuple[int, int], seed: int, vocab_size: int,
                     min_distinct: float = 0.0) -> tuple[torch.Tensor, dict[str, Any]]:
    """The teacher windows of run ``out`` (``OUT/data/teacher_windows.pt``): loaded when cached with the same
    settings, else generated with the AR checkpoint ``teacher_dir`` (float32) and cached. Returns
    ``(windows [count, length], info)``; raises :class:`ConfigError` when the teacher's vocabulary differs."""
    key = {"teacher": str(teacher_dir), "count": int(count), "length": int(length),
           "prefix": [int(prefix_range[0]), int(prefix_range[1])], "seed": int(seed), "greedy": True,
           "min_distinct": float(min_distinct)}
    path = out / "data" / TEACHER_FILE
    cached = common.load_keyed(path, key)
    if cached is not None:
        return cached["windows"], {**key, "generation_s": cached.get("generation_s")}
    teacher = load_model(teacher_dir, dtype="float32")
    if int(teacher.config.vocab_size) != int(vocab_size):
        raise ConfigError(f"teacher {teacher_dir!r} has vocabulary {teacher.config.vocab_size}, the dLLM "
                          f"{vocab_size}; fix: pass the AR model the dLLM was adapted from (same tokenizer)")
    t0 = time.time()
    windows = generate_teacher_windows(teacher, stream, count, length, prefix_range[0], prefix_range[1], seed,
                                       min_distinct=min_distinct)
    seconds = round(time.time() - t0, 1)
    common.save_keyed(path, key, windows=windows, generation_s=seconds)
    return windows, {**key, "generation_s": seconds}


def mix_batch(corpus_rows: torch.Tensor, teacher_windows: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """Replace the first ``round(frac * B)`` rows of ``corpus_rows [B, L]`` by random teacher windows
    (``teacher_windows [N, L]``): int64 ``[B, L]``."""
    b = corpus_rows.shape[0]
    k = int(round(min(1.0, max(0.0, frac)) * b))
    if k == 0:
        return corpus_rows
    idx = torch.randint(0, teacher_windows.shape[0], (k,), generator=gen)
    return torch.cat([teacher_windows[idx], corpus_rows[k:]])


def parse_prefix_range(text: str) -> tuple[int, int]:
    """``"MIN,MAX"`` (or one integer) -> ``(MIN, MAX)``."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--teacher-prefix {text!r} is not MIN,MAX; fix: e.g. --teacher-prefix 16,160") from exc
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] > parts[1]:
        raise ConfigError(f"--teacher-prefix {text!r} must be MIN,MAX with MIN <= MAX")
    return parts[0], parts[1]
