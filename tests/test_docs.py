"""docs/ARCHITECTURE.md and docs/EXTENDING.md are true: checked against the code on every run.

* The module tree of ARCHITECTURE.md names every module under ``spiffy/``, and every name in it is a module.
* Every ``module::attribute`` of its "Where a fact lives" table resolves.
* Every ``module::attribute``, dotted module and ``spiffy/...`` path EXTENDING.md names exists; it documents every
  field of a family's registry entry and every method of the decoding-session contract.

(The layer table is read by tests/test_layering.py, which checks the imports against it.)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import spiffy
from spiffy.decoding.session import DecodeSession
from spiffy.models.registry import FamilySpec

PACKAGE = Path(spiffy.__file__).resolve().parent
DOCS = PACKAGE.parent / "docs"
ARCHITECTURE = (DOCS / "ARCHITECTURE.md").read_text(encoding="utf-8")
EXTENDING = (DOCS / "EXTENDING.md").read_text(encoding="utf-8")

#: a tree line's module names: ``x.py`` or ``x/``, comma separated, then two spaces (or the end of the line)
_ENTRY = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*(?:\.py|/))(?:, [A-Za-z_][A-Za-z0-9_]*(?:\.py|/))*)(?:\s{2,}|$)")
#: backticked ``spiffy.module::attribute.path``
_REFERENCE = re.compile(r"`(spiffy(?:\.[A-Za-z_][A-Za-z0-9_]*)+)::([A-Za-z_][A-Za-z0-9_.]*)`")


def _modules() -> set[str]:
    """Every module under spiffy/, dotted (a package by its own name)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.add(".".join(parts))
    return found


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def tree_modules(text: str) -> set[str]:
    """The modules the fenced tree of the "Module tree" section names.

    Entry lines are indented two spaces per level (a ``x/`` entry opens package ``x`` for the lines one level
    deeper); any other line is a continuation of a description, indented at least eight spaces.
    """
    block = _section(text, "Module tree").split("```")[1].strip("\n").splitlines()
    assert block[0] == "spiffy/", f"the tree must start at spiffy/, got {block[0]!r}"
    named: set[str] = set()
    stack = ["spiffy"]
    for line in block[1:]:
        indent = len(line) - len(line.lstrip(" "))
        entry = _ENTRY.match(line.strip())
        if entry is None or indent not in (2, 4, 6):
            assert indent >= 8, f"tree line is neither an entry (indent 2, 4, 6) nor a continuation: {line!r}"
            continue
        depth = indent // 2
        assert depth <= len(stack), f"tree line deeper than its package: {line!r}"
        stack = stack[:depth]
        packages = []
        for name in entry.group(1).split(", "):
            module = f"{stack[-1]}.{name.rstrip('/').removesuffix('.py')}"
            named.add(module)
            if name.endswith("/"):
                packages.append(module)
        if len(packages) == 1:
            stack.append(packages[0])
    return named


def resolve(module: str, attribute: str) -> object:
    """``module.attribute`` (a dotted attribute path), imported."""
    value: object = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


def resolve_dotted(name: str) -> object:
    """A dotted module, or an attribute of the longest importable prefix (``spiffy.load_model``)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        return resolve(module.__name__, ".".join(parts[k:])) if k < len(parts) else module
    raise ModuleNotFoundError(name)


def test_the_tree_names_every_module_and_only_modules() -> None:
    named, real = tree_modules(ARCHITECTURE), _modules() - {"spiffy"}
    assert not real - named, f"modules missing from docs/ARCHITECTURE.md's tree: {sorted(real - named)}"
    assert not named - real, f"docs/ARCHITECTURE.md's tree names modules that do not exist: {sorted(named - real)}"


def test_the_tree_parser_sees_a_missing_or_made_up_module() -> None:
    """The check can fail: drop a module from the tree, or name one that does not exist."""
    dropped = ARCHITECTURE.replace("    factory.py ", "    factorx.py ", 1)
    assert "spiffy.decoding.factory" not in tree_modules(dropped)
    assert "spiffy.decoding.factorx" in tree_modules(dropped)
    with pytest.raises(AssertionError, match="neither an entry"):
        tree_modules(ARCHITECTURE.replace("    factory.py ", "   factory.py ", 1))


def test_every_fact_has_the_home_the_document_names() -> None:
    refs = _REFERENCE.findall(_section(ARCHITECTURE, "Where a fact lives"))
    assert len(refs) >= 20
    for module, attribute in refs:
        resolve(module, attribute)  # raises ImportError / AttributeError when the home moved


def test_extending_names_only_what_exists() -> None:
    refs = _REFERENCE.findall(EXTENDING)
    assert len(refs) >= 15
    for module, attribute in refs:
        resolve(module, attribute)
    for name in re.findall(r"`(spiffy(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", EXTENDING):
        resolve_dotted(name)
    for path in re.findall(r"`(spiffy/[^`<>\s]+)`", EXTENDING):
        assert (PACKAGE.parent / path).exists(), f"docs/EXTENDING.md names {path}, which does not exist"


def test_extending_documents_every_family_fact_and_the_session_contract() -> None:
    fields = [f.name for f in dataclasses.fields(FamilySpec)]
    missing = [f for f in fields if not re.search(rf"`{f}\b", EXTENDING)]
    assert not missing, f"FamilySpec fields docs/EXTENDING.md does not describe: {missing}"
    contract = _section(EXTENDING, "A decoding rule")
    abstract = [name for name, member in inspect.getmembers(DecodeSession) if getattr(member, "__isabstractmethod__", False)]
    assert abstract and not [m for m in abstract if f"`{m}`" not in contract and f"`{m}(" not in contract]
