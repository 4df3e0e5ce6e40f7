"""Resolver of the small trained checkpoints shipped inside the package (the embedded defaults).

The embedded models live in ``spiffy/data/models/<name>/`` (a checkpoint directory each: config.json, safetensors,
tokenizer). They are trained by the scripts in ``scripts/`` and copied there by the maintainers; until then
:func:`embedded_model_path` raises a :class:`~spiffy.errors.ConfigError` that names the script to run. The
environment variable ``SPIFFY_EMBEDDED_DIR`` points the resolver at another directory of the same layout.

Calibrated draft graphs travel with their model: ``<model dir>/graphs/*.json`` (see :func:`shipped_graphs`).

Kinds: ``"dllm"`` (the demo diffusion LM ``tiny-sdar``: the tiny Qwen3 adapted to SDAR block diffusion, then fine-tuned
on function completions), ``"ar-target"`` (a Qwen3 target), ``"ar-drafter"`` (its DFlash drafter),
``"ar-dllm-drafter"`` (an SDAR diffusion LM sharing the target's tokenizer, D2A-aligned to it: the DEER / SpecDiff-2
drafter), ``"dllm-llada"`` (the earlier LLaDA-architecture demo dLLM ``tiny-llada``; the memory benchmark uses it for
its cache modes), ``"ar-target-small"`` / ``"ar-drafter-small"`` (the wall-clock pair: a 12.1M-parameter, 14-layer
Qwen3 target and its DFlash drafter with a tenth of its parameters, so that the target's forward dominates as it does
for real pairs; `--target small-qwen3 --drafter small-qwen3-dflash-b16`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from spiffy.decoding import make_session
from spiffy.errors import ConfigError, GraphMismatchError
from spiffy.models.hub import EMBEDDED_ENV_VAR, embedded_models_dir
from spiffy.selfspec.graph import load_graph, runtime_signature

#: kind -> directory name under spiffy/data/models
EMBEDDED_NAMES: dict[str, str] = {"dllm": "tiny-sdar", "ar-target": "tiny-qwen3", "ar-drafter": "tiny-qwen3-dflash-b16"}

#: embedded checkpoints only some methods use (``spiffy demo`` adds their rows when shipped and runs without them)
OPTIONAL_EMBEDDED_NAMES: dict[str, str] = {"ar-dllm-drafter": "tiny-sdar-d2a", "dllm-llada": "tiny-llada",
                                           "ar-target-small": "small-qwen3", "ar-drafter-small": "small-qwen3-dflash-b16"}

#: kind -> the training script that produces the checkpoint (relative to the repository root)
TRAINING_SCRIPTS: dict[str, str] = {
    "dllm": "scripts/train_tiny_sdar_mbpp.sh",
    "ar-target": "scripts/train_tiny_qwen3.sh",
    "ar-drafter": "scripts/train_tiny_drafter.sh",
    "ar-dllm-drafter": "scripts/train_tiny_d2a_drafter.sh",
    "dllm-llada": "scripts/train_tiny_llada.sh",
    "ar-target-small": "scripts/train_small_qwen3.sh",
    "ar-drafter-small": "scripts/train_small_drafter.sh",
}

#: subdirectory of a model directory holding its calibrated draft graphs (``*.json``)
GRAPHS_SUBDIR = "graphs"

#: single-graph file names also accepted inside a model directory
_GRAPH_NAMES: tuple[str, ...] = ("graph.json", "spiffy_graph.json")

ENV_VAR = EMBEDDED_ENV_VAR


def _check_kind(kind: str) -> str:
    if kind not in EMBEDDED_NAMES and kind not in OPTIONAL_EMBEDDED_NAMES:
        known = ", ".join([*EMBEDDED_NAMES, *OPTIONAL_EMBEDDED_NAMES])
        raise ConfigError(f"unknown embedded model kind {kind!r}; fix: use one of {known}")
    return kind


def _candidate(kind: str) -> Path:
    _check_kind(kind)
    return embedded_models_dir() / {**EMBEDDED_NAMES, **OPTIONAL_EMBEDDED_NAMES}[kind]


def is_embedded_available(kind: str) -> bool:
    """Whether the embedded checkpoint of ``kind`` is shipped (its directory has a ``config.json``)."""
    return (_candidate(kind) / "config.json").is_file()


def missing_message(kind: str) -> str:
    """A sentence explaining that the embedded ``kind`` checkpoint is missing and how to create it."""
    path = _candidate(kind)
    script = TRAINING_SCRIPTS[kind]
    return (
        f"the embedded {kind} checkpoint is not shipped in this installation (expected a checkpoint directory with "
        f"config.json at {path}); fix: train it with `{script}` and copy the resulting model directory there "
        f"(or set {ENV_VAR}), or pass explicit checkpoint paths"
    )


def embedded_model_path(kind: str) -> Path:
    """The directory of the embedded checkpoint of ``kind`` (``"dllm"``, ``"ar-target"`` or ``"ar-drafter"``).

    Raises:
        ConfigError: unknown kind, or the checkpoint is not shipped yet (the message names the training script).
    """
    path = _candidate(kind)
    if not (path / "config.json").is_file():
        raise ConfigError(missing_message(kind))
    return path


def default_dllm_path(other_fix: str = "") -> str:
    """The embedded dLLM directory, for a command run without ``--model``.

    Args:
        other_fix: a further way out the command offers, appended to the error's fix (e.g. ``" or --target DIR
            for AR mode"``).
    Raises:
        ConfigError: the embedded dLLM is not shipped; the message names its training script and ``--model DIR``.
    """
    if not is_embedded_available("dllm"):
        raise ConfigError(
            "no model given and " + missing_message("dllm") + "; fix: pass --model DIR (a LLaDA/Dream/SDAR "
            f"checkpoint directory, e.g. one written by `spiffy tiny llada DIR`){other_fix}"
        )
    return str(embedded_model_path("dllm"))


def shipped_graphs(model_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The calibrated draft graphs shipped with a checkpoint directory (default: the embedded dLLM's), by name.

    A model directory carries its graphs in ``graphs/*.json`` (the embedded models' are copied there from the
    repository's ``graphs/`` by ``scripts/ship_graphs.py``); a single ``graph.json`` / ``spiffy_graph.json`` next
    to ``config.json`` counts too. Any checkpoint directory laid out this way works, not only the embedded ones.
    """
    root = Path(model_dir) if model_dir is not None else _candidate("dllm")
    found = sorted((root / GRAPHS_SUBDIR).glob("*.json")) if (root / GRAPHS_SUBDIR).is_dir() else []
    return found + [root / name for name in _GRAPH_NAMES if (root / name).is_file()]


def embedded_graph_path(model_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The default shipped graph of ``model_dir`` (the first of :func:`shipped_graphs`), or ``None`` if it has none."""
    graphs = shipped_graphs(model_dir)
    return graphs[0] if graphs else None


def resolve_graph_argument(value: str, model_dir: str | os.PathLike[str]) -> Path:
    """A ``--graph`` value: an existing file, else the name of a graph shipped with ``model_dir``
    (``tiny-sdar-s1`` or ``tiny-sdar-s1.json``).

    Raises:
        ConfigError: neither (the message lists the graphs shipped with the model).
    """
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = shipped_graphs(model_dir)
    for graph in shipped:
        if value in (graph.name, graph.stem):
            return graph
    names = ", ".join(g.stem for g in shipped) or "none"
    raise ConfigError(
        f"--graph {value}: no such file, nor a graph shipped with {model_dir} (shipped: {names}); fix: pass a graph "
        "file written by `spiffy calibrate` or one of the shipped names"
    )


def graph_decoding_flags(graph: Any) -> str:
    """The decoding flags a loaded graph was calibrated for, as command-line text (``--gen-length 64 ...``)."""
    cal = graph.meta.get("calibration", {}) if isinstance(getattr(graph, "meta", None), dict) else {}
    dec = cal.get("decode_config") if isinstance(cal, dict) else None
    if not isinstance(dec, dict):
        return "(unknown: the graph records no decoding configuration)"
    flags = [f"--gen-length {dec.get('gen_length')}", f"--block-length {dec.get('block_length')}"]
    if dec.get("steps") is not None:
        flags.append(f"--steps {dec['steps']}")
    if dec.get("threshold") is not None:
        flags.append(f"--threshold {dec['threshold']}")
    for key, default in (("remasking", "low_confidence"), ("cache", "none"), ("alg", None)):
        if dec.get(key) not in (None, default):
            flags.append(f"--{key} {dec[key]}")
    return " ".join(flags)


def check_graph_fits(model: Any, graph: Any, path: str | os.PathLike[str], config: Any, **overrides: Any) -> Any:
    """Refuse, before decoding, a graph calibrated for other decoding rules than ``config``, naming the flags it
    needs: a command never adopts a graph's settings (the same command without ``--graph`` would not use them).

    Returns:
        the family's own configuration of the run (e.g. SDAR's, with its committed-cache default filled in), the
        one to compare with the graph's recorded ``decode_config``.
    Raises:
        GraphMismatchError: the graph's ``calibrated_for`` differs in a field that shapes its drafts.
    """
    session = make_session(model, torch.zeros((1, 1), dtype=torch.long), config, **overrides)
    try:
        graph.check_compatible(runtime_signature(model, session), warn=False)
    except GraphMismatchError as exc:
        mismatches = getattr(exc, "mismatches", None) or []
        if not mismatches or any(f in ("family", "config_fingerprint", "mask_id") for f, _, _ in mismatches):
            raise  # a graph of another model: no flag fixes it (the message says how to calibrate one)
        diffs = "; ".join(f"{f}: graph {g!r}, this run {r!r}" for f, g, r in mismatches)
        err = GraphMismatchError(
            f"--graph {path} was calibrated for other decoding rules ({diffs}); fix: pass its flags "
            f"{graph_decoding_flags(graph)} (to the run without --graph as well: the flags, not the graph, choose "
            f"the tokens), or calibrate a graph with this run's flags (`spiffy calibrate ... --out NEW.json`)"
        )
        for name in ("field", "graph_value", "runtime_value", "mismatches"):
            setattr(err, name, getattr(exc, name, None))
        raise err from exc
    return session.config


def compatible_shipped_graph(model: Any, model_dir: str | os.PathLike[str], config: Any, prefer: Any = None,
                             **overrides: Any) -> Path:
    """The first graph shipped with ``model_dir`` that was calibrated for ``model`` under ``config`` (``prefer``, a
    shipped graph's path, is tried first: the one whose dtype and prompt format fit the run).

    Args:
        model: the loaded diffusion LM. config: its :class:`~spiffy.decoding.DecodeConfig`;
        prefer: the graph to try first (``None``: the shipped order);
        overrides: family-specific decoding options (``strategy``), as passed to ``generate``.
    Raises:
        ConfigError: the model ships no graph, or none fits ``config`` (the message lists each graph with the
            decoding flags it needs).
    """
    shipped = shipped_graphs(model_dir)
    if not shipped:
        raise ConfigError(
            f"no draft graph is shipped with {model_dir}; fix: pass --graph FILE (calibrate one with `spiffy calibrate "
            f"--model {model_dir} --out graph.json` and the same decoding flags)"
        )
    session = make_session(model, torch.zeros((1, 1), dtype=torch.long), config, **overrides)
    runtime = runtime_signature(model, session)
    needs = []
    first = [p for p in shipped if prefer is not None and Path(p) == Path(prefer)]
    for path in first + [p for p in shipped if p not in first]:
        graph = load_graph(path)
        try:
            graph.check_compatible(runtime, warn=False)
        except GraphMismatchError:
            needs.append(f"{path.stem}: {graph_decoding_flags(graph)}")
            continue
        return path
    raise ConfigError(
        f"none of the graphs shipped with {model_dir} was calibrated for these decoding flags; fix: use the flags "
        "of one of them (" + "; ".join(needs) + "), or pass --graph FILE calibrated for yours with `spiffy calibrate`"
    )


__all__ = [
    "EMBEDDED_NAMES",
    "check_graph_fits",
    "ENV_VAR",
    "GRAPHS_SUBDIR",
    "TRAINING_SCRIPTS",
    "compatible_shipped_graph",
    "default_dllm_path",
    "embedded_graph_path",
    "graph_decoding_flags",
    "embedded_model_path",
    "embedded_models_dir",
    "is_embedded_available",
    "missing_message",
    "resolve_graph_argument",
    "shipped_graphs",
]
