"""How a checkpoint is named: Hub ids (``ORG/NAME`` or ``ORG/NAME@REVISION``), cache paths, local directories.

Standard library only (the draft-graph file code uses it to compare model names). The resolver that turns a
Hub id into a local directory lives in :mod:`spiffy.models.hub`.

* :func:`parse_hub_id` - ``"GSAI-ML/LLaDA-8B-Instruct@main"`` -> ``("GSAI-ML/LLaDA-8B-Instruct", "main")``; ``None``
  for anything that is not shaped like a Hub id (absolute or relative paths with other than one ``/``, ``~``...).
* :func:`hub_id_from_cache_path` - a directory inside a Hugging Face cache
  (``.../models--ORG--NAME/snapshots/COMMIT``) -> ``("ORG/NAME", "COMMIT")``.
* :func:`split_reference` - what a graph file records: ``(id or path, revision or None)``.
* :func:`checkpoint_name` - the short name two references are compared by (``LLaDA-8B-Instruct`` for the id, the
  id with a revision, its cache snapshot directory and a local directory called ``LLaDA-8B-Instruct``).
"""

from __future__ import annotations

import os
import re
from typing import Any

#: one part of a Hub repository id (``ORG`` or ``NAME``): letters, digits, ``-``, ``_``, ``.``; starts with a
#: letter or digit, at most 96 characters (the Hub's own limits).
_ID_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^(?P<repo>{_ID_PART}/{_ID_PART})(?:@(?P<rev>[^\s@]+))?$")
#: a model repository folder in a Hugging Face cache (huggingface_hub's ``repo_folder_name``)
_CACHE_FOLDER = re.compile(r"^models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)$")


def parse_hub_id(spec: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of a Hub reference ``ORG/NAME`` or ``ORG/NAME@REVISION``; ``None`` when ``spec`` is
    not shaped like one (a path such as ``/abs/dir``, ``./dir``, ``a/b/c`` or ``dir``).

    Whether a local directory of that name exists is the caller's question: an existing directory wins.
    """
    text = os.fspath(spec)
    match = _HUB_ID.match(text)
    if match is None:
        return None
    repo = match.group("repo")
    if ".." in repo or "--" in repo or any(p.endswith((".", "-")) for p in repo.split("/")):
        return None  # the Hub forbids these; such a string is meant as a path
    return repo, match.group("rev")


def hub_id_from_cache_path(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(repo_id, commit)`` when ``path`` is (inside) a snapshot of a Hugging Face cache
    (``<cache>/models--ORG--NAME/snapshots/<commit>[/...]``), else ``None``."""
    parts = [p for p in os.fspath(path).replace("\\", "/").split("/") if p]
    for k in range(len(parts) - 2):
        match = _CACHE_FOLDER.match(parts[k])
        if match and parts[k + 1] == "snapshots":
            return f"{match.group('org')}/{match.group('name')}", parts[k + 2]
    return None


def split_reference(reference: Any) -> tuple[Any, str | None]:
    """``(model, revision)`` as a graph file records them: a Hub id with a revision (``ORG/NAME@REV``) or a cache
    snapshot path becomes ``("ORG/NAME", "REV")``; anything else is returned unchanged with ``None``."""
    if not isinstance(reference, (str, os.PathLike)):
        return reference, None
    text = os.fspath(reference)
    cached = hub_id_from_cache_path(text)
    if cached is not None:
        return cached
    parsed = parse_hub_id(text)
    if parsed is not None and parsed[1] is not None:
        return parsed
    return text, None


def checkpoint_name(reference: Any) -> Any:
    """The name two model references are compared by: the repository name of a Hub id (any revision) or of a cache
    snapshot path, else the last component of a directory path (``/a/b/tiny-llada`` and ``C:\\x\\tiny-llada`` ->
    ``tiny-llada``). Non-strings are returned unchanged."""
    if not isinstance(reference, (str, os.PathLike)):
        return reference
    model, _ = split_reference(reference)
    text = os.fspath(model)
    parts = [p for p in text.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else text


__all__ = ["checkpoint_name", "hub_id_from_cache_path", "parse_hub_id", "split_reference"]
