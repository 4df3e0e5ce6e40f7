"""Helpers shared by the benchmark harnesses: environment record, degenerate-output checks, budget parsing."""

from __future__ import annotations

import platform
import resource
import sys
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
import transformers
from tqdm.auto import tqdm

from spiffy._version import __version__
from spiffy.errors import ConfigError, PromptTooLongError
from spiffy.models.quantize import quantization_label, weight_bytes
from spiffy.torch_utils import dtype_name, model_dtype


def parse_budgets(text: str | Sequence[int], *, minimum: int = 0) -> list[int]:
    """``"1,3,5"`` -> ``[1, 3, 5]`` (order kept, duplicates dropped); every budget must be an integer >= ``minimum``."""
    items: list[Any] = [t for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    if not items:
        raise ConfigError("no budgets given; fix: pass a comma-separated list such as --budgets 1,3,5")
    out: list[int] = []
    for item in items:
        try:
            value = int(str(item).strip())
        except ValueError:
            raise ConfigError(f"budget {item!r} is not an integer; fix: pass e.g. --budgets 1,3,5") from None
        if value < minimum:
            raise ConfigError(f"budget {value} must be >= {minimum}; fix: pass non-negative node budgets")
        if value not in out:
            out.append(value)
    return out


def peak_memory(device: Any = None) -> dict[str, Any]:
    """The run's peak memory so far: on CUDA ``torch.cuda.max_memory_allocated`` (tensors on that GPU), else the
    process's peak resident set (``getrusage`` ``ru_maxrss``: everything the process held, libraries included)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(dev)),
                "peak_memory_method": "torch.cuda.max_memory_allocated"}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale,
            "peak_memory_method": "process peak resident set (getrusage ru_maxrss)"}


def environment_info(model: Any = None, device: Any = None, drafter: Any = None) -> dict[str, Any]:
    """Library, torch, transformers and Python versions, platform, device, dtype, CPU threads, the model's (and
    drafter's) quantization and weight bytes as stored, and the run's peak memory (:func:`peak_memory`)."""
    model_dtype_ = model_dtype(model) if model is not None else None
    dtype = None if model_dtype_ is None else dtype_name(model_dtype_)
    dev = str(device) if device is not None else None
    device_name = dev
    if dev is not None and dev.startswith("cuda") and torch.cuda.is_available():
        device_name = f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    elif dev == "cpu":
        device_name = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "spiffy_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": str(transformers.__version__),
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "device": dev,
        "device_name": device_name,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "quantization": quantization_label(model) if model is not None else None,
        "weight_bytes": weight_bytes(model) if hasattr(model, "parameters") else None,
        **({"drafter_quantization": quantization_label(drafter)} if drafter is not None else {}),
        **peak_memory(dev),
    }


def degenerate_stats(texts: Iterable[str], token_lists: Iterable[Sequence[int]], exclude_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Degenerate-output check of a set of outputs.

    ``distinct_token_ratio`` = distinct token ids / token count over all outputs (special ids in ``exclude_ids``
    left out; a model repeating one token scores near 0); ``whitespace_share`` = whitespace characters / all
    characters of the decoded texts (near 1 means the model emits mostly blanks).
    """
    skip = {int(t) for t in exclude_ids}
    toks = [int(t) for row in token_lists for t in row if int(t) not in skip]
    chars = "".join(texts)
    ws = sum(1 for c in chars if c.isspace())
    return {
        "tokens": len(toks),
        "distinct_tokens": len(set(toks)),
        "distinct_token_ratio": (len(set(toks)) / len(toks)) if toks else 0.0,
        "chars": len(chars),
        "whitespace_share": (ws / len(chars)) if chars else 0.0,
    }


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of ``a`` and ``b`` (length difference counts), ``None`` if equal."""
    for k, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def add_counts(total: dict[str, int], part: dict[Any, Any]) -> None:
    """``total[k] += part[k]`` with string keys (histograms)."""
    for k, v in part.items():
        total[str(k)] = total.get(str(k), 0) + int(v)


def add_times(total: dict[str, float], part: dict[str, Any]) -> None:
    """``total[k] += part[k]`` for per-stage seconds."""
    for k, v in part.items():
        total[str(k)] = total.get(str(k), 0.0) + float(v)


def sorted_hist(h: dict[str, int]) -> dict[str, int]:
    """A histogram with integer-like keys sorted numerically."""
    return {k: h[k] for k in sorted(h, key=lambda s: (int(s) if s.lstrip("-").isdigit() else 1 << 30, s))}


def check_bench_inputs(budgets: Sequence[int], prompts: Sequence[Any], example: str) -> None:
    """Raise ConfigError when ``budgets`` or ``prompts`` is empty (``example`` e.g. ``"[1, 3, 5]"``)."""
    if not budgets:
        raise ConfigError(f"no budgets given; fix: pass e.g. budgets={example}")
    if not prompts:
        raise ConfigError("no prompts given; fix: pass at least one benchmark prompt")


def warm_up(encoded: Sequence[tuple[Any, list[int]]], rounds: int, run_once: Callable[[list[int]], Any]) -> None:
    """Untimed warm-up: ``rounds`` times, ``run_once(ids)`` on the first encoded prompt that fits the context."""
    for _ in range(max(0, int(rounds))):
        for _p, ids in encoded:
            try:
                run_once(ids)
                break
            except PromptTooLongError:
                continue


def progress_bar(enabled: bool, total: int, desc: str) -> Any:
    """A tqdm bar over ``total`` runs on stderr, or ``None`` when not ``enabled``."""
    if not enabled:
        return None
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, leave=False)


def skip_prompt(skipped: list[dict[str, str]], prompt: Any, exc: Exception, bar: Any, runs_left: int) -> None:
    """Record (and warn about) a prompt too long for the context; advance ``bar`` past its ``runs_left`` runs."""
    warnings.warn(f"benchmark prompt {prompt.id} skipped: {exc}", stacklevel=3)
    skipped.append({"id": prompt.id, "reason": str(exc)})
    if bar is not None:
        bar.update(runs_left)


def stage_share(stages: dict[str, float]) -> dict[str, float]:
    """Each stage's share of the summed per-stage seconds (0 when the sum is 0)."""
    total = sum(stages.values())
    return {k: v / total if total > 0 else 0.0 for k, v in stages.items()}
