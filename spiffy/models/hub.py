"""One resolver for every checkpoint argument: a local directory, or a Hugging Face Hub id with optional revision.

:func:`resolve_checkpoint` is what every loader calls first (``load_model``, ``load_tokenizer``, the DFlash drafter
and Qwen3 target loaders, and through them ``--model / --target / --drafter`` of every command):

* an existing path is used as it is (nothing is looked up, nothing downloads);
* ``ORG/NAME`` or ``ORG/NAME@REVISION`` (branch, tag or commit; or ``revision=``) that is not an existing path is
  fetched through ``huggingface_hub.snapshot_download`` - only the files a loader reads: config.json,
  generation_config.json, tokenizer files and chat template, then ``model.safetensors`` or the shards named by
  ``model.safetensors.index.json``. huggingface_hub decides everything else exactly as for transformers: the cache
  (``HF_HOME`` / ``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``), offline mode (``HF_HUB_OFFLINE=1``: the
  cache only), tokens (``HF_TOKEN`` or ``hf auth login``), the endpoint and progress bars;
* anything else (a missing path not shaped like an id, or any ``pathlib.Path``: only a ``str`` can name a Hub id)
  is returned unchanged, so the loader raises its usual "does not exist" :class:`~spiffy.errors.CheckpointError`.

Offline (or unreachable Hub) and not cached: :class:`~spiffy.errors.CheckpointNotCachedError`, one line naming the
id, the cache it looked in and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors
from huggingface_hub import snapshot_download

from spiffy.checkpoint_ref import hub_id_from_cache_path, parse_hub_id
from spiffy.errors import CheckpointError, CheckpointNotCachedError, ConfigError

#: files every loader may read besides the weights (small; fetched first)
METADATA_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

#: environment variable pointing the embedded-checkpoint lookup at another directory of the same layout
EMBEDDED_ENV_VAR = "SPIFFY_EMBEDDED_DIR"


def embedded_models_dir() -> Path:
    """The directory holding the checkpoints shipped inside the package (``$SPIFFY_EMBEDDED_DIR`` or
    ``spiffy/data/models``); a bare name such as ``small-qwen3`` resolves to ``<this>/small-qwen3``."""
    env = os.environ.get(EMBEDDED_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(str(resources.files("spiffy").joinpath("data", "models")))


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """Where a checkpoint argument points.

    Attributes:
        path: the local directory the loaders read.
        repo_id: the Hub id (``"GSAI-ML/LLaDA-8B-Instruct"``) when the directory is a Hub snapshot, else ``None``.
        revision: the snapshot's commit hash when known, else ``None``.
    """

    path: Path
    repo_id: str | None = None
    revision: str | None = None

    @property
    def reference(self) -> str:
        """``ORG/NAME@COMMIT`` for a Hub snapshot (what graph files record), else the directory path."""
        if self.repo_id:
            return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id
        return str(self.path)


def hub_cache_dir() -> str:
    """The Hugging Face cache huggingface_hub reads and writes (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    return str(hf_constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1``)."""
    return bool(getattr(hf_constants, "HF_HUB_OFFLINE", False))


def resolve_checkpoint(
    path_or_id: str | os.PathLike[str],
    revision: str | None = None,
    *,
    weights: bool = True,
    token: str | bool | None = None,
) -> ResolvedCheckpoint:
    """The local checkpoint directory for a path or a Hub id (see the module docstring).

    Args:
        path_or_id: a directory, or a string ``ORG/NAME`` / ``ORG/NAME@REVISION``.
        revision: branch, tag or commit of a Hub id (instead of ``@REVISION``; both must agree if both are given).
        weights: also fetch the safetensors weights (``False`` for tokenizer- or config-only use).
        token: passed to huggingface_hub (``None``: its usual lookup, ``HF_TOKEN`` or the stored login).
    Raises:
        CheckpointNotCachedError: offline or Hub unreachable, and the cache lacks the id.
        CheckpointError: the Hub refused (unknown or gated repository, unknown revision, incomplete snapshot).
        ConfigError: ``revision`` given for a local directory, or two different revisions.
    """
    text = os.fspath(path_or_id)
    local = Path(text)
    if local.exists():
        if revision is not None:
            raise ConfigError(
                f"revision={revision!r} was given for the local directory {text!r}; fix: drop the revision, or "
                "pass a Hub id (ORG/NAME) to choose a revision"
            )
        cached = hub_id_from_cache_path(local)
        return ResolvedCheckpoint(local, *cached) if cached else ResolvedCheckpoint(local)
    # only a string can be a Hub id: a Path (e.g. one this function returned) always means a directory
    parsed = parse_hub_id(text) if isinstance(path_or_id, str) else None
    if parsed is None:
        shipped = embedded_models_dir() / text
        if text and os.sep not in text and "/" not in text and (shipped / "config.json").is_file():
            return ResolvedCheckpoint(shipped)  # a bare name (no Hub id has one) of a checkpoint the package ships
        return ResolvedCheckpoint(local)  # not an id: the loader reports the missing directory as before
    repo_id, id_revision = parsed
    if revision is not None and id_revision is not None and revision != id_revision:
        raise ConfigError(
            f"{text!r} names revision {id_revision!r} but revision={revision!r} was also given; fix: give one"
        )
    wanted = revision if revision is not None else id_revision
    folder = _snapshot(repo_id, wanted, list(METADATA_FILES), token)
    commit = folder.name
    if weights:
        # pin the second call to the commit the first one resolved, so config and weights come from one snapshot
        folder = _snapshot(repo_id, commit, _weight_files(folder), token, shown_revision=wanted)
    return ResolvedCheckpoint(folder, repo_id, commit)


def checkpoint_dir(
    path_or_id: str | os.PathLike[str], revision: str | None = None, *, weights: bool = True
) -> Path:
    """:func:`resolve_checkpoint` ``(...).path``: the local directory to read."""
    return resolve_checkpoint(path_or_id, revision, weights=weights).path


def _weight_files(folder: Path) -> list[str]:
    """Weight files a snapshot needs: the shards named by its index, else ``model.safetensors``."""
    index = folder / WEIGHTS_INDEX_FILE
    if not index.is_file():
        return [SINGLE_WEIGHTS_FILE]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"cannot read {str(index)!r}: {exc}; fix: delete it from the cache and load again"
        ) from exc


def _snapshot(
    repo_id: str, revision: str | None, patterns: list[str], token: str | bool | None, shown_revision: str | None = None
) -> Path:
    """``snapshot_download`` limited to ``patterns``, with huggingface_hub's failures turned into spiffy errors."""
    shown = shown_revision if shown_revision is not None else revision
    label = repo_id + (f" (revision {shown!r})" if shown else "")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, token=token))
    except hf_errors.LocalEntryNotFoundError as exc:
        incomplete = getattr(hf_errors, "IncompleteSnapshotError", None)
        if incomplete is not None and isinstance(exc, incomplete):
            raise CheckpointError(
                f"the cached snapshot of {label} in {cache!r} is incomplete ({exc}); fix: download it again with "
                f"network access (`hf download {repo_id}`)"
            ) from exc
        why = "downloads are off (HF_HUB_OFFLINE=1)" if hub_offline() else "the Hub could not be reached"
        raise CheckpointNotCachedError(
            f"Hub id {label} is not in the Hugging Face cache {cache!r} and {why}; fix: download it once with network "
            f"access (`hf download {repo_id}` with the same HF_HOME), point HF_HOME or HF_HUB_CACHE at a cache that "
            "holds it, or pass a local checkpoint directory",
            repo_id,
            shown,
            cache,
        ) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise CheckpointError(
            f"Hub repository {repo_id!r} has no revision {shown!r}; fix: use an existing branch, tag or commit"
        ) from exc
    except hf_errors.RepositoryNotFoundError as exc:  # also GatedRepoError
        raise CheckpointError(
            f"Hub repository {repo_id!r} was not found or needs access; fix: check the id, accept the model's licence "
            "on huggingface.co if it is gated and log in (`hf auth login` or HF_TOKEN), or pass a local directory"
        ) from exc
    except (hf_errors.HFValidationError, hf_errors.HfHubHTTPError, OSError) as exc:
        raise CheckpointError(
            f"cannot fetch {label} from the Hugging Face Hub: {' '.join(str(exc).split())}; fix: check the id and "
            "the network, or pass a local checkpoint directory"
        ) from exc


__all__ = [
    "METADATA_FILES",
    "ResolvedCheckpoint",
    "checkpoint_dir",
    "hub_cache_dir",
    "hub_offline",
    "resolve_checkpoint",
]
