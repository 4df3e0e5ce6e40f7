"""Resolver of the small trained checkpoints shipped inside the package (the embedded defaults).

The embedded models live in ``spiffy/data/models/<name>/`` (a checkpoint directory each: config.json, safetensors,
tokenizer). They are trained by the scripts in ``scripts/`` and copied there by the maintainers; until then
:func:`embedded_model_path` raises a :class:`~spiffy.errors.ConfigError` that names the script to run. The
environment variable ``SPIFFY_EMBEDDED_DIR`` points the resolver at another directory of the same layout.

Kinds: ``"dllm"`` (a LLaDA-architecture diffusion LM), ``"ar-target"`` (a Qwen3 target), ``"ar-drafter"`` (its
DFlash drafter), ``"ar-dllm-drafter"`` (an SDAR diffusion LM sharing the target's tokenizer: the DEER / SpecDiff-2
drafter).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from spiffy.errors import ConfigError

#: kind -> directory name under spiffy/data/models
EMBEDDED_NAMES: dict[str, str] = {"dllm": "tiny-llada", "ar-target": "tiny-qwen3", "ar-drafter": "tiny-qwen3-dflash-b16"}

#: embedded checkpoints only some methods use (not needed by ``spiffy demo``): kind -> directory name
OPTIONAL_EMBEDDED_NAMES: dict[str, str] = {"ar-dllm-drafter": "tiny-sdar"}

#: kind -> the training script that produces the checkpoint (relative to the repository root)
TRAINING_SCRIPTS: dict[str, str] = {
    "dllm": "scripts/train_tiny_llada.sh",
    "ar-target": "scripts/train_tiny_qwen3.sh",
    "ar-drafter": "scripts/train_tiny_drafter.sh",
    "ar-dllm-drafter": "scripts/train_tiny_sdar.sh",
}

#: file names a calibrated graph for the embedded dLLM may have (inside its model directory)
_GRAPH_NAMES: tuple[str, ...] = ("graph.json", "spiffy_graph.json")

ENV_VAR = "SPIFFY_EMBEDDED_DIR"


def embedded_models_dir() -> Path:
    """The directory holding the embedded checkpoints (``$SPIFFY_EMBEDDED_DIR`` or ``spiffy/data/models``)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(str(resources.files("spiffy").joinpath("data", "models")))


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


def embedded_graph_path(model_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """A calibrated draft graph shipped for the embedded dLLM, or ``None`` when there is none.

    Looks for ``graph.json`` / ``spiffy_graph.json`` inside ``model_dir`` (default: the embedded dLLM's directory),
    then for ``graphs/<name>*.json`` in the repository next to the package (source checkouts).
    """
    root = Path(model_dir) if model_dir is not None else _candidate("dllm")
    for name in _GRAPH_NAMES:
        if (root / name).is_file():
            return root / name
    if model_dir is None:
        repo_graphs = Path(__file__).resolve().parent.parent / "graphs"
        if repo_graphs.is_dir():
            found = sorted(repo_graphs.glob(f"{EMBEDDED_NAMES['dllm']}*.json"))
            if found:
                return found[0]
    return None


__all__ = [
    "EMBEDDED_NAMES",
    "ENV_VAR",
    "TRAINING_SCRIPTS",
    "default_dllm_path",
    "embedded_graph_path",
    "embedded_model_path",
    "embedded_models_dir",
    "is_embedded_available",
    "missing_message",
]
