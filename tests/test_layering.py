"""The import graph keeps the layering that docs/ARCHITECTURE.md draws.

Every module of the ``spiffy`` package is parsed (``ast``; imports at module level *and* inside functions, plus
the dotted module paths a lazy re-export resolves with ``importlib``), and each import is checked against
:data:`LAYERS`: a module may import its own layer or lower ones, never a higher layer, never a forbidden peer, and
no import cycle may join two packages or two files. ``spiffy/__init__.py`` is the roof (public re-exports,
transformers registration) and may import anything.

Exceptions are listed explicitly below, each with the reason it exists. :data:`EXCEPTIONS` must still occur (a stale
entry fails, so the list stays true); :data:`AR_PENDING` (now empty) listed the AR side's upward imports until the
AR half of the redesign removed them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

import spiffy

ROOT = Path(spiffy.__file__).resolve().parent

#: layer of each module prefix (the longest matching prefix wins), lowest first
LAYERS: dict[str, int] = {
    "spiffy._version": 0,
    "spiffy.errors": 0,
    "spiffy.io": 0,
    "spiffy.torch_utils": 0,
    "spiffy.checkpoint_ref": 0,
    "spiffy.sampling": 1,
    "spiffy.topk": 1,
    "spiffy.verify": 1,
    "spiffy.distributed": 1,
    "spiffy.models": 2,
    "spiffy.decoding": 3,
    "spiffy.selfspec": 4,
    "spiffy.arspec": 4,
    "spiffy.ar": 4,  # the AR package's old path (its stage functions move to spiffy.arspec)
    "spiffy.api": 5,
    "spiffy.compat": 5,
    "spiffy.embedded": 5,
    "spiffy.bench": 6,
    "spiffy.train": 6,
    "spiffy.cli": 7,
    "spiffy.__main__": 7,
}
LAYER_NAMES = {0: "base", 1: "kernels", 2: "models", 3: "decoding", 4: "methods", 5: "front door", 6: "tools", 7: "cli"}

#: same-layer packages that must not import each other (either direction)
FORBIDDEN_PEERS: tuple[tuple[str, str], ...] = (
    ("spiffy.selfspec", "spiffy.arspec"),
    ("spiffy.selfspec", "spiffy.ar"),
)

#: the roof: may import anything
ROOF = "spiffy"

#: (importer, imported module) pairs allowed to break the rule, and why. Each must still occur.
EXCEPTIONS: dict[tuple[str, str], str] = {  # none of them reaches spiffy.selfspec: decoding never imports it
    # deprecated one-release re-exports of the old front-door paths; resolved on first use (PEP 562)
    ("spiffy.decoding", "spiffy.api"): "deprecated lazy re-export of generate / DiffusionResult",
    ("spiffy.decoding", "spiffy.compat"): "deprecated lazy re-export of llada_generate / dream_diffusion_generate",
}

#: the AR side's known upward imports (none left: the AR half of the redesign removed them; kept so a regression
#: has to be listed here, with its reason, to pass)
AR_PENDING: dict[tuple[str, str], str] = {}

_MODULE_PATH = re.compile(r"^spiffy(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _resolve(dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a spiffy module (``spiffy.x.Name`` -> ``spiffy.x``)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in MODULES:
            return candidate
    return None


def _imports(module: str, path: Path) -> set[str]:
    """spiffy modules imported by ``module``: import statements anywhere in the file, and dotted module paths in
    string constants (what ``importlib.import_module`` and lazy re-export tables name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("spiffy"):
                    found.add(_resolve(alias.name) or alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("spiffy"):
                continue
            for alias in node.names:  # ``from spiffy.x import sub`` may name a submodule
                target = _resolve(f"{base}.{alias.name}")
                found.add(target if target is not None else (_resolve(base) or base))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_PATH.match(node.value):
            target = _resolve(node.value)
            if target is not None:
                found.add(target)
    found.discard(module)
    return found


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), layer)
    return None if best is None else best[1]


def _package(module: str) -> str:
    """The unit package cycles are counted between: ``spiffy.<sub>`` (a subpackage or a top-level module)."""
    return ".".join(module.split(".")[:2])


EDGES: dict[tuple[str, str], None] = {
    (m, t): None for m, p in MODULES.items() for t in sorted(_imports(m, p)) if t in MODULES
}


def _allowed(edge: tuple[str, str]) -> bool:
    return edge in EXCEPTIONS or edge in AR_PENDING


def _violation(importer: str, target: str) -> str | None:
    if importer == ROOF:
        return None
    a, b = _layer(importer), _layer(target)
    if a is None:
        return f"{importer} has no layer; add it to LAYERS in tests/test_layering.py and docs/ARCHITECTURE.md"
    if b is None:
        return f"{target} (imported by {importer}) has no layer; add it to LAYERS and docs/ARCHITECTURE.md"
    if b > a:
        return f"{importer} ({LAYER_NAMES[a]}, layer {a}) imports {target} ({LAYER_NAMES[b]}, layer {b})"
    for x, y in FORBIDDEN_PEERS:
        for p, q in ((x, y), (y, x)):
            if (importer == p or importer.startswith(p + ".")) and (target == q or target.startswith(q + ".")):
                return f"{importer} imports its forbidden peer {target}"
    return None


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in MODULES if m != ROOF and _layer(m) is None)
    assert not missing, f"modules without a layer (add them to LAYERS and docs/ARCHITECTURE.md): {missing}"


def test_no_module_imports_a_higher_layer_or_a_forbidden_peer() -> None:
    problems = []
    for importer, target in EDGES:
        reason = _violation(importer, target)
        if reason is not None and not _allowed((importer, target)):
            problems.append(reason)
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_decoding_never_imports_selfspec_except_the_listed_lazy_reexports() -> None:
    bad = sorted(
        (m, t)
        for m, t in EDGES
        if m.startswith("spiffy.decoding") and t.startswith("spiffy.selfspec") and (m, t) not in EXCEPTIONS
    )
    assert not bad, bad


def test_listed_exceptions_still_occur() -> None:
    stale = sorted(e for e in EXCEPTIONS if e not in EDGES)
    assert not stale, f"stale layering exceptions (remove them from EXCEPTIONS): {stale}"
    for edge in EXCEPTIONS:
        assert _violation(*edge) is not None, f"{edge} is listed as an exception but breaks no rule; remove it"


@pytest.mark.parametrize("unit", ["package", "file"])
def test_no_import_cycle(unit: str) -> None:
    graph = nx.DiGraph()
    for importer, target in EDGES:
        if importer == ROOF or _allowed((importer, target)):
            continue
        a, b = (_package(importer), _package(target)) if unit == "package" else (importer, target)
        if a != b:
            graph.add_edge(a, b)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, f"import cycles between {unit}s: {cycles[:5]}"


def test_the_checker_sees_function_level_and_lazy_imports(tmp_path: Path) -> None:
    """The parser finds an import inside a function and a lazy dotted path, so a hidden cycle cannot pass."""
    src = tmp_path / "probe.py"
    src.write_text(
        "def f():\n    from spiffy.selfspec.runtime import speculative_generate\n"
        "LAZY = {'x': 'spiffy.api'}\n",
        encoding="utf-8",
    )
    found = _imports("spiffy.decoding.probe", src)
    assert {"spiffy.selfspec.runtime", "spiffy.api"} <= found
    assert _violation("spiffy.decoding.probe", "spiffy.selfspec.runtime") is not None
    assert _violation("spiffy.decoding.probe", "spiffy.api") is not None
    assert _violation("spiffy.selfspec.runtime", "spiffy.decoding.session") is None


def test_decoding_never_imports_selfspec() -> None:
    """Not even lazily: the baseline decoders know nothing of the speculative method built on them."""
    offenders = sorted(
        f"{module} imports {imported}"
        for module, path in MODULES.items()
        if module.startswith("spiffy.decoding")
        for imported in _imports(module, path)
        if imported.startswith("spiffy.selfspec")
    )
    assert not offenders, offenders
